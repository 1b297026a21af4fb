"""Diagnoses appended to a failed comparison: what a wrong result looks like it came from.

A hint is only offered when it explains the result far better than rounding does. One policy, for every hint
(:func:`explains`): the reference is recomputed under the suspected mistake, and the hint names the mistake only if

1. the mistake is detectable: the reference under it, taken as a backend's result, fails the case's criteria
   itself (:func:`detectable`; :mod:`.judge`), so a mistake within the case's honest rounding is never named;
2. the backend's result passes the case's criteria against the recomputed reference (the residual after the
   correction is at rounding level), and
3. the correction leaves at most :data:`MAX_RESIDUAL_RATIO` of the error the failure itself showed (RMS over
   the case).

So a hint is evidence, not a guess, and a kernel that only rounds gets none. A constant factor is *named*
(``= sqrt(2)``) only when the reference recomputed at exactly that named factor passes too; otherwise the hint
gives the measured factor alone. The factor search refines to float64 resolution, so a float64 case is diagnosed
as a float32 one is.

The mistakes recognised:

=====================================  ==============================================================
mistake                                recognised by
=====================================  ==============================================================
absorbed width                         the output equals the reference at ``(kv_lora_rank + rope) ** -0.5``
                                       (with or without ``mscale ** 2``)
latent width                           ... at ``kv_lora_rank ** -0.5`` (with or without ``mscale ** 2``)
``mscale ** 2`` missing                ... at the given scale divided by ``mscale ** 2``
a constant softmax-scale factor        ... at the given scale times one factor, found by a 1-D search
                                       (``log2(e)``, ``sqrt(2)`` and their inverses are named when the
                                       reference at exactly that factor fits)
an output scaled by a constant         ... the reference times the case's slope ``<x, ref> / <ref, ref>``
an fp8 cache read without its scale    ... the reference over the stored values, not times the scale
a base-2 LSE                           the LSE equals the reference's divided by ``ln 2``
an LSE shifted by a constant           ... the reference's plus the mean offset
reading slots no request owns          the same call with every unowned slot zeroed instead of poisoned gives
                                       another result (:func:`unowned_hint`, in :mod:`.checks`)
=====================================  ==============================================================

The suite passes the DeepSeek-V3 scale (YaRN factor 40, so ``mscale ** 2`` is about 1.874), which is what
makes the missing-``mscale`` mistake visible at all: with ``mscale = 1`` it would be no mistake.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from .inputs import Prepared, expected_at
from .judge import Standard

__all__ = ["scale_hint", "output_scale_hint", "fp8_scale_hint", "lse_hints", "lse_base_hint", "explains", "detectable",
           "SUITE_MSCALE_SQUARED", "QK_NOPE_HEAD_DIM", "MAX_RESIDUAL_RATIO", "OUT_OF_BOUNDS_HINT"]

#: the nope width the suite's scale is computed for (DeepSeek-V2/V3's 128)
QK_NOPE_HEAD_DIM = 128
#: the residual under a suspected mistake must be at most this fraction of the failure's own error
MAX_RESIDUAL_RATIO = 0.25
#: the out-of-bounds diagnosis (:func:`mla_backends.testing.checks.unowned_hint`)
OUT_OF_BOUNDS_HINT = ("looks like out-of-bounds reads: the result changes when only the slots no request owns "
                      "change (positions past a request's length, pages outside its block table, which the suite "
                      "fills with NaN, infinities and junk); mask the loads, not only the weights (0 x NaN = NaN)")

_NAMED_FACTORS = {math.log2(math.e): "log2(e)", 1 / math.log2(math.e): "ln(2)",
                  math.sqrt(2.0): "sqrt(2)", 1 / math.sqrt(2.0): "1/sqrt(2)"}


def _suite_mscale_squared() -> float:
    from ..core.dims import MLADims

    return MLADims.deepseek_v3().mscale ** 2


#: ``mscale ** 2`` of the scale the suite passes (DeepSeek-V3's YaRN settings)
SUITE_MSCALE_SQUARED = _suite_mscale_squared()


def _rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of ``got - ref`` over the finite entries of ``ref`` (infinite when ``got`` is not finite there)."""
    keep = torch.isfinite(ref)
    diff = (got - ref)[keep]
    return float(diff.pow(2).mean().sqrt().nan_to_num(math.inf)) if diff.numel() else 0.0


def _judge(standard: Standard, lse: bool) -> Callable[..., object]:
    return standard.judge_lse if lse else standard.judge


def detectable(under_cause: torch.Tensor, standard: Standard, *, lse: bool = False) -> bool:
    """True when the reference recomputed under a mistake, taken as a result, fails the case's criteria: the
    mistake is beyond the case's honest rounding."""
    return not _judge(standard, lse)(under_cause).ok  # type: ignore[attr-defined]


