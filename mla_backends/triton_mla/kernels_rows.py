"""The ``rows`` kernels of ``TRITON_MLA`` (the Hopper configuration; ``docs/triton.md``, "The rows kernel").

Imported only on the first ``forward_mqa`` call that chooses them (``import mla_backends`` never imports
triton).

:func:`mla_decode_rows`, grid ``(tokens * head_blocks, max_splits)``: one program holds 64 *rows*, the
``HEADS_PB`` heads of head block ``hb`` for ``TOKS_PB`` consecutive query tokens of one request
(``HEADS_PB * TOKS_PB = 64``; :func:`~mla_backends.triton_mla.configs.rows_layout`). Only the program whose
axis-0 token is the first of its group in its request works; the others find nothing to do (a fixed grid,
so a captured CUDA graph replays over new lengths). Every cache tile ``[BLOCK_N, 576]`` is loaded once for
all 64 rows: the score ``q . row`` over 576 columns (the 512-wide latent in two 256-wide halves, each with
its own ``[64, 256]`` fp32 accumulator, plus the 64-wide rope part), then the output ``p . latent``.
Each row has its own causal limit (its token's position), so a request's query tokens share one pass over
the cache.

Splits follow the work: a request of ``S`` positions gets ``clamp(ceil(S / min_split_len), 1,
max_splits)`` splits (from the device-side ``seq_lens``), each a whole number of tiles, and tiles start at
multiples of ``BLOCK_N`` (one block-table lookup per tile when the page size is a multiple of it). A request
with one split writes its output and LSE directly; the merge (:func:`mla_decode_merge`) then skips its
tokens. Partials are stored in the output's dtype (bf16/fp16; the LSE in float32).

``QK_FP8``: queries arrive quantised to fp8 e4m3 per (token, head) with a float32 scale (done in torch
before the launch) and the score product runs fp8 x fp8 on the raw fp8 cache tile; the output product
stays 16-bit (the probabilities in the query dtype times the tile converted exactly from fp8).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mla_decode_rows", "mla_decode_merge"]


@triton.jit
def _split_count(seq_len, min_split_len, max_splits):
    """Splits of a request of ``seq_len`` positions: ``clamp(ceil(seq_len / min_split_len), 1, max)``."""
    n = tl.cdiv(seq_len, min_split_len)
    return tl.maximum(tl.minimum(n, max_splits), 1)


@triton.jit
def mla_decode_rows(
    QL,
    QR,
    QSCALE,
    KV,
    KV_SCALE,
    BT,
    TOK_REQ,
    TOK_POS,
    QSTART,
    SEQ_LENS,
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    sm_scale_log2,  # softmax scale * log2(e)
    num_heads,
    head_blocks,
    max_splits,
    min_split_len,
    s_ql_t,
    s_ql_h,
    s_qr_t,
    s_qr_h,
    s_kv_b,
    s_kv_p,
    s_bt_b,
    s_po_t,
    s_po_h,
    s_po_s,
    s_pl_t,
    s_pl_h,
    s_o_t,
    s_o_h,
    s_lse_t,
    s_lse_h,
    PAGE_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEADS_PB: tl.constexpr,
    TOKS_PB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    QK_FP8: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = HEADS_PB * TOKS_PB
    HALF: tl.constexpr = RANK_PAD // 2
    pid = tl.program_id(0)
    hb = pid % head_blocks
    t0 = pid // head_blocks
    split = tl.program_id(1)
    req = tl.load(TOK_REQ + t0).to(tl.int64)
    q_start = tl.load(QSTART + req)
    q_end = tl.load(QSTART + req + 1)
    leader = ((t0 - q_start) % TOKS_PB) == 0  # the first token of its group works, the others skip
    last_tok = tl.minimum(t0 + TOKS_PB, q_end) - 1
    seq_len = tl.load(SEQ_LENS + req)
    n_split = _split_count(seq_len, min_split_len, max_splits)
    length = tl.load(TOK_POS + last_tok) + 1  # positions the group's last token sees (the widest row)
    length = tl.where(leader & (split < n_split), length, 0)
    chunk = tl.cdiv(tl.cdiv(length, n_split), BLOCK_N) * BLOCK_N  # whole tiles: tiles start at k * BLOCK_N
    start = tl.minimum(split * chunk, length)
    end = tl.minimum(start + chunk, length)

    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // HEADS_PB
    head = hb * HEADS_PB + offs_m % HEADS_PB
    toks_here = tl.where(leader, q_end - t0, 0)  # tokens of this group left in the request (0: not a leader)
    mask_m = ((offs_m // HEADS_PB) < toks_here) & (head < num_heads)
    tok = tl.where(mask_m, tok, t0)
    tok64 = tok.to(tl.int64)
    h64 = tl.where(mask_m, head, 0).to(tl.int64)  # (H - 1) * head stride can pass 2**31
    row_pos = tl.load(TOK_POS + tok, mask=mask_m, other=-1)  # each row's causal limit
    offs_d = tl.arange(0, HALF)
    mask_d0 = offs_d < RANK
    mask_d1 = (offs_d + HALF) < RANK
    q_row = QL + tok64 * s_ql_t + h64 * s_ql_h
    q0 = tl.load(q_row[:, None] + offs_d[None, :], mask=mask_m[:, None] & mask_d0[None, :], other=0.0)
    q1 = tl.load(q_row[:, None] + HALF + offs_d[None, :], mask=mask_m[:, None] & mask_d1[None, :], other=0.0)
    q0 = q0.to(QK_DTYPE)
    q1 = q1.to(QK_DTYPE)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_PAD)
        mask_r = offs_r < ROPE
        qr = tl.load(
            QR + (tok64 * s_qr_t + h64 * s_qr_h)[:, None] + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        ).to(QK_DTYPE)

    qk_scale = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_log2
    if QK_FP8:
        qk_scale = qk_scale * tl.load(QSCALE + tok64 * num_heads + h64, mask=mask_m, other=1.0)
    if IS_FP8:
        # stored = value / scale: fold the scale into the scores and the output instead of each element
        kv_scale = tl.load(KV_SCALE)
        qk_scale = qk_scale * kv_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, HALF], tl.float32)  # output columns 0 .. HALF - 1
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)  # output columns HALF .. RANK_PAD - 1
    bt_row = BT + req * s_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        offs_c = tl.minimum(offs_n, end - 1)  # clamped: every row address is a visible cache row
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)  # the tile lies in one page: one lookup
        else:
            page = tl.load(bt_row + offs_c // PAGE_SIZE).to(tl.int64)
        row = page * s_kv_b + (offs_c % PAGE_SIZE) * s_kv_p
        if RANK == RANK_PAD:
            # unmasked loads (fewer registers): rows past the end read a valid row of the same tile's page
            # walk (clamped below), and their scores are masked
            kv0 = tl.load(KV + row[:, None] + offs_d[None, :])
            kv1 = tl.load(KV + row[:, None] + HALF + offs_d[None, :])
        else:
            kv0 = tl.load(KV + row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d0[None, :], other=0.0)
            kv1 = tl.load(
                KV + row[:, None] + HALF + offs_d[None, :], mask=mask_n[:, None] & mask_d1[None, :], other=0.0
            )
        qk = tl.dot(q0, tl.trans(kv0.to(QK_DTYPE)), input_precision=DOT_PRECISION)
        qk = tl.dot(q1, tl.trans(kv1.to(QK_DTYPE)), qk, input_precision=DOT_PRECISION)
        if ROPE > 0:
            if ROPE == ROPE_PAD:
                kr = tl.load(KV + row[:, None] + RANK + offs_r[None, :])
            else:
                kr = tl.load(
                    KV + row[:, None] + RANK + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0
                )
            qk = tl.dot(qr, tl.trans(kr.to(QK_DTYPE)), qk, input_precision=DOT_PRECISION)
        visible = mask_n[None, :] & (offs_n[None, :] <= row_pos[:, None])
        qk = tl.where(visible, qk * qk_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row must not give NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(DOT_DTYPE)
        acc0 = tl.dot(p16, kv0.to(DOT_DTYPE), acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        acc1 = tl.dot(p16, kv1.to(DOT_DTYPE), acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv = 1.0 / l_safe
    if IS_FP8:
        inv = inv * kv_scale
    o0 = acc0 * inv[:, None]
    o1 = acc1 * inv[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    keep = mask_m & ((offs_m * 0 + split) < n_split)  # vector compare: the interpreter's scalar bools are int
    if n_split == 1:
        o_row = OUT + tok64 * s_o_t + h64 * s_o_h
        o_ty = OUT.dtype.element_ty
        tl.store(o_row[:, None] + offs_d[None, :], o0.to(o_ty), mask=keep[:, None] & mask_d0[None, :])
        tl.store(o_row[:, None] + HALF + offs_d[None, :], o1.to(o_ty), mask=keep[:, None] & mask_d1[None, :])
        tl.store(LSE + tok64 * s_lse_t + h64 * s_lse_h, lse2 * 0.6931471805599453, mask=keep)
    else:
        p_row = PART_O + tok64 * s_po_t + h64 * s_po_h + split * s_po_s
        p_ty = PART_O.dtype.element_ty
        tl.store(p_row[:, None] + offs_d[None, :], o0.to(p_ty), mask=keep[:, None] & mask_d0[None, :])
        tl.store(p_row[:, None] + HALF + offs_d[None, :], o1.to(p_ty), mask=keep[:, None] & mask_d1[None, :])
        tl.store(PART_LSE + tok64 * s_pl_t + h64 * s_pl_h + split, lse2, mask=keep)


@triton.jit
def mla_decode_merge(
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    TOK_REQ,
    SEQ_LENS,
    num_heads,
    head_blocks,
    max_splits,
    min_split_len,
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
    """Merge of :func:`mla_decode_rows`'s splits, grid ``(tokens * head_blocks,)``: a token's split count
    comes from its request's length, as in stage 1; tokens with one split were written by stage 1 and are
    skipped (no loads, no stores)."""
    pid = tl.program_id(0)
    hb = pid % head_blocks
    t = (pid // head_blocks).to(tl.int64)
    req = tl.load(TOK_REQ + t).to(tl.int64)
    n_split = _split_count(tl.load(SEQ_LENS + req), min_split_len, max_splits)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < num_heads) & ((offs_h * 0 + n_split) > 1)
    h64 = offs_h.to(tl.int64)
    offs_d = tl.arange(0, RANK_PAD)
    mask = mask_h[:, None] & (offs_d < RANK)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for s in range(0, tl.where(n_split > 1, n_split, 0)):
        lse_s = tl.load(PART_LSE + t * s_pl_t + h64 * s_pl_h + s, mask=mask_h, other=float("-inf"))
        o_s = tl.load(
            PART_O + t * s_po_t + h64[:, None] * s_po_h + s * s_po_s + offs_d[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_s - m_safe)  # 0 for an empty split
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l_sum = l_sum * alpha + w
        m = m_new
    empty = l_sum == 0.0
    l_safe = tl.where(empty, 1.0, l_sum)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(
        OUT + t * s_o_t + h64[:, None] * s_o_h + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask
    )
    tl.store(LSE + t * s_lse_t + h64 * s_lse_h, lse, mask=mask_h)
