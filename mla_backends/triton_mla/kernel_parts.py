"""``@triton.jit`` helpers shared by the ``TRITON_MLA`` kernels (:mod:`.kernels` and :mod:`.kernels_rows`).

Imported only with those kernels (``import mla_backends`` never imports triton). Each helper is inlined into
the kernel that calls it, so the compiled code is the same as if it were written out in place.

* :func:`load_2d` / :func:`store_2d`: a ``[M, N]`` tile at ``rows[:, None] + cols[None, :]`` (element
  pointers ``rows [M]``, column offsets ``cols [N]``), masked by ``mask_rows [M]`` and ``mask_cols [N]``.
* :func:`kv_dequant_scale`: an fp8 cache's per-tensor scale (stored = value / scale), folded into the scores
  and the output instead of each element; 1.0 for other caches.
* :func:`softmax_step` / :func:`softmax_finish`: the online softmax in base 2 over score tiles ``[M, N]``.
* :func:`merge_splits`: the merge of the split-KV partial outputs of ``BLOCK_H`` heads of one token by their
  base-2 LSE, written as the output (its dtype) and the natural-log LSE (float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["kv_dequant_scale", "load_2d", "merge_splits", "softmax_finish", "softmax_step", "store_2d"]


@triton.jit
def load_2d(rows, cols, mask_rows, mask_cols):
    """The ``[M, N]`` tile ``rows[:, None] + cols[None, :]``; masked-out elements read 0."""
    return tl.load(rows[:, None] + cols[None, :], mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)


@triton.jit
def store_2d(rows, cols, value, mask_rows, mask_cols):
    """Store the ``[M, N]`` tile ``value`` at ``rows[:, None] + cols[None, :]``, converted to the pointee dtype."""
    mask = mask_rows[:, None] & mask_cols[None, :]
    tl.store(rows[:, None] + cols[None, :], value.to(rows.dtype.element_ty), mask=mask)


@triton.jit
def kv_dequant_scale(KV_SCALE, IS_FP8: tl.constexpr):
    """An fp8 cache's float32 scale (``value = stored * scale``) read from ``KV_SCALE [1]``; 1.0 otherwise."""
    scale = 1.0
    if IS_FP8:
        scale = tl.load(KV_SCALE)
    return scale


@triton.jit
def softmax_step(m_i, l_i, qk):
    """One tile of the online softmax in base 2.

    ``m_i`` / ``l_i [M]``: running maximum and sum; ``qk [M, N]``: scaled base-2 scores (``-inf`` masked).
    Returns ``(m_new, l_new, alpha, p)``: the new maximum and sum, the factor ``alpha [M]`` the accumulator
    is rescaled by, and the probabilities ``p [M, N]`` (unnormalised, fp32).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row must not give NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def softmax_finish(m_i, l_i):
    """``(l_safe, lse2)`` of a finished online softmax: the sum to divide by (1 for an empty row) and the
    base-2 LSE (``-inf`` for an empty row), both ``[M]`` float32."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return l_safe, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))


@triton.jit
def merge_splits(
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    t,
    offs_h,
    mask_h,
    n_loop,
    s_po_t,
    s_po_h,
    s_po_s,
    s_pl_t,
    s_pl_h,
    s_o_t,
    s_o_h,
    s_lse_t,
    s_lse_h,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Merge splits ``0 .. n_loop - 1`` of token ``t`` (int64) for heads ``offs_h [BLOCK_H]`` (``mask_h``).

    Reads ``PART_O [T, H, S, RANK]`` (any float dtype) and ``PART_LSE [T, H, S]`` (base 2, ``-inf``: an empty
    split); writes ``OUT [T, H, RANK]`` in its dtype and ``LSE [T, H]`` (natural log, float32).
    """
    h64 = offs_h.to(tl.int64)  # (H - 1) * head stride can pass 2**31
    offs_d = tl.arange(0, RANK_PAD)
    mask_d = offs_d < RANK
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for s in range(0, n_loop):
        lse_s = tl.load(PART_LSE + t * s_pl_t + h64 * s_pl_h + s, mask=mask_h, other=float("-inf"))
        o_s = load_2d(PART_O + t * s_po_t + h64 * s_po_h + s * s_po_s, offs_d, mask_h, mask_d).to(tl.float32)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_s - m_safe)  # 0 for an empty split
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l_sum = l_sum * alpha + w
        m = m_new
    l_safe, lse2 = softmax_finish(m, l_sum)
    store_2d(OUT + t * s_o_t + h64 * s_o_h, offs_d, acc / l_safe[:, None], mask_h, mask_d)
    tl.store(LSE + t * s_lse_t + h64 * s_lse_h, lse2 * 0.6931471805599453, mask=mask_h)  # ln 2: natural log
