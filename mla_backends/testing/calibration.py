"""The suite's proof in both directions: the fault table (every fault of 1 % or more caught, in every dtype, with
the right hint or none) and the honest table (correct kernels pass, far from their allowances).

**Faults** (:data:`FAULTS`): each a REF_TORCH subclass from :mod:`.broken` with one mistake. Each runs the suite's
own output check (:func:`.checks.check_output`) on the quick matrix's decode sweep (which holds two requests of
equal length side by side), its multi-token case and its one-head case, in each dtype column
(:data:`COLUMNS`: float32, float16, bfloat16, and bfloat16 queries over an fp8 e4m3 cache with scale 0.37). A
fault's *effect* on a case is how far it moves REF_TORCH's own result on the same inputs: the largest relative
L2 change of a (token, head) output row, or the largest LSE change in nats (a shift of ``d`` nats moves an LSE
merge weight by ``e ** d``), whichever is larger. Where the effect exceeds :data:`EFFECT_THRESHOLD` (1 %) the
case must fail, and the hint it gets must be one the fault's row allows (or none).

**Honest backends**: a backend's quick matrix plus a property run of ``seeds`` random cases
(:func:`honest_rows`); per dtype column, the cases run and passed, and each criterion's worst measure over its
allowance (1.0 is the edge): how much room honest rounding leaves.

``python -m mla_backends.testing.calibration faults`` prints the fault table, ``... honest [--engine vllm|sglang]
[--seeds N]`` the honest one, both as the Markdown ``docs/conformance.md`` holds (run the vLLM and SGLang rows
in ``.venv-vllm`` / ``.venv-sglang``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..backends.contract import MLABackend
from ..core.dtypes import dtype_name
from ..ref_torch import RefTorchBackend
from . import broken, checks
from .cases import Case
from .inputs import prepare
from .matrix import build_matrix

__all__ = ["Fault", "FAULTS", "COLUMNS", "EFFECT_THRESHOLD", "fault_cases", "run_fault", "fault_table",
           "format_fault_table", "honest_rows", "format_honest_table", "main"]

#: a fault must be caught on every case it moves by more than this (relative output change or LSE nats)
EFFECT_THRESHOLD = 0.01

#: the dtype columns: (query dtype, cache dtype, fp8 scale)
COLUMNS: dict[str, tuple[torch.dtype, str, float]] = {
    "float32": (torch.float32, "float32", 1.0),
    "float16": (torch.float16, "float16", 1.0),
    "bfloat16": (torch.bfloat16, "bfloat16", 1.0),
    "fp8_e4m3": (torch.bfloat16, "fp8_e4m3", 0.37),
}

_SCALE = "looks like the softmax scale is off by a constant factor"
_CPU = torch.device("cpu")
_OOB = "looks like out-of-bounds reads"
_OUTPUT = "looks like the output is scaled by a constant factor"


@dataclass(frozen=True)
class Fault:
    """One row of the fault table: ``label``, the broken ``backend``, and the hints that are right for it:
    ``(text, value)`` pairs, a hint being right when it holds ``text`` followed by a number within 1 % of
    ``value`` (any number when ``value`` is None). A failure with no hint is always acceptable, any other hint
    is wrong."""

    label: str
    backend: type[MLABackend]
    hints: tuple[tuple[str, float | None], ...] = ()

    def right(self, hint: str) -> bool:
        """Whether ``hint`` is one this fault allows."""
        for text, value in self.hints:
            if text in hint:
                if value is None:
                    return True
                tail = hint.split(text, 1)[1].strip().split()
                try:
                    number = float(tail[0].rstrip(":,)(")) if tail else math.nan
                except ValueError:
                    continue
                if math.isclose(number, value, rel_tol=0.01):
                    return True
        return False


FAULTS: tuple[Fault, ...] = (
    Fault("softmax scale x1.005", broken.ScaleX1005Backend, ((_SCALE, 1.005),)),
    Fault("softmax scale x1.02", broken.ScaleX102Backend, ((_SCALE, 1.02),)),
    Fault("softmax scale x1.05", broken.ScaleX105Backend, ((_SCALE, 1.05),)),
    Fault("output x0.98", broken.OutputX098Backend, ((_OUTPUT, 0.98),)),
    Fault("output x1.05", broken.OutputX105Backend, ((_OUTPUT, 1.05),)),
    Fault("first context token dropped", broken.DropsFirstTokenBackend),
    Fault("last context token dropped", broken.DropsLastTokenBackend),
    Fault("one page read from a neighbour", broken.NeighbourPageBackend, ((_OOB, None),)),
    Fault("k_pe ignored", broken.IgnoresKpeBackend),
    Fault("k_pe negated", broken.NegatesKpeBackend),
    Fault("request i answered with request i+1's context", broken.NextRequestBackend),
    Fault("LSE in base 2", broken.Base2LseBackend, (("base-2 LSE", None),)),
    Fault("LSE shifted by 0.05", broken.ShiftedLseBackend, (("LSE is shifted by a constant", 0.05),)),
    Fault("fp8 cache read without its scale", broken.IgnoresFp8ScaleBackend,
          (("fp8 cache read without its scale", None),)),
    Fault("bf16 accumulation instead of fp32", broken.Bf16AccumulationBackend),
    Fault("reads slots no request owns (0 x NaN)", broken.UnownedReadsBackend, ((_OOB, None),)),
)


def fault_cases(column: str) -> list[Case]:
    """The quick matrix's decode sweep (an equal pair inside), multi-token and one-head cases of REF_TORCH, in
    the dtypes of ``column``."""
    dtype, kv, scale = COLUMNS[column]
    quick = build_matrix(RefTorchBackend, True)
    picked = [next(c for c in quick.output if c.name == name) for name in ("ctx-sweep", "q3", "heads")]
    picked[2] = next(c for c in quick.output if c.name == "heads" and c.num_heads == 1)
    return [dataclasses.replace(c, dtype=dtype, kv_cache_dtype=kv, fp8_scale=scale) for c in picked]


@dataclass
class Outcome:
    """One fault on one case: its effect on the output (largest relative change of a row) and on the LSE
    (largest change, nats), whether the suite ``caught`` it, the failing ``criterion`` and the ``hint`` given."""

    case: str
    effect_out: float
    effect_lse: float
    caught: bool
    criterion: str = ""
    hint: str = ""
    what: str = ""  # "output" or "LSE": the comparison that failed first (the output is judged first)

    @property
    def effect(self) -> float:
        return max(self.effect_out, self.effect_lse)


def _effect(cls: type[MLABackend], case: Case, device: torch.device) -> tuple[float, float]:
    """``(output effect, LSE effect)`` of ``cls`` against REF_TORCH on ``case``'s inputs."""
    p = prepare(case, device)
    base_out, base_lse = p.call(checks.make_backend(RefTorchBackend, device))
    out, lse = p.call(checks.make_backend(cls, device))
    ref = base_out.double()
    rows = (out.double() - ref).pow(2).sum(-1).sqrt() / ref.pow(2).sum(-1).sqrt().clamp_min(1e-300)
    effect_out = float(rows.nan_to_num(math.inf, posinf=math.inf).max())
    effect_lse = 0.0
    if lse is not None and base_lse is not None:
        diff = (lse.double() - base_lse.double()).abs()
        same = torch.isinf(lse) & (lse == base_lse)
        effect_lse = float(torch.where(same, 0.0, diff).nan_to_num(math.inf, posinf=math.inf).max())
    return effect_out, effect_lse


