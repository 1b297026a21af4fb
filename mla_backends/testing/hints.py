"""Diagnoses appended to a failed comparison: what a wrong result looks like it came from.

A hint is only offered when it explains the result far better than rounding does. One policy, for every hint
(:func:`explains`): the backend's output (or LSE) is recomputed by the float64 reference under the suspected
mistake, and the hint names the mistake only if

1. the mistake is beyond rounding: it changes the softmax scale by a factor that differs from 1 by more than
   :data:`MIN_FACTOR_EPS` epsilons of the case's judged dtype (:func:`.tolerances.rounding_eps`; a base-2 LSE
   is a factor ``ln 2`` on the LSE);
2. the recomputation agrees with what the backend returned within the case's tolerance (the residual after
   the correction is at rounding level), and
3. it leaves at most :data:`MAX_RESIDUAL_RATIO` of the error the failure itself showed.

So a hint is evidence, not a guess, and a kernel that only rounds (say a correct float16 kernel that fails a
tolerance) gets none. A constant factor is *named* (``= sqrt(2)``) only when the reference recomputed at
exactly that named factor fits within the tolerance too; otherwise the hint gives the measured factor alone.
The factor search refines to float64 resolution, so a float64 case is diagnosed as a float32 one is.

Softmax-scale mistakes are the usual ones in MLA kernels, because the absorbed path attends over a
``kv_lora_rank + qk_rope_head_dim`` (576) wide row while the scale belongs to the unabsorbed
``qk_nope_head_dim + qk_rope_head_dim`` (192) wide head, times DeepSeek-YaRN's ``mscale ** 2``:

=====================================  ==============================================================
mistake                                recognised by
=====================================  ==============================================================
absorbed width                         the output equals the reference at ``(kv_lora_rank + rope) ** -0.5``
                                       (with or without ``mscale ** 2``)
latent width                           ... at ``kv_lora_rank ** -0.5`` (with or without ``mscale ** 2``)
``mscale ** 2`` missing                ... at the given scale divided by ``mscale ** 2``
a constant factor                      ... at the given scale times one factor, found by a 1-D search
                                       (``log2(e)``, ``sqrt(2)`` and their inverses are named when the
                                       reference at exactly that factor fits)
=====================================  ==============================================================

The suite passes the DeepSeek-V3 scale (YaRN factor 40, so ``mscale ** 2`` is about 1.874), which is what
makes the missing-``mscale`` mistake visible at all: with ``mscale = 1`` it would be no mistake.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..backends.contract import Tolerance
from .inputs import Prepared, expected_at
from .tolerances import rounding_eps

__all__ = ["scale_hint", "lse_base_hint", "explains", "beyond_rounding", "SUITE_MSCALE_SQUARED",
           "QK_NOPE_HEAD_DIM", "MIN_FACTOR_EPS", "MAX_RESIDUAL_RATIO"]

#: the nope width the suite's scale is computed for (DeepSeek-V2/V3's 128)
QK_NOPE_HEAD_DIM = 128
#: a suspected factor must differ from 1 by more than this many epsilons of the judged dtype
MIN_FACTOR_EPS = 16
#: the residual under a suspected mistake must be at most this fraction of the failure's own error
MAX_RESIDUAL_RATIO = 0.25

_NAMED_FACTORS = {math.log2(math.e): "log2(e)", 1 / math.log2(math.e): "ln(2)",
                  math.sqrt(2.0): "sqrt(2)", 1 / math.sqrt(2.0): "1/sqrt(2)"}


def _suite_mscale_squared() -> float:
    from ..core.dims import MLADims

    return MLADims.deepseek_v3().mscale ** 2


#: ``mscale ** 2`` of the scale the suite passes (DeepSeek-V3's YaRN settings)
SUITE_MSCALE_SQUARED = _suite_mscale_squared()


def _fits(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> bool:
    err = (got - ref).abs()
    return bool((err <= tol.atol + tol.rtol * ref.abs()).all())


def _worst_excess(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> float:
    excess = (got - ref).abs() - (tol.atol + tol.rtol * ref.abs())
    return float(excess.nan_to_num(math.inf).max())


def _max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().nan_to_num(math.inf).max())


def beyond_rounding(factor: float, eps: float) -> bool:
    """True when a multiplicative ``factor`` differs from 1 by more than :data:`MIN_FACTOR_EPS` epsilons."""
    return math.isfinite(factor) and factor > 0 and abs(math.log(factor)) > MIN_FACTOR_EPS * eps


def explains(got: torch.Tensor, under_cause: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> bool:
    """True when ``under_cause`` (the reference recomputed under a suspected mistake) explains ``got`` far
    better than ``ref`` (the correct reference) does: within ``tol`` of it, with at most
    :data:`MAX_RESIDUAL_RATIO` of the error ``got`` has against ``ref``. (Whether the mistake is beyond
    rounding at all is :func:`beyond_rounding`.)"""
    if not _fits(got, under_cause, tol):
        return False
    return _max_error(got, under_cause) <= MAX_RESIDUAL_RATIO * _max_error(got, ref)


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
#: as its tolerance needs, and a failure no factor explains costs only the coarse steps)
_COARSE_WIDTH = 1e-3
_FINE_WIDTH = 1e-13


#: ... but stops at this width once its best point fits the tolerance (enough to tell named factors apart)
_FIT_WIDTH = 1e-5


def _best_factor(loss: Callable[[float], float], lo: float = -3.0, hi: float = 3.0,
                 width: float = _FINE_WIDTH) -> float:
    """Golden-section search of ``loss(log_factor)`` on ``[lo, hi]`` down to ``width`` (or to
    :data:`_FIT_WIDTH` once its best point has ``loss <= 0``: the worst excess over the tolerance, a factor that
    fits); returns ``exp(x)``."""
    g = (math.sqrt(5.0) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > width:
        if b - a < _FIT_WIDTH and min(fc, fd) <= 0:
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


def scale_hint(p: Prepared, out: torch.Tensor, tol: Tolerance, *, ref: torch.Tensor | None = None) -> str:
    """A hint when ``out`` [T, H, kv_lora_rank] is the reference at a wrong softmax scale, else ``""``.

    ``out`` is the backend's output as float64 on the CPU; ``tol`` the case's tolerance; ``ref`` the correct
    reference output (recomputed when not given)."""

    reference = expected_at(p)

    def ref_at(scale: float) -> torch.Tensor:
        return reference(scale)[0]

    eps = rounding_eps(p.case.dtype, p.case.kv_cache_dtype)
    right = ref if ref is not None else ref_at(p.scale)
    fitting = []  # every named mistake that explains the output, the closest first
    for text, s in _named_candidates(p):
        under = ref_at(s)
        if beyond_rounding(s / p.scale, eps) and explains(out, under, right, tol):
            fitting.append((_max_error(out, under), text))
    if fitting:
        return f" -- looks like the softmax scale is {min(fitting)[1]} (expected {p.scale:.4g})"
    def loss(x: float) -> float:
        return _worst_excess(out, ref_at(p.scale * math.exp(x)), tol)

    coarse = _best_factor(loss, width=_COARSE_WIDTH)
    if not beyond_rounding(coarse, eps) or (
            _max_error(out, ref_at(p.scale * coarse)) > MAX_RESIDUAL_RATIO * _max_error(out, right)):
        return ""  # no factor comes near explaining it
    x = math.log(coarse)
    factor = _best_factor(loss, x - 2 * _COARSE_WIDTH, x + 2 * _COARSE_WIDTH)
    if not beyond_rounding(factor, eps) or not explains(out, ref_at(p.scale * factor), right, tol):
        return ""
    # named only when that exact factor reproduces the output too; the nearest such factor to the measured one
    exact = sorted((abs(math.log(f / factor)), f, name) for f, name in _NAMED_FACTORS.items()
                   if math.isclose(f, factor, rel_tol=0.05))
    for _, f, name in exact:
        if _fits(out, ref_at(p.scale * f), tol):
            measured = f", measured {factor:.4g}" if f"{factor:.4g}" != f"{f:.4g}" else ""
            return (f" -- looks like the softmax scale is off by a constant factor {f:.4g} = {name} "
                    f"({p.scale * f:.4g}{measured}, expected {p.scale:.4g})")
    return (f" -- looks like the softmax scale is off by a constant factor {factor:.4g} "
            f"({p.scale * factor:.4g}, expected {p.scale:.4g})")


def lse_base_hint(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None = None) -> str:
    """A hint when the LSE ``got`` [T, H] (float64) is the natural-log reference ``ref`` in base 2: ``got *
    ln 2`` explains it (:func:`explains`, within ``tol``; float32's default when not given)."""
    if tol is None:
        from ..backends.contract import DEFAULT_TOLERANCES

        tol = DEFAULT_TOLERANCES["float32"]
    finite = torch.isfinite(got) & torch.isfinite(ref)
    if not bool(finite.any()):
        return ""
    g, r = got[finite], ref[finite]
    if explains(g, r / math.log(2.0), r, tol):  # the reference's LSE in base 2 reproduces the backend's
        return " -- looks like a base-2 LSE (it must be the natural log)"
    return ""
