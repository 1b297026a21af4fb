"""The checks of the conformance suite, as plain functions that raise ``AssertionError`` with a diagnosis.

:class:`~mla_backends.testing.suite.BackendConformance` wraps each one in a pytest test; they can also be
called directly (``check_output(MyBackend, case, torch.device("cpu"))``).

Inputs and expected values come from :mod:`.inputs` (:func:`prepare`, :func:`expected`, re-exported here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..backends.contract import MLABackend
from ..backends.reasons import Reason, ReasonKind, as_reason
from ..core.device import device_info_for
from ..core.dtypes import lse_dtype
from ..step.metadata import BatchMetadata
from .cases import Case, UnsupportedProbe, declared_reasons
from .hints import OUT_OF_BOUNDS_HINT, fp8_scale_hint, lse_hints, output_scale_hint, scale_hint
from .inputs import GUARD_ROWS, SENTINEL, Prepared, expected, honest, prepare
from .judge import Standard
from .tolerances import lse_tolerance, precision_for, tolerance_for

__all__ = [
    "Prepared",
    "prepare",
    "expected",
    "tolerance_for",
    "standard_for",
    "unowned_hint",
    "run_reasons",
    "judged_class",
    "make_backend",
    "check_output",
    "measure_output",
    "check_out_rows_untouched",
    "check_inputs_not_written",
    "check_deterministic",
    "check_declared_accepted",
    "check_unsupported_rejected",
    "check_rejects_bad_inputs",
    "check_no_host_sync",
    "assert_judged",
    "ComparisonFailure",
]

# ---- devices ---------------------------------------------------------------------------------------------
def pick_device(cls: type[MLABackend], preference: str = "auto") -> torch.device:
    """Where the suite runs ``cls``: ``auto`` is CUDA when present and declared fitting, else the CPU."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: got {preference!r}; supported 'auto', 'cpu', 'cuda'")
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        if preference == "cuda" or not cls.device_reasons(device_info_for(dev)):
            return dev
    if preference == "cuda":
        return torch.device("cuda")  # not available: run_reasons reports it
    return torch.device("cpu")


def judged_class(cls: type[MLABackend], device: torch.device) -> type[MLABackend]:
    """``cls`` as the suite judges it on ``device``: on a CPU, its ``interpreted()`` variant when the class
    defines one (a Triton kernel runs under Triton's interpreter there, whose bf16 arithmetic is not the
    GPU's: TRITON_MLA and vLLM's Triton peer withhold bf16 in it); else ``cls`` itself."""
    variant = getattr(cls, "interpreted", None)
    if device.type != "cuda" and callable(variant):
        return variant()
    return cls