def run_fault(fault: Fault, case: Case, device: torch.device = _CPU) -> Outcome:
    """``fault`` through the suite's output check on ``case``: its effect, and whether (and how) it was caught."""
    effect_out, effect_lse = _effect(fault.backend, case, device)
    try:
        checks.check_output(fault.backend, case, device)
    except checks.ComparisonFailure as exc:
        what = "LSE" if exc.what.startswith("LSE") else "output"
        return Outcome(case.id, effect_out, effect_lse, True, exc.criterion, exc.hint, what)
    except AssertionError as exc:  # shape / dtype / contract
        return Outcome(case.id, effect_out, effect_lse, True, "contract", str(exc).splitlines()[0][:80], "output")
    return Outcome(case.id, effect_out, effect_lse, False)


@dataclass
class Cell:
    """One fault in one dtype column."""

    fault: Fault
    column: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def effect(self) -> float:
        return max((o.effect for o in self.outcomes), default=0.0)

    def effect_text(self) -> str:
        """The largest output and LSE effects as percentages, ``output / LSE``."""
        out = max((o.effect_out for o in self.outcomes), default=0.0)
        lse = max((o.effect_lse for o in self.outcomes), default=0.0)
        return f"{_effect_text(out)} / {_effect_text(lse)}"

    @property
    def required(self) -> list[Outcome]:
        """The cases the fault moves by more than :data:`EFFECT_THRESHOLD`: each must be caught."""
        return [o for o in self.outcomes if o.effect > EFFECT_THRESHOLD]

    @property
    def missed(self) -> list[Outcome]:
        """Required cases not caught, or whose output moved by more than the threshold but passed the output's
        criteria (caught by the LSE only: a backend without an LSE would have passed)."""
        return [o for o in self.required
                if not o.caught or (o.effect_out > EFFECT_THRESHOLD and o.what != "output")]

    @property
    def wrong_hints(self) -> list[str]:
        """Hints given that the fault's row does not allow."""
        return [o.hint for o in self.outcomes if o.hint and not self.fault.right(o.hint)]

    @property
    def hints(self) -> list[str]:
        return sorted({o.hint.split(" (")[0].split(": ")[0].split(" = ")[0] for o in self.outcomes if o.hint})

    def verdict(self) -> str:
        """``caught`` (``by the LSE`` when only the LSE's criteria failed) / ``MISSED`` / ``below 1 %`` (and
        whether it was caught anyway)."""
        if self.missed:
            return "MISSED"
        if not self.required:
            return "below 1 %, " + ("caught anyway" if any(o.caught for o in self.outcomes) else "passes")
        if all(o.what == "LSE" for o in self.outcomes if o.caught):
            return "caught by the LSE"
        return "caught"


