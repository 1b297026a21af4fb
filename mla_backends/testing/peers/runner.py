"""Run the conformance suite over an engine's peer kernels and report one table (``mla-backends conformance
--engine``).

The checks are the suite's own (:mod:`mla_backends.testing.checks`, :mod:`..context_split`), called directly
rather than through pytest, over the same matrix (:func:`~mla_backends.testing.matrix.build_matrix`). Every
outcome is kept: a check that raises ``AssertionError`` is a failure with its worst element and diagnosis; any
other exception from a kernel is a failure too (``error: <type>: <message>``), never a traceback.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from ...backends.contract import MLABackend
from .. import checks, context_split
from ..cases import Case
from ..matrix import build_matrix
from . import Peer, engine_peers, engine_version

__all__ = ["CheckResult", "PeerReport", "run_peer", "run_engine", "format_table", "EngineReport"]

#: what a selection sees of each check: (test name, case or probe id)
Select = Callable[[str, str], bool]


@dataclass
class CheckResult:
    """One check on one case: ``status`` is ``passed``, ``failed`` or ``skipped``."""

    test: str
    case: str
    status: str
    worst: str = ""
    diagnosis: str = ""
    message: str = ""


@dataclass
class PeerReport:
    """The suite's verdicts on one peer kernel (or why it could not run)."""

    engine: str
    kernel: str
    call_site: str
    backend: str | None
    engine_version: str | None
    runnable: bool
    reason: str | None = None
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(passed=self.count("passed"), failed=self.count("failed"), skipped=self.count("skipped"))
        return out


@dataclass
class EngineReport:
    engine: str
    matrix: str
    device: str
    peers: list[PeerReport]

    @property
    def status(self) -> int:
        """0: every runnable peer passed (at least one ran); 1: a failure; 5: no peer could run here."""
        if any(p.failures for p in self.peers):
            return 1
        if not any(p.runnable and p.count("passed") for p in self.peers):
            return 5
        return 0

    def as_dict(self) -> dict:
        return {"engine": self.engine, "matrix": self.matrix, "device": self.device, "status": self.status,
                "peers": [p.as_dict() for p in self.peers]}


def _checks(cls: type[MLABackend], quick: bool, dev: torch.device, seeds: int | None = None,
            seed: int | None = None) -> Iterator[tuple[str, str, Case | None, Callable[[], None]]]:
    """Every check the pytest suite runs on ``dev``, as ``(test, id, case to gate on, call)``."""
    m = build_matrix(cls, quick, seeds, seed)
    for c in m.output:
        yield "output_matches_reference", c.id, c, lambda c=c: checks.check_output(cls, c, dev)
    for c in m.guard:
        yield "out_rows_outside_batch_untouched", c.id, c, lambda c=c: checks.check_out_rows_untouched(cls, c, dev)
        yield "inputs_not_written", c.id, c, lambda c=c: checks.check_inputs_not_written(cls, c, dev)
        why = context_split.context_split_skip_reason(cls, c)
        if why is None:
            yield "context_split_merge", c.id, c, lambda c=c: context_split.check_context_split(cls, c, dev)
        if cls.capabilities.host_sync_free and c.topk is None:
            yield "no_host_sync", c.id, c, lambda c=c: checks.check_no_host_sync(cls, c, dev)
    for c in m.determinism:
        yield "deterministic", c.id, c, lambda c=c: checks.check_deterministic(cls, c, dev)
    for d in m.declared:
        yield "declared_values_accepted", d.id, None, lambda d=d: checks.check_declared_accepted(
            cls, d.axis, d.value, d.case)
    for u in m.unsupported:
        yield "undeclared_combinations_rejected", u.id, None, lambda u=u: checks.check_unsupported_rejected(cls, u)
    if m.guard:
        g = m.guard[0]
        yield "rejects_bad_inputs", g.id, g, lambda: checks.check_rejects_bad_inputs(cls, g, dev)


def _failure(test: str, case: str, exc: BaseException) -> CheckResult:
    if isinstance(exc, checks.ComparisonFailure):
        worst = (f"{exc.what.split(' (')[0]}{exc.index}: got {exc.got:.6g}, float64 reference {exc.expected:.6g} "
                 f"(error {abs(exc.got - exc.expected):.3g}, allowed {exc.allowed:.3g}; {exc.criterion} criterion, "
                 f"judged by {exc.tol_key}; {exc.bad} of {exc.total} elements outside the element criterion)")
        diagnosis = exc.hint or "no known mistake reproduces it (beyond rounding: a kernel defect)"
        return CheckResult(test, case, "failed", worst, diagnosis, str(exc))
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, AssertionError):
        return CheckResult(test, case, "failed", "", text, str(exc))
    return CheckResult(test, case, "failed", "", f"error: {type(exc).__name__}: {text}", str(exc))


