"""How much a correct kernel rounds on one case: the reference recomputed in the case's own dtypes.

The float64 reference (:mod:`.reference`) says what the answer is; this module says how far from it an honest
kernel lands, so the suite can judge a backend by its distance from float64 *relative to that honest error*
(:mod:`.judge`). It computes the attention the way a correct absorbed-MLA kernel does in the case's
precision (:class:`Precision`):

- the operands exactly as given: the queries as the backend received them and the cached rows as stored (an
  fp8 value is exact in every 16-bit dtype; its per-tensor scale is folded into the scores and the output, as
  vLLM's, SGLang's and TRITON_MLA's kernels fold it);
- scores ``q . k`` summed in the *accumulation* dtype (float32; float64 for float64 queries), times the softmax
  scale; the softmax's maximum, exponentials and sum in the accumulation dtype;
- the probabilities rounded to the lower precision of the query dtype and the cache's storage dtype
  (:func:`~mla_backends.testing.tolerances.judged_dtype`) before the value product (what a tensor-core kernel
  feeds its second matmul), that product summed in the accumulation dtype, divided by the sum;
- the output rounded to the query dtype and the LSE to the LSE dtype (float32; float64 for float64 queries).

A backend that declares 16-bit accumulation (``Precision(accumulate=torch.float16)``, see
:class:`~mla_backends.backends.capabilities.Precision`) is emulated with that: each score product rounded to
the 16-bit dtype, the sum rounded to it, and the value product accumulated page by page (16 positions) into a
16-bit accumulator. A declared 16-bit LSE is rounded to it; a declared ``rounding="toward_zero"`` rounds the
output toward zero (:func:`round_toward_zero`) instead of to the nearest value.

Like the reference it reads only the rows each query may see, in float64 on the CPU, and shares no code with
any backend.
"""

from __future__ import annotations

import torch

from ..backends.capabilities import Precision

__all__ = ["rounded_mqa", "round_toward_zero", "ACCUMULATION_BLOCK"]

#: positions per accumulation step of the declared 16-bit accumulation (a page of 16, as kernels step)
ACCUMULATION_BLOCK = 16


def _scores(q: torch.Tensor, keys: torch.Tensor, operand: torch.dtype, acc: torch.dtype,
            sixteen: bool) -> torch.Tensor:
    """``[n, H, S]`` raw scores ``q [n, H, W] . keys [S, W]`` (exact values in float64) in ``acc``; with
    ``sixteen`` each product is rounded to ``operand`` and the sum too (16-bit accumulation)."""
    if not sixteen:
        return torch.einsum("nhw,sw->nhs", q.to(acc), keys.to(acc))
    n, H, W = q.shape
    out = torch.empty(n, H, keys.shape[0], dtype=acc)
    qa, ka = q.to(operand), keys.to(operand)
    step = max(1, (1 << 22) // max(1, H * W))  # positions per chunk of the [n, H, S, W] product
    for s0 in range(0, keys.shape[0], step):
        prod = (qa[:, :, None, :] * ka[None, None, s0: s0 + step, :]).to(acc)  # each product rounded
        out[:, :, s0: s0 + step] = prod.sum(-1).to(operand).to(acc)
    return out


def round_toward_zero(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float64) in ``dtype`` rounded toward zero (truncated), as float64: the nearest value, stepped
    one unit toward zero where it lies farther from zero than the value (floats are sign-magnitude, so one less in
    the bit pattern is one step toward zero)."""
    nearest = values.to(dtype)
    if dtype == torch.float64:
        return nearest.to(torch.float64)
    ints = {2: torch.int16, 4: torch.int32}[nearest.element_size()]
    away = (nearest.to(torch.float64).abs() > values.abs()) & (nearest != 0)
    bits = nearest.view(ints).clone()
    bits[away] -= 1
    return bits.view(dtype).to(torch.float64)


def rounded_mqa(q_latent: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
                scale: float, *, operand: torch.dtype, precision: Precision,
                fp8_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's latent output and LSE as a correct kernel of ``precision`` computes them.

    Args:
        q_latent: ``[n, H, r]`` queries exactly as the backend received them; ``q_rope``: ``[n, H, rope]``.
        rows: ``[S, r + rope]`` the request's rows by position, dequantised (``stored * fp8_scale``), float64.
        visible: ``[n, S]`` bool, the positions each token attends to.
        scale: the softmax scale.
        operand: the precision of the value product's operands (the probabilities are rounded to it).
        precision: accumulation and LSE dtypes.
        fp8_scale: an fp8 cache's per-tensor scale (1.0 otherwise), folded into the scores and the output.

    Returns:
        ``(out [n, H, r], lse [n, H])`` float64 holding the rounded values.
    """
    acc, r = precision.accumulate, q_latent.shape[-1]
    sixteen = torch.finfo(acc).bits <= 16
    work = torch.float32 if sixteen else acc  # where the 16-bit emulation keeps its (rounded) values
    q = torch.cat([q_latent, q_rope], -1).detach().cpu().to(torch.float64)  # exact: the given values
    keys = rows.detach().cpu().to(torch.float64) / fp8_scale  # [S, W] the stored values, exact
    s = _scores(q, keys, operand, work, sixteen) * (scale * fp8_scale)  # [n, H, S]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)  # [n, H, S], 0 where hidden
    values = keys[:, :r].to(work)
    p_op = p.to(operand).to(work)  # probabilities rounded for the value product
    if not sixteen:
        total = p.sum(-1, keepdim=True)
        o = torch.einsum("nhs,sr->nhr", p_op, values) / total
    else:  # page by page into 16-bit accumulators
        o_acc = torch.zeros(*p.shape[:2], r, dtype=work)
        total = torch.zeros(*p.shape[:2], 1, dtype=work)
        for s0 in range(0, p.shape[-1], ACCUMULATION_BLOCK):
            blk = slice(s0, s0 + ACCUMULATION_BLOCK)
            o_acc = (o_acc + torch.einsum("nhs,sr->nhr", p_op[..., blk], values[blk])).to(acc).to(work)
            total = (total + p[..., blk].sum(-1, keepdim=True)).to(acc).to(work)
        o = o_acc / total
    lse = (m + torch.log(total)).squeeze(-1)
    o = (o * fp8_scale).to(torch.float64)
    if precision.rounding == "toward_zero":
        return round_toward_zero(o, q_latent.dtype), lse.to(precision.lse).to(torch.float64)
    return o.to(q_latent.dtype).to(torch.float64), lse.to(precision.lse).to(torch.float64)