def fault_table(faults: Sequence[Fault] = FAULTS, columns: Iterable[str] = COLUMNS,
                device: torch.device = _CPU) -> list[Cell]:
    """Every fault on every column's cases."""
    cells = []
    for fault in faults:
        for column in columns:
            cell = Cell(fault, column)
            for case in fault_cases(column):
                cell.outcomes.append(run_fault(fault, case, device))
            cells.append(cell)
    return cells


def _effect_text(effect: float) -> str:
    if not math.isfinite(effect):
        return "inf"
    if effect == 0:
        return "0"
    return f"{100 * effect:.2g} %" if effect < 1 else f"{100 * effect:.0f} %"


def format_fault_table(cells: Sequence[Cell]) -> str:
    """The fault table as Markdown: one row per fault, per column the largest output and LSE effects and the
    verdict, and the hints given."""
    columns = list(dict.fromkeys(c.column for c in cells))
    head = "| fault (effect: output / LSE) | " + " | ".join(columns) + " | hint given |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    for fault in dict.fromkeys(c.fault for c in cells):
        row = [c for c in cells if c.fault is fault]
        by_col = {c.column: c for c in row}
        parts = [f"{by_col[col].effect_text()}: {by_col[col].verdict()}" for col in columns]
        given = sorted({h for c in row for h in c.hints})
        wrong = [h for c in row for h in c.wrong_hints]
        hint_text = "; ".join(given) if given else "none"
        if wrong:
            hint_text += f" (WRONG: {'; '.join(sorted(set(wrong)))})"
        lines.append(f"| {fault.label} | " + " | ".join(parts) + f" | {hint_text} |")
    return "\n".join(lines)


# ---- the honest side ---------------------------------------------------------------------------------------
def _column_of(case: Case) -> str:
    if case.kv_cache_dtype.startswith("fp8"):
        return f"{dtype_name(case.dtype)}/fp8"
    if case.kv_cache_dtype != dtype_name(case.dtype):
        return f"{dtype_name(case.dtype)}/{case.kv_cache_dtype}"
    return dtype_name(case.dtype)