def run_reasons(cls: type[MLABackend], case: Case, device: torch.device) -> list[Reason]:
    """Why ``case`` cannot run here (empty when it can): CUDA missing, or the backend's own reasons."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return [Reason(ReasonKind.DEVICE, "device", "no CUDA device (torch.cuda.is_available() is False)",
                       "a CUDA device")]
    if case.rejected:
        return [as_reason(
            f"declared but rejected by not_supported_reasons ({'; '.join(case.rejected)}); "
            "see test_declared_values_accepted"
        )]
    return [as_reason(r) for r in cls.not_supported_reasons(case.spec(device_info_for(device)))]


_INSTANCES: dict[tuple[type[MLABackend], str], MLABackend] = {}


def make_backend(cls: type[MLABackend], device: torch.device) -> MLABackend:
    """One instance per backend class and device (constructed with no arguments)."""
    key = (cls, str(device))
    if key not in _INSTANCES:
        _INSTANCES[key] = cls()
    return _INSTANCES[key]


# ---- comparisons -----------------------------------------------------------------------------------------
class ComparisonFailure(AssertionError):
    """A comparison against the reference that failed, with its worst element as data (the message says
    the same): ``what`` was compared, ``index`` of the worst element, ``got`` / ``expected`` / ``allowed`` there,
    ``max_error`` over all elements, ``bad`` / ``total`` elements outside the element criterion, ``criterion``
    that failed worst (``element``, ``row``, ``bias``, ``offset`` or a declared ``band``; :mod:`.judge`),
    ``tol_key`` (what the case is judged by), ``hint`` (the diagnosis, ``""`` when no known mistake explains the
    result) and ``where`` (the case)."""

    def __init__(self, message: str, *, what: str, index: list[int], got: float, expected: float,
                 max_error: float, bad: int, total: int, allowed: float, criterion: str, tol_key: str, hint: str,
                 where: str) -> None:
        super().__init__(message)
        self.what, self.index, self.got, self.expected = what, index, got, expected
        self.max_error, self.bad, self.total, self.hint, self.where = max_error, bad, total, hint, where
        self.allowed, self.criterion, self.tol_key = allowed, criterion, tol_key


def standard_for(cls: type[MLABackend], p: Prepared) -> Standard:
    """The case's :class:`~mla_backends.testing.judge.Standard` for ``cls``: the float64 reference, the honest
    rounding under the backend's declared (or the default) :class:`Precision`, or its declared band."""
    case = p.case
    ref_out, ref_lse = expected(p)
    key, band = tolerance_for(cls, case.dtype, case.kv_cache_dtype)
    pkey, precision = precision_for(cls, case.dtype, case.kv_cache_dtype)
    honest_out, honest_lse = honest(p, precision)
    if band is None and pkey != "default":
        key = f"{key}, declared precision {pkey}"
    return Standard(ref_out, ref_lse, honest_out, honest_lse, precision, band=band,
                    lse_band=lse_tolerance(band, case.dtype) if band is not None else None, key=key,
                    out_dtype=case.dtype)


def assert_judged(
    what: str,
    got: torch.Tensor,
    standard: Standard,
    where: str,
    meta: BatchMetadata | None = None,
    *,
    lse: bool = False,
    hint: Callable[[torch.Tensor], str] | None = None,
) -> None:
    """``got`` passes ``standard``'s criteria (the output's, or the LSE's with ``lse``), else a
    :class:`ComparisonFailure` (an ``AssertionError``) naming the criterion and the worst element; on failure
    ``hint(got as float64)`` may add a diagnosis (:mod:`.hints`; the LSE's by default)."""
    g = got.detach().cpu().to(torch.float64)
    ref = standard.ref_lse if lse else standard.ref_out
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: got shape {list(g.shape)}; expected {list(ref.shape)} [{where}]")
    verdict = standard.judge_lse(g) if lse else standard.judge(g)
    if verdict.ok:
        return
    idx = verdict.index
    token = idx[0] if idx else 0
    req = ""
    if meta is not None and idx:
        caller_req = int(meta.order[int(meta.token_request[token])])
        req = f" (caller request {caller_req}, position {int(meta.token_positions[token])})"
    if hint is None and lse:
        hint = functools.partial(lse_hints, standard=standard)
    note = hint(g) if hint is not None else ""
    raise ComparisonFailure(
        f"{what}: fails the {verdict.criterion} criterion ({verdict.text}; judged by {standard.key}); "
        f"{verdict.bad} of {verdict.total} elements outside the element criterion; worst element at index "
        f"{idx}, token {token}{req}: got {verdict.got:.6g}, expected {verdict.expected:.6g}, allowed error "
        f"{verdict.allowed:.3g}, max error {verdict.max_error:.3g}{note} [{where}]",
        what=what, index=idx, got=verdict.got, expected=verdict.expected, max_error=verdict.max_error,
        bad=verdict.bad, total=verdict.total, allowed=verdict.allowed, criterion=verdict.criterion,
        tol_key=standard.key, hint=note.removeprefix(" -- "), where=where,
    )


def unowned_hint(cls: type[MLABackend], p: Prepared, out: torch.Tensor, standard: Standard) -> str:
    """The out-of-bounds diagnosis of a failed output ``out`` (float64): the same call with every slot no
    request owns zeroed instead of poisoned (:func:`.inputs.prepare`); when its output differs beyond the case's
    criteria (or in finiteness), the kernel reads slots no request owns. ``""`` otherwise."""
    clean = prepare(p.case, p.q_latent.device, poison=False)
    other, _ = clean.call(make_backend(cls, p.q_latent.device))
    other = other.detach().cpu().to(torch.float64)
    if not torch.isfinite(other).all() and not torch.isfinite(out).all():
        return ""  # non-finite either way: not the poison
    if standard.judge(out, other).ok:
        return ""
    return f" -- {OUT_OF_BOUNDS_HINT}"


