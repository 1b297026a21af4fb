"""Diagnoses appended to a failed comparison: what a wrong result looks like it came from.

A hint is only offered when it explains the result: the backend's output (or LSE) is recomputed by the
float64 reference under the suspected mistake, and the hint names the mistake only if that recomputation
agrees with what the backend returned within the case's tolerance. So a hint is evidence, not a guess.

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
                                       (``log2(e)`` and ``sqrt(2)`` are named when they are the factor)
=====================================  ==============================================================

The suite passes the DeepSeek-V3 scale (YaRN factor 40, so ``mscale ** 2`` is about 1.874), which is what
makes the missing-``mscale`` mistake visible at all: with ``mscale = 1`` it would be no mistake.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..backends.contract import Tolerance
from .inputs import Prepared, expected

__all__ = ["scale_hint", "lse_base_hint", "SUITE_MSCALE_SQUARED", "QK_NOPE_HEAD_DIM"]

#: the nope width the suite's scale is computed for (DeepSeek-V2/V3's 128)
QK_NOPE_HEAD_DIM = 128

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


def _best_factor(loss: Callable[[float], float], lo: float = -3.0, hi: float = 3.0, steps: int = 40) -> float:
    """Golden-section search of ``loss(log_factor)`` on ``[lo, hi]``; returns the factor ``exp(x)``."""
    g = (math.sqrt(5.0) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return math.exp((a + b) / 2)


def scale_hint(p: Prepared, out: torch.Tensor, tol: Tolerance) -> str:
    """A hint when ``out`` [T, H, kv_lora_rank] is the reference at a wrong softmax scale, else ``""``.

    ``out`` is the backend's output as float64 on the CPU; ``tol`` the case's tolerance."""

    def ref_at(scale: float) -> torch.Tensor:
        return expected(dataclasses.replace(p, scale=scale))[0]

    for text, s in _named_candidates(p):
        if _fits(out, ref_at(s), tol):
            return f" -- looks like the softmax scale is {text} (expected {p.scale:.4g})"
    factor = _best_factor(lambda x: _worst_excess(out, ref_at(p.scale * math.exp(x)), tol))
    if abs(math.log(factor)) < 1e-3 or not _fits(out, ref_at(p.scale * factor), tol):
        return ""
    named = next((f" = {name}" for f, name in _NAMED_FACTORS.items() if math.isclose(f, factor, rel_tol=2e-3)), "")
    return (f" -- looks like the softmax scale is off by a constant factor {factor:.4g}{named} "
            f"({p.scale * factor:.4g}, expected {p.scale:.4g})")


def lse_base_hint(got: torch.Tensor, ref: torch.Tensor) -> str:
    """A hint when the LSE ``got`` [T, H] (float64) is the natural-log reference ``ref`` in base 2."""
    finite = torch.isfinite(got) & torch.isfinite(ref)
    if bool(finite.any()) and torch.allclose(got[finite] * math.log(2.0), ref[finite], rtol=1e-3, atol=1e-3):
        return " -- looks like a base-2 LSE (it must be the natural log)"
    return ""