@dataclass
class HonestRow:
    """One honest backend in one dtype column: cases run, passed, and the worst measure of each criterion."""

    backend: str
    column: str
    cases: int = 0
    passed: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def honest_rows(cls: type[MLABackend], *, seeds: int = 8, device: torch.device | None = None,
                label: str | None = None) -> list[HonestRow]:
    """``cls`` over its quick matrix plus ``seeds`` random cases, grouped by dtype column (``device``: where the
    suite would run it, :func:`.checks.pick_device`)."""
    device = device or checks.pick_device(cls)
    cases = list(build_matrix(cls, True, seeds=seeds).output)
    rows: dict[str, HonestRow] = {}
    for case in cases:
        if checks.run_reasons(cls, case, device):
            continue
        row = rows.setdefault(_column_of(case), HonestRow(label or cls.name, _column_of(case)))
        measures = checks.measure_output(cls, case, device)
        row.cases += 1
        if all(v <= 1.0 for v in measures.values()):
            row.passed += 1
        else:
            row.failures.append(case.id)
        for k, v in measures.items():
            row.worst[k] = max(row.worst.get(k, 0.0), v)
    return sorted(rows.values(), key=lambda r: r.column)


_MEASURES = ("element", "row", "bias", "lse", "lse offset", "band", "lse band")


def format_honest_table(rows: Sequence[HonestRow]) -> str:
    """The honest table as Markdown: per backend and column, cases passed and each criterion's worst measure
    over its allowance."""
    present = [m for m in _MEASURES if any(m in r.worst for r in rows)]
    lines = ["| backend | dtype | passed | " + " | ".join(f"worst {m}" for m in present) + " |",
             "|" + "---|" * (3 + len(present))]
    for r in rows:
        cells = [f"{r.worst[m]:.2g}" if m in r.worst else "-" for m in present]
        lines.append(f"| {r.backend} | {r.column} | {r.passed}/{r.cases} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _honest_backends(engine: str | None) -> list[tuple[str, type[MLABackend]]]:
    if engine is not None:
        from .peers import engine_peers

        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return [(p.backend(dev).name, p.backend(dev)) for p in engine_peers(engine) if p.not_runnable(dev) is None]
    out: list[tuple[str, type[MLABackend]]] = [("REF_TORCH", RefTorchBackend)]
    from ..cpu_fused import CpuFusedBackend, build

    if build.is_built():  # the compiled CPU kernel, where `mla-backends build` made it for this machine
        out.append(("CPU_FUSED", CpuFusedBackend))
    try:
        import triton  # noqa: F401

        from ..triton_mla import TritonMLABackend

        cpu = torch.device("cpu")
        out.append(("TRITON_MLA" + ("" if torch.cuda.is_available() else " (interpreted)"),
                    checks.judged_class(TritonMLABackend, torch.device("cuda") if torch.cuda.is_available() else cpu)))
    except ImportError:
        pass
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mla_backends.testing.calibration faults|honest [--engine E] [--seeds N]``: print a table."""
    parser = argparse.ArgumentParser(prog="python -m mla_backends.testing.calibration", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("table", choices=("faults", "honest"))
    parser.add_argument("--engine", choices=("vllm", "sglang"), default=None,
                        help="honest: that engine's peer kernels instead of the built-in backends")
    parser.add_argument("--seeds", type=int, default=8, help="honest: random cases per backend (default 8)")
    args = parser.parse_args(argv)
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    if args.table == "faults":
        cells = fault_table()
        print(format_fault_table(cells))
        bad = [c for c in cells if c.missed or c.wrong_hints]
    else:
        rows = [r for label, cls in _honest_backends(args.engine) for r in honest_rows(cls, seeds=args.seeds,
                                                                                      label=label)]
        print(format_honest_table(rows))
        bad = [r for r in rows if r.failures]
        for r in bad:
            print(f"{r.backend} {r.column} FAILED: {', '.join(r.failures)}")
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