def explains(got: torch.Tensor, under_cause: torch.Tensor, standard: Standard, *, lse: bool = False) -> bool:
    """True when ``under_cause`` (the reference recomputed under a suspected mistake) explains ``got`` far better
    than the reference does: ``got`` passes the case's criteria against it (an output cause rounded as the
    backend stores it, :meth:`Standard.stored`), with at most :data:`MAX_RESIDUAL_RATIO` of the (RMS) error
    ``got`` has against the reference."""
    if not lse:
        under_cause = standard.stored(under_cause)
    if not _judge(standard, lse)(got, under_cause).ok:  # type: ignore[attr-defined]
        return False
    ref = standard.ref_lse if lse else standard.ref_out
    return _rms_error(got, under_cause) <= MAX_RESIDUAL_RATIO * _rms_error(got, ref)


def _named_candidates(p: Prepared) -> list[tuple[str, float]]:
    r, rope = p.case.kv_lora_rank, p.case.qk_rope_head_dim
    m2 = SUITE_MSCALE_SQUARED
    out: list[tuple[str, float]] = [
        (f"(kv_lora_rank + qk_rope_head_dim) ** -0.5 * mscale ** 2 = {(r + rope) ** -0.5 * m2:.4g}: the absorbed "
         f"row's width ({r + rope}), not the unabsorbed head's ({QK_NOPE_HEAD_DIM} + {rope})", (r + rope) ** -0.5 * m2),
        (f"(kv_lora_rank + qk_rope_head_dim) ** -0.5 = {(r + rope) ** -0.5:.4g}: the absorbed row's width "
         f"({r + rope}), not the unabsorbed head's ({QK_NOPE_HEAD_DIM} + {rope}), and no mscale ** 2",
         (r + rope) ** -0.5),
        (f"kv_lora_rank ** -0.5 * mscale ** 2 = {r ** -0.5 * m2:.4g}: the latent width ({r}), not the "
         f"unabsorbed head's", r ** -0.5 * m2),
        (f"kv_lora_rank ** -0.5 = {r ** -0.5:.4g}: the latent width ({r}), not the unabsorbed head's, and no "
         f"mscale ** 2", r ** -0.5),
        (f"(qk_nope + qk_rope) ** -0.5 = {p.scale / m2:.4g}, missing DeepSeek-YaRN's mscale ** 2 ({m2:.4g})",
         p.scale / m2),
    ]
    return [(text, s) for text, s in out if not math.isclose(s, p.scale, rel_tol=1e-6)]


#: the golden-section search runs coarse first (log factor to this width), and refines only a factor that
#: already explains most of the error, to float64 resolution (so a float64 case's factor is found as precisely
#: as its criteria need, and a failure no factor explains costs only the coarse steps)
_COARSE_WIDTH = 1e-3
_FINE_WIDTH = 1e-15
#: ... but stops at this width once its best point passes (enough to tell named factors apart)
_FIT_WIDTH = 1e-5


def _factor_text(factor: float) -> str:
    """``factor`` with enough digits to tell it from 1 (``1.005``, ``1.0005``, ``0.98``)."""
    off = abs(factor - 1.0)
    digits = 4 if off == 0 or off >= 1e-3 else 2 - math.floor(math.log10(off))
    return f"{factor:.{digits}g}"