def _output_hint(cls: type[MLABackend], p: Prepared, standard: Standard, got: torch.Tensor,
                 lse: torch.Tensor | None) -> str:
    """The diagnosis of a failed output (``lse``: the backend's LSE, float64, when it returns one): out-of-bounds
    reads, else a softmax-scale mistake, an output scaled by a constant, an fp8 cache read without its scale
    (the first that explains it; ``""`` when none does)."""
    oob = unowned_hint(cls, p, got, standard)
    if oob or not bool(torch.isfinite(got).all()):
        return oob
    return (scale_hint(p, got, standard, lse) or output_scale_hint(got, standard)
            or fp8_scale_hint(p, got, standard))


def _check_result(cls: type[MLABackend], p: Prepared, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    case = p.case
    T = sum(case.query_lens)
    where = case.describe()
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"forward_mqa returned {type(out).__name__} as out; expected a tensor [{where}]")
    if tuple(out.shape) != (T, case.num_heads, case.kv_lora_rank) or out.dtype != case.dtype:
        raise AssertionError(
            f"out: got shape {list(out.shape)} dtype {out.dtype}; expected "
            f"[{T}, {case.num_heads}, {case.kv_lora_rank}] {case.dtype} [{where}]"
        )
    if out.device != p.q_latent.device:
        raise AssertionError(
            f"out: got device {out.device}; expected the query's {p.q_latent.device} [{where}]"
        )
    lse64 = None
    if cls.capabilities.returns_lse:
        if lse is None:
            raise AssertionError(f"LSE: got None, but capabilities.returns_lse is True [{where}]")
        if tuple(lse.shape) != (T, case.num_heads) or lse.dtype != lse_dtype(case.dtype):
            raise AssertionError(
                f"LSE: got shape {list(lse.shape)} dtype {lse.dtype}; expected "
                f"[{T}, {case.num_heads}] {lse_dtype(case.dtype)} [{where}]"
            )
        lse64 = lse.detach().cpu().to(torch.float64)
    standard = standard_for(cls, p)
    assert_judged("output (latent space)", out, standard, where, p.meta,
                  hint=lambda got: _output_hint(cls, p, standard, got, lse64))
    if lse64 is not None:
        out64 = out.detach().cpu().to(torch.float64)
        assert_judged("LSE (natural log)", lse64, standard, where, p.meta, lse=True,
                      hint=lambda got: lse_hints(got, standard) or scale_hint(p, out64, standard, got))