def run_peer(peer: Peer, *, quick: bool, device: torch.device, select: Select | None = None,
             progress: Callable[[str], None] | None = None, seeds: int | None = None,
             seed: int | None = None) -> PeerReport:
    """The suite over one peer on ``device`` (``select(test, id)`` picks checks; None: all); ``progress``
    gets a line when the peer starts and when it ends."""
    if not isinstance(peer, Peer):
        raise TypeError(f"peer: got {type(peer).__name__}; supported a Peer (mla_backends.testing.peers)")
    _check_options(quick, device)
    report = PeerReport(peer.engine, peer.kernel, peer.call_site, None, engine_version(peer.engine), False)
    why = peer.not_runnable(device)
    if why is not None:
        report.reason = why
        return report
    cls = peer.backend(device)
    report.backend, report.runnable = cls.name, True
    start = time.perf_counter()
    if progress is not None:
        progress(f"{cls.name} ({peer.kernel}): running the {'quick' if quick else 'full'} matrix on {device}")
    for test, ident, case, call in _checks(cls, quick, device, seeds, seed):
        if select is not None and not select(test, ident):
            continue
        if case is not None:
            reasons = checks.run_reasons(cls, case, device)
            if reasons:
                report.results.append(CheckResult(test, ident, "skipped", diagnosis="; ".join(map(str, reasons))))
                continue
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - every kernel failure is a verdict, never a traceback
            if type(exc).__name__ == "Skipped":  # pytest.skip inside a check (a CPU probe the backend accepts)
                report.results.append(CheckResult(test, ident, "skipped", diagnosis=str(exc)))
                continue
            report.results.append(_failure(test, ident, exc))
        else:
            report.results.append(CheckResult(test, ident, "passed"))
    report.seconds = time.perf_counter() - start
    if progress is not None:
        progress(f"{cls.name}: {report.count('passed')} passed, {report.count('failed')} failed, "
                 f"{report.count('skipped')} skipped in {report.seconds:.0f} s")
    return report


def _check_options(quick: object, device: object) -> None:
    if not isinstance(quick, bool):
        raise TypeError(f"quick: got {type(quick).__name__}; supported bool")
    if not isinstance(device, torch.device):
        raise TypeError(f"device: got {type(device).__name__}; supported torch.device")


def run_engine(engine: str, *, quick: bool, device: torch.device, select: Select | None = None,
               progress: Callable[[str], None] | None = None, seeds: int | None = None,
               seed: int | None = None) -> EngineReport:
    """The suite over every peer of ``engine``; peers that cannot run here are listed with the reason."""
    _check_options(quick, device)
    peers = [run_peer(p, quick=quick, device=device, select=select, progress=progress, seeds=seeds, seed=seed)
             for p in engine_peers(engine)]
    return EngineReport(engine, "quick" if quick else "full", str(device), peers)


def format_table(report: EngineReport) -> str:
    """The table ``mla-backends conformance --engine`` prints."""
    head = ("kernel", "backend", "engine", "passed", "failed", "skipped")
    rows = []
    for p in report.peers:
        if p.runnable:
            rows.append((p.kernel, p.backend or "", p.engine_version or "", f"{p.count('passed')}/{len(p.results)}",
                         str(p.count("failed")), str(p.count("skipped"))))
        else:
            rows.append((p.kernel, "-", p.engine_version or "not installed", "-", "-", "-"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    out = [f"conformance of {report.engine}'s MLA decode kernels ({report.matrix} matrix, device {report.device})",
           line(head), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    for p in report.peers:
        if not p.runnable:
            out.append(f"{p.kernel}: not runnable here: {p.reason}")
            continue
        for f in p.failures:
            out.append(f"{p.backend} FAILED {f.test}[{f.case}]")
            if f.worst:
                out.append(f"    worst: {f.worst}")
            out.append(f"    diagnosis: {f.diagnosis}")
            drawn = re.match(r"prop-s(\d+)-", f.case)
            if drawn:
                quick = " --quick" if report.matrix == "quick" else ""
                out.append(f"    reproduce: mla-backends conformance --engine {report.engine} --seeds 1 "
                           f"--seed {drawn.group(1)}{quick}")
    verdict = {0: "every runnable kernel passed", 1: "FAILED", 5: "not checked: no peer kernel could run here"}
    out.append(f"verdict: {verdict[report.status]}")
    return "\n".join(out)
