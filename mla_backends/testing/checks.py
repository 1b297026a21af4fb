"""The checks of the conformance suite, as plain functions that raise ``AssertionError`` with a diagnosis.

:class:`~mla_backends.testing.suite.BackendConformance` wraps each one in a pytest test; they can also be
called directly (``check_output(MyBackend, case, torch.device("cpu"))``).

Inputs and expected values come from :mod:`.inputs` (:func:`prepare`, :func:`expected`, re-exported here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..backends.contract import DEFAULT_TOLERANCES, MLABackend, Tolerance
from ..backends.reasons import Reason, ReasonKind, as_reason
from ..core.device import device_info_for
from ..core.dtypes import dtype_name, lse_dtype
from ..step.metadata import BatchMetadata
from .cases import Case, UnsupportedProbe, declared_reasons
from .hints import lse_base_hint, scale_hint
from .inputs import GUARD_ROWS, SENTINEL, Prepared, expected, prepare

__all__ = [
    "Prepared",
    "prepare",
    "expected",
    "tolerance_for",
    "run_reasons",
    "make_backend",
    "check_output",
    "check_out_rows_untouched",
    "check_inputs_not_written",
    "check_deterministic",
    "check_declared_accepted",
    "check_unsupported_rejected",
    "check_rejects_bad_inputs",
    "check_no_host_sync",
    "assert_close",
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
def tolerance_for(cls: type[MLABackend], dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, Tolerance]:
    """The declared tolerance for a case: ``"<dtype>/<cache>"``, then ``"<cache>"`` (fp8 only), then
    ``"<dtype>"`` in ``capabilities.tolerances``, falling back to the package defaults."""
    tols = cls.capabilities.tolerances or {}
    name = dtype_name(dtype)
    keys = (
        [f"{name}/{kv_cache_dtype}"] + ([kv_cache_dtype] if kv_cache_dtype.startswith("fp8") else []) + [name]
    )
    for key in keys:
        if key in tols:
            return key, tols[key]
    if name in DEFAULT_TOLERANCES:
        return f"{name} (default)", DEFAULT_TOLERANCES[name]
    raise ValueError(
        f"capabilities.tolerances: got no entry for {', '.join(keys)}; supported one per declared dtype"
    )


def lse_tolerance(tol: Tolerance, dtype: torch.dtype = torch.float32) -> Tolerance:
    """The LSE of ``dtype`` queries is ``dtypes.lse_dtype(dtype)`` by contract (float32, float64 for float64):
    its tolerance is the declared one, but never tighter than that dtype's."""
    floor = DEFAULT_TOLERANCES[dtype_name(lse_dtype(dtype))]
    return Tolerance(max(tol.atol, floor.atol), max(tol.rtol, floor.rtol))


def assert_close(
    what: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    tol: Tolerance,
    tol_key: str,
    where: str,
    meta: BatchMetadata | None = None,
    hint: Callable[[torch.Tensor], str] | None = None,
) -> None:
    """``|got - ref| <= atol + rtol * |ref|`` elementwise (and finite), else an ``AssertionError`` that
    names the worst element. On failure ``hint(got as float64)`` may add a diagnosis (:mod:`.hints`);
    LSE comparisons check for a base-2 LSE by default."""
    g = got.detach().cpu().to(torch.float64)
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: got shape {list(g.shape)}; expected {list(ref.shape)} [{where}]")
    err = (g - ref).abs()
    allowed = tol.atol + tol.rtol * ref.abs()
    bad = ~(err <= allowed)  # NaN counts as bad
    if not bool(bad.any()):
        return
    score = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err - allowed)
    idx = tuple(int(i) for i in torch.unravel_index(torch.argmax(score), score.shape))
    token = idx[0]
    req = ""
    if meta is not None:
        caller_req = int(meta.order[int(meta.token_request[token])])
        req = f" (caller request {caller_req}, position {int(meta.token_positions[token])})"
    if hint is None and what.startswith("LSE"):
        hint = functools.partial(lse_base_hint, ref=ref)
    note = hint(g) if hint is not None else ""
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {bad.numel()} elements outside |x - ref| <= {tol.atol:g} + "
        f"{tol.rtol:g} * |ref| (tolerance {tol_key}); worst at index {list(idx)}, token {token}{req}: "
        f"got {g[idx].item():.6g}, expected {ref[idx].item():.6g}, "
        f"max error {float(err.nan_to_num(math.inf).max()):.3g}{note} [{where}]"
    )


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
    ref_out, ref_lse = expected(p)
    key, tol = tolerance_for(cls, case.dtype, case.kv_cache_dtype)
    assert_close("output (latent space)", out, ref_out, tol, key, where, p.meta,
                 hint=lambda got: scale_hint(p, got, tol))
    if not cls.capabilities.returns_lse:
        return
    if lse is None:
        raise AssertionError(f"LSE: got None, but capabilities.returns_lse is True [{where}]")
    if tuple(lse.shape) != (T, case.num_heads) or lse.dtype != lse_dtype(case.dtype):
        raise AssertionError(
            f"LSE: got shape {list(lse.shape)} dtype {lse.dtype}; expected "
            f"[{T}, {case.num_heads}] {lse_dtype(case.dtype)} [{where}]"
        )
    assert_close("LSE (natural log)", lse, ref_lse, lse_tolerance(tol, case.dtype), key, where, p.meta)


# ---- the checks ------------------------------------------------------------------------------------------
def check_output(cls: type[MLABackend], case: Case, device: torch.device) -> None:
    """Output and LSE match the float64 expanded reference within the declared tolerance."""
    p = prepare(case, device)
    out, lse = p.call(make_backend(cls, device))
    _check_result(cls, p, out, lse)


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
    """The same inputs twice give bitwise-equal output and LSE (within tolerance if declared
    non-deterministic)."""
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
        else:
            key, tol = tolerance_for(cls, case.dtype, case.kv_cache_dtype)
            assert_close(f"{name} (second run vs first)", b, a.cpu().to(torch.float64), tol, key, where)


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