# ---- the checks ------------------------------------------------------------------------------------------
def check_output(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """Output and LSE pass the case's criteria against the float64 expanded reference (:mod:`.judge`: multiples
    of the case's honest rounding, or a declared band)."""
    p = prepare(case, device)
    out, lse = p.call(make_backend(cls, device))
    _check_result(cls, p, out, lse)


def measure_output(cls: type[MLABackend], case: Case, device: torch.device) -> dict[str, float]:
    """Each criterion's measure over its allowance for ``cls`` on ``case`` (at most 1.0 passes; no hints, no
    exception): ``element``, ``row``, ``bias`` of the output, ``lse`` and ``lse offset`` of the LSE (backends
    with one), or ``band`` / ``lse band`` under a declared band. The honest table (:mod:`.calibration`) reports
    their worst over many cases."""
    p = prepare(case, device)
    out, lse = p.call(make_backend(cls, device))
    standard = standard_for(cls, p)
    verdict = standard.judge(out.detach().cpu().to(torch.float64))
    measures = dict(verdict.measures) or {"band": verdict.badness}
    if lse is not None and cls.capabilities.returns_lse:
        lv = standard.judge_lse(lse.detach().cpu().to(torch.float64))
        if lv.measures:
            measures.update({"lse": lv.measures["element"], "lse offset": lv.measures["offset"]})
        else:
            measures["lse band"] = lv.badness
    return measures


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (so NaNs and signed zeros compare exactly)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.detach().contiguous()
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def check_out_rows_untouched(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """With ``out=``/``lse_out=`` slices of larger buffers, rows outside the batch keep their sentinel values,
    and the result lands in the given buffers."""
    p = prepare(case, device)
    T, H, r = p.q_latent.shape
    G = GUARD_ROWS
    big = torch.full((G + T + G, H, r), SENTINEL, dtype=p.q_latent.dtype, device=device)
    big_lse = torch.full((G + T + G, H), SENTINEL, dtype=lse_dtype(p.q_latent.dtype), device=device)
    before, before_lse = _bits(big).clone(), _bits(big_lse).clone()
    kw = {"out": big[G : G + T]}
    if cls.capabilities.returns_lse:
        kw["lse_out"] = big_lse[G : G + T]
    out, lse = p.call(make_backend(cls, device), **kw)
    where = case.describe()
    for name, buf, ref in (("out", big, before), ("lse_out", big_lse, before_lse)):
        changed = (_bits(buf) != ref).reshape(G + T + G, -1).any(dim=1).tolist()
        rows = [i - G for i, c in enumerate(changed) if c and not G <= i < G + T]
        if rows:
            raise AssertionError(
                f"{name}: rows {rows} relative to the batch's first token were written, but only "
                f"rows 0..{T - 1} belong to the batch (guard band of {G} rows) [{where}]"
            )
    if not torch.equal(_bits(out), _bits(big[G : G + T])):
        raise AssertionError(f"out: the returned tensor differs from the out= buffer it was given [{where}]")
    if cls.capabilities.returns_lse and (
        lse is None or not torch.equal(_bits(lse), _bits(big_lse[G : G + T]))
    ):
        raise AssertionError(
            f"lse_out: the returned LSE differs from the lse_out= buffer it was given [{where}]"
        )
    _check_result(cls, p, out, lse)


def check_inputs_not_written(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """``forward_mqa`` never writes the cache (data or scale), the queries, the top-k lists or the
    metadata."""
    p = prepare(case, device)
    watched = {
        "cache.data": p.cache.data,
        "cache.scale": p.cache.scale,
        "q_latent": p.q_latent,
        "q_rope": p.q_rope,
        "meta.block_table": p.meta.block_table,
        "meta.seq_lens": p.meta.seq_lens,
        "meta.slot_mapping": p.meta.slot_mapping,
    }
    if p.topk is not None:
        watched["topk_indices"] = p.topk
    before = {k: _bits(v).clone() for k, v in watched.items()}
    p.call(make_backend(cls, device))
    for name, t in watched.items():
        changed = _bits(t) != before[name]
        if bool(changed.any()):
            first = [int(i) for i in changed.nonzero()[0]]
            raise AssertionError(
                f"{name}: {int(changed.sum())} elements were modified by forward_mqa (first at "
                f"index {first}); the call must only read it [{case.describe()}]"
            )


def check_deterministic(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """The same inputs twice give bitwise-equal output and LSE (within the case's criteria of the first run if
    declared non-deterministic)."""
    p = prepare(case, device)
    backend = make_backend(cls, device)
    out1, lse1 = p.call(backend)
    out1, lse1 = out1.clone(), (lse1.clone() if lse1 is not None else None)
    out2, lse2 = p.call(backend)
    where = case.describe()
    pairs = [("output", out1, out2)]
    if cls.capabilities.returns_lse and lse1 is not None and lse2 is not None:
        pairs.append(("LSE", lse1, lse2))
    for name, a, b in pairs:
        if cls.capabilities.deterministic:
            diff = _bits(a) != _bits(b)
            if bool(diff.any()):
                raise AssertionError(
                    f"{name}: {int(diff.sum())} of {diff.numel()} elements differ bitwise between two runs "
                    "on the same inputs; declare capabilities.deterministic=False if that is intended "
                    f"[{where}]"
                )
        else:  # within the case's criteria of the first run
            standard = standard_for(cls, p).rebased(a.cpu().to(torch.float64), lse=name == "LSE")
            assert_judged(f"{name} (second run vs first)", b, standard, where, lse=name == "LSE")


def check_declared_accepted(cls: type[MLABackend], axis: str, value: str, case: Case) -> None:
    """A declared value is accepted by ``not_supported_reasons`` in at least one combination."""
    if case.rejected:
        raise AssertionError(
            f"{cls.name} declares {axis} {value}, but not_supported_reasons rejected every combination tried "
            f"with it; first reasons: {'; '.join(case.rejected)}"
        )
    reasons = declared_reasons(cls, case.spec())
    if reasons:
        raise AssertionError(
            f"{cls.name}: not_supported_reasons rejects its declared {axis} {value} "
            f"({case.id} on {case.device.describe()}): {'; '.join(map(str, reasons))}"
        )


def check_unsupported_rejected(cls: type[MLABackend], probe: UnsupportedProbe) -> None:
    """A combination outside the declarations gets at least one non-empty reason."""
    reasons = cls.not_supported_reasons(probe.spec)
    if not reasons and probe.label == "device-cpu" and not cls.device_reasons(probe.spec.device):
        import pytest

        pytest.skip(
            f"{cls.name} declares cpu=False but accepts the CPU at run time (an interpreter or testing "
            "mode); the output tests run it there instead"
        )
    if not isinstance(reasons, list) or not reasons:
        raise AssertionError(
            f"{cls.name}: not_supported_reasons returned {reasons!r} for {probe.label}, which "
            f"its capabilities do not declare ({probe.spec}); expected at least one reason"
        )
    bad = [r for r in reasons if not isinstance(r, (Reason, str)) or not str(r).strip()]
    if bad:
        raise AssertionError(
            f"{cls.name}: not_supported_reasons for {probe.label} contains empty or non-Reason "
            f"reasons {bad!r}; expected readable 'got X; supported Y' reasons"
        )


def check_rejects_bad_inputs(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """Mismatched inputs raise ``ValueError``/``TypeError`` before any kernel runs (and write nothing)."""
    p = prepare(case, device)
    backend = make_backend(cls, device)
    before = _bits(p.cache.data).clone()
    T, H, _ = p.q_latent.shape
    bad_inputs = {
        "q_rope with a different head count": dict(
            q_rope=p.q_rope[:, : max(H - 1, 0)] if H > 1 else p.q_rope.repeat(1, 2, 1)
        ),
        "q_latent of a different width": dict(q_latent=p.q_latent[..., :-1]),
        "a non-positive scale": dict(scale=-1.0),
    }
    for label, change in bad_inputs.items():
        args = {"q_latent": p.q_latent, "q_rope": p.q_rope, "scale": p.scale}
        args.update(change)
        try:
            backend.forward_mqa(
                args["q_latent"], args["q_rope"], p.cache, p.meta, scale=args["scale"], topk_indices=p.topk
            )
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(
                f"forward_mqa accepted {label}; expected ValueError or TypeError naming the "
                f"argument [{case.describe()}]"
            )
    if not torch.equal(_bits(p.cache.data), before):
        raise AssertionError(f"cache.data: modified by a call that was rejected [{case.describe()}]")


def check_no_host_sync(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """A backend declaring ``host_sync_free`` makes no device-to-host sync in a dense ``forward_mqa`` once the
    step's metadata is built and planned (:func:`mla_backends.core.host_sync.no_host_sync`; a warm-up call first
    loads its kernels, then the step is planned outside the guard and run under it)."""
    from ..core.host_sync import HostSyncError, no_host_sync
    from ..step.plan import plan_step

    p = prepare(case, device)
    backend = make_backend(cls, device)
    p.call(backend)  # loads kernels, compiles: first-use work is not per-step work
    plan = plan_step(p.meta, [backend])  # the engine's per-step call, outside the guard
    try:
        with no_host_sync():
            backend.forward_mqa(p.q_latent, p.q_rope, p.cache, p.meta, scale=p.scale, plan=plan)
    except HostSyncError as exc:
        raise AssertionError(
            f"{cls.name} declares host_sync_free=True, but forward_mqa synchronised: {exc}; fix the call or "
            f"declare host_sync_free=False [{case.describe()}]"
        ) from exc