def _best_factor(loss: Callable[[float], float], lo: float = -3.0, hi: float = 3.0,
                 width: float = _FINE_WIDTH) -> float:
    """Golden-section search of ``loss(log_factor)`` on ``[lo, hi]`` down to ``width`` (or to :data:`_FIT_WIDTH`
    once its best point has ``loss <= 1``: a factor under which the result passes); returns ``exp(x)``."""
    g = (math.sqrt(5.0) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > width:
        if b - a < _FIT_WIDTH and min(fc, fd) <= 1.0:
            return math.exp(c if fc <= fd else d)
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return math.exp((a + b) / 2)


def scale_hint(p: Prepared, out: torch.Tensor, standard: Standard, lse: torch.Tensor | None = None) -> str:
    """A hint when ``out`` [T, H, kv_lora_rank] (float64, CPU), and ``lse`` [T, H] when the backend returns one,
    are the reference at a wrong softmax scale, else ``""``. With the LSE, a mistake must explain both and may
    show its residual in either (a scale 0.5 % off moves a bf16 output by little more than rounding, but its
    LSE by thousands of float32 epsilons)."""
    reference = expected_at(p)

    def fits(scale: float) -> bool:
        under_out, under_lse = reference(scale)
        under_out = standard.stored(under_out)
        if not (detectable(under_out, standard) or (lse is not None and detectable(under_lse, standard, lse=True))):
            return False
        if lse is None:
            return explains(out, under_out, standard)
        if not (standard.judge(out, under_out).ok and standard.judge_lse(lse, under_lse).ok):
            return False
        return (_rms_error(out, under_out) <= MAX_RESIDUAL_RATIO * _rms_error(out, standard.ref_out)
                or _rms_error(lse, under_lse) <= MAX_RESIDUAL_RATIO * _rms_error(lse, standard.ref_lse))

    fitting = []  # every named mistake that explains the result, the closest first
    for text, s in _named_candidates(p):
        if fits(s):
            fitting.append((_rms_error(out, reference(s)[0]), text))
    if fitting:
        return f" -- looks like the softmax scale is {min(fitting)[1]} (expected {p.scale:.4g})"

    def loss(x: float) -> float:
        under_out, under_lse = reference(p.scale * math.exp(x))
        bad = standard.badness(out, standard.stored(under_out))
        return bad if lse is None else max(bad, standard.judge_lse(lse, under_lse).badness)

    coarse = _best_factor(loss, width=_COARSE_WIDTH)
    under_out, under_lse = reference(p.scale * coarse)
    near = _rms_error(out, under_out) <= MAX_RESIDUAL_RATIO * _rms_error(out, standard.ref_out) or (
        lse is not None and _rms_error(lse, under_lse) <= MAX_RESIDUAL_RATIO * _rms_error(lse, standard.ref_lse))
    if not near:
        return ""  # no factor comes near explaining it
    x = math.log(coarse)
    factor = _best_factor(loss, x - 2 * _COARSE_WIDTH, x + 2 * _COARSE_WIDTH)
    if not fits(p.scale * factor):
        return ""
    # named only when that exact factor reproduces the result too; the nearest such factor to the measured one
    exact = sorted((abs(math.log(f / factor)), f, name) for f, name in _NAMED_FACTORS.items()
                   if math.isclose(f, factor, rel_tol=0.05))
    for _, f, name in exact:
        if loss(math.log(f)) <= 1.0:
            measured = f", measured {factor:.4g}" if f"{factor:.4g}" != f"{f:.4g}" else ""
            return (f" -- looks like the softmax scale is off by a constant factor {f:.4g} = {name} "
                    f"({p.scale * f:.4g}{measured}, expected {p.scale:.4g})")
    return (f" -- looks like the softmax scale is off by a constant factor {_factor_text(factor)} "
            f"({p.scale * factor:.6g}, expected {p.scale:.6g})")


def output_scale_hint(out: torch.Tensor, standard: Standard) -> str:
    """A hint when ``out`` is the reference output times a constant (a wrong normalisation), else ``""``."""
    ref = standard.ref_out
    c = float((out * ref).sum()) / max(float(ref.pow(2).sum()), 1e-300)
    if not math.isfinite(c) or c <= 0:
        return ""
    under = ref * c
    if detectable(under, standard) and explains(out, under, standard):
        return f" -- looks like the output is scaled by a constant factor {_factor_text(c)} (a wrong normalisation)"
    return ""


def fp8_scale_hint(p: Prepared, out: torch.Tensor, standard: Standard) -> str:
    """A hint when ``out`` is the reference over an fp8 cache's stored values without its scale, else ``""``."""
    if not p.cache.is_fp8:
        return ""
    scale = float(p.cache.scale.item())
    unscaled = dataclasses.replace(p, rows=[r / scale for r in p.rows])
    under = expected_at(unscaled)(p.scale)[0]
    if detectable(under, standard) and explains(out, under, standard):
        return f" -- looks like the fp8 cache read without its scale ({scale:.4g})"
    return ""


def lse_base_hint(got: torch.Tensor, standard: Standard) -> str:
    """A hint when the LSE ``got`` [T, H] (float64) is the natural-log reference in base 2, else ``""``."""
    under = standard.ref_lse / math.log(2.0)
    if detectable(under, standard, lse=True) and explains(got, under, standard, lse=True):
        return " -- looks like a base-2 LSE (it must be the natural log)"
    return ""


def lse_hints(got: torch.Tensor, standard: Standard) -> str:
    """The LSE's diagnosis: a base-2 LSE, or one shifted by a constant; ``""`` when neither explains it."""
    base2 = lse_base_hint(got, standard)
    if base2:
        return base2
    ref = standard.ref_lse
    finite = torch.isfinite(ref) & torch.isfinite(got)
    if not bool(finite.any()):
        return ""
    shift = float((got - ref)[finite].mean())
    under = ref + shift
    if detectable(under, standard, lse=True) and explains(got, under, standard, lse=True):
        return f" -- looks like the LSE is shifted by a constant {shift:.4g}"
    return ""
