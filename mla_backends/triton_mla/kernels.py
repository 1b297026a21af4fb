"""Triton kernels of ``TRITON_MLA``: split-KV paged absorbed-MLA decode in two stages.

Imported only on the first ``forward_mqa`` call (``import mla_backends`` never imports triton).

Stage 1 (:func:`mla_decode_stage1`), grid ``(tokens * head_blocks, num_kv_splits)``: one program takes
``BLOCK_H`` heads of one query token and one contiguous slice of that token's visible positions (dense) or of
its top-k list (sparse). It walks the slice ``BLOCK_N`` positions at a time, maps positions to cache rows
through the block table, loads each ``[BLOCK_N, kv_lora_rank]`` latent tile once (it is K for the score and V
for the output) plus the ``[BLOCK_N, qk_rope_head_dim]`` rope tile, and keeps an online softmax in base 2.
It writes the slice's normalised partial output ``[BLOCK_H, kv_lora_rank]`` (fp32) and its base-2 LSE
(``-inf`` for an empty slice) to the scratch buffers.

Stage 2 (:func:`mla_decode_stage2`), grid ``(tokens * head_blocks,)``: merges the splits of each token by their
LSE and writes the output in the output's dtype plus the natural-log LSE (float32).

Tokens and head blocks share grid axis 0 (CUDA allows ``2**31 - 1`` programs there, 65,535 on axes 1 and 2),
head block fastest, so the programs that read the same cache rows (same token, same split, different heads)
are launched together and share those rows through L2. Head offsets are int64 before they multiply a stride:
a head-strided view can have ``(H - 1) * stride >= 2**31`` while every stride fits the int32 a launch passes.

Interpreter (``TRITON_INTERPRET=1``) workarounds, active only when ``INTERPRET`` is set: dot operands are
upcast to float32 (the interpreter multiplies bf16 as integers). Compiled code keeps bf16/fp16 dot operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .interpreter import interpreter_enabled
from .kernel_parts import kv_dequant_scale, load_2d, merge_splits, softmax_finish, softmax_step, store_2d

__all__ = ["INTERPRET", "mla_decode_stage1", "mla_decode_stage2"]

#: the decorator reads TRITON_INTERPRET when this module is imported; the workarounds follow the same value
INTERPRET: bool = interpreter_enabled()


@triton.jit
def mla_decode_stage1(
    QL,
    QR,
    KV,
    KV_SCALE,
    BT,
    TOK_REQ,
    TOK_POS,
    TOPK,
    PART_O,
    PART_LSE,
    sm_scale_log2,  # softmax scale * log2(e)
    num_heads,
    topk_width,
    num_splits,
    head_blocks,
    s_ql_t,
    s_ql_h,
    s_qr_t,
    s_qr_h,
    s_kv_b,
    s_kv_p,
    s_bt_b,
    s_topk_t,
    s_topk_k,
    s_po_t,
    s_po_h,
    s_po_s,
    s_pl_t,
    s_pl_h,
    PAGE_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % head_blocks
    t = pid // head_blocks
    split = tl.program_id(1)
    req = tl.load(TOK_REQ + t).to(tl.int64)
    pos = tl.load(TOK_POS + t).to(tl.int32)  # positions fit in int32; row offsets below are int64
    if SPARSE:
        length = pos * 0 + topk_width  # a tensor even when topk_width == 1 arrives as a constexpr
    else:
        length = pos + 1  # causal: positions 0 .. context_len + j are visible
    per_split = tl.cdiv(length, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    h64 = offs_h.to(tl.int64)  # (H - 1) * head stride can pass 2**31
    offs_d = tl.arange(0, RANK_PAD)
    mask_d = offs_d < RANK
    t64 = t.to(tl.int64)
    q = load_2d(QL + t64 * s_ql_t + h64 * s_ql_h, offs_d, mask_h, mask_d).to(DOT_DTYPE)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_PAD)
        mask_r = offs_r < ROPE
        qr = load_2d(QR + t64 * s_qr_t + h64 * s_qr_h, offs_r, mask_h, mask_r).to(DOT_DTYPE)

    kv_scale = kv_dequant_scale(KV_SCALE, IS_FP8)
    qk_scale = sm_scale_log2 * kv_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    bt_row = BT + req * s_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if SPARSE:
            kpos = tl.load(TOPK + t64 * s_topk_t + offs_n.to(tl.int64) * s_topk_k, mask=mask_n, other=-1).to(tl.int32)
            mask_n = mask_n & (kpos >= 0)
            kpos = tl.where(mask_n, kpos, 0)
        else:
            kpos = offs_n
        page = tl.load(bt_row + kpos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = KV + page * s_kv_b + (kpos % PAGE_SIZE) * s_kv_p
        kv = load_2d(row, offs_d, mask_n, mask_d).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
        if ROPE > 0:
            kr = load_2d(row + RANK, offs_r, mask_n, mask_r).to(DOT_DTYPE)
            qk += tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, qk)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv, input_precision=DOT_PRECISION)

    l_safe, lse2 = softmax_finish(m_i, l_i)
    o = acc / l_safe[:, None] * kv_scale
    store_2d(PART_O + t64 * s_po_t + h64 * s_po_h + split * s_po_s, offs_d, o, mask_h, mask_d)
    tl.store(PART_LSE + t64 * s_pl_t + h64 * s_pl_h + split, lse2, mask=mask_h)


@triton.jit
def mla_decode_stage2(
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    num_heads,
    num_splits,
    head_blocks,
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
    """Merge of :func:`mla_decode_stage1`'s ``num_splits`` splits, grid ``(tokens * head_blocks,)``."""
    pid = tl.program_id(0)
    hb = pid % head_blocks
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    merge_splits(
        PART_O, PART_LSE, OUT, LSE, (pid // head_blocks).to(tl.int64), offs_h, offs_h < num_heads, num_splits,
        s_po_t, s_po_h, s_po_s, s_pl_t, s_pl_h, s_o_t, s_o_h, s_lse_t, s_lse_h, RANK, RANK_PAD, BLOCK_H,
    )
