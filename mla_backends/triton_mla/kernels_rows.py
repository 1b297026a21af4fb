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

Splits follow the work: a request of ``S`` positions gets ``clamp(ceil(S / split_len), 1,
max_splits)`` splits (from the device-side ``seq_lens``), each a whole number of tiles, and tiles start at
multiples of ``BLOCK_N`` (one block-table lookup per tile when the page size is a multiple of it, read one
tile ahead so that ``num_stages`` tiles are in flight). A request
with one split writes its output and LSE directly; the merge (:func:`mla_decode_merge`) then skips its
tokens. Partials are stored in the output's dtype (bf16/fp16; the LSE in float32).

``QK_FP8``: queries arrive quantised to fp8 e4m3 per (token, head) with a float32 scale (done in torch
before the launch) and the score product runs fp8 x fp8 on the raw fp8 cache tile; the output product
stays 16-bit (the probabilities in the query dtype times the tile converted exactly from fp8).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import kv_dequant_scale, load_2d, merge_splits, softmax_finish, softmax_step, store_2d

__all__ = ["mla_decode_rows", "mla_decode_merge", "QK_FP8_PROMOTE"]

#: fp8 score products (``QK_FP8``): the products summed in the tensor core's reduced-precision accumulator
#: before they are added into the fp32 accumulator (Triton's ``max_num_imprecise_acc``; 4 fp8 ``wgmma``
#: of K = 32). Triton's default for fp8 is 2**30, i.e. the 576-long sum is never promoted. A dot shorter
#: than this promotes once, at its end. 0 (the default) keeps Triton's default: 128 costs a second score
#: accumulator, 255 registers and 8-24 B of spills on sm90a (docs/triton.md, "fp8 score products"), so it stays
#: off until a GPU run measures its speed and error against the default (issue 27).
QK_FP8_PROMOTE = tl.constexpr(0)


@triton.jit
def _split_count(seq_len, split_len, max_splits):
    """Splits of a request of ``seq_len`` positions: ``clamp(ceil(seq_len / split_len), 1, max)``."""
    n = tl.cdiv(seq_len, split_len)
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
    split_len,
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
    # fp8 scores: promote every QK_FP8_PROMOTE products (at most the dot's K; 0: Triton's default); 16-bit dots
    # ignore it
    PROMOTE_L: tl.constexpr = QK_FP8_PROMOTE if HALF >= QK_FP8_PROMOTE else HALF
    PROMOTE_R: tl.constexpr = QK_FP8_PROMOTE if ROPE_PAD >= QK_FP8_PROMOTE else ROPE_PAD
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
    n_split = _split_count(seq_len, split_len, max_splits)
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
    q0 = load_2d(q_row, offs_d, mask_m, mask_d0).to(QK_DTYPE)
    q1 = load_2d(q_row + HALF, offs_d, mask_m, mask_d1).to(QK_DTYPE)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_PAD)
        mask_r = offs_r < ROPE
        qr = load_2d(QR + tok64 * s_qr_t + h64 * s_qr_h, offs_r, mask_m, mask_r).to(QK_DTYPE)

    kv_scale = kv_dequant_scale(KV_SCALE, IS_FP8)
    if QK_FP8:  # a scale per row (the query's fp8 scale); otherwise one scalar for the whole tile
        qk_scale = (sm_scale_log2 * kv_scale) * tl.load(QSCALE + tok64 * num_heads + h64, mask=mask_m, other=1.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, HALF], tl.float32)  # output columns 0 .. HALF - 1
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)  # output columns HALF .. RANK_PAD - 1
    bt_row = BT + req * s_bt_b
    # page-aligned tiles: the block-table entry of the next tile is read one tile ahead (loop-carried), so
    # the tile loads do not wait on a load of their own iteration and Triton's pipeliner keeps num_stages
    # tile buffers in flight (with the lookup inside the iteration it keeps two, whatever num_stages says)
    page_next = tl.load(bt_row + start // PAGE_SIZE, mask=start < end, other=0).to(tl.int64)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        offs_c = tl.minimum(offs_n, end - 1)  # clamped: every row address is a visible cache row
        if PAGE_SIZE % BLOCK_N == 0:
            page = page_next  # the tile lies in one page: one lookup, made in the previous iteration
            page_next = tl.load(bt_row + tl.minimum(n0 + BLOCK_N, end - 1) // PAGE_SIZE).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_c // PAGE_SIZE).to(tl.int64)
        row = KV + page * s_kv_b + (offs_c % PAGE_SIZE) * s_kv_p
        if RANK == RANK_PAD:
            # unmasked loads (fewer registers): rows past the end read a valid row of the same tile's page
            # walk (clamped below), and their scores are masked
            kv0 = tl.load(row[:, None] + offs_d[None, :])
            kv1 = tl.load(row[:, None] + HALF + offs_d[None, :])
        else:
            kv0 = load_2d(row, offs_d, mask_n, mask_d0)
            kv1 = load_2d(row + HALF, offs_d, mask_n, mask_d1)
        qk = tl.dot(q0, tl.trans(kv0.to(QK_DTYPE)), input_precision=DOT_PRECISION,
                    max_num_imprecise_acc=PROMOTE_L if QK_FP8 and QK_FP8_PROMOTE > 0 else None)
        qk = tl.dot(q1, tl.trans(kv1.to(QK_DTYPE)), qk, input_precision=DOT_PRECISION,
                    max_num_imprecise_acc=PROMOTE_L if QK_FP8 and QK_FP8_PROMOTE > 0 else None)
        if ROPE > 0:
            if ROPE == ROPE_PAD:
                kr = tl.load(row[:, None] + RANK + offs_r[None, :])
            else:
                kr = load_2d(row + RANK, offs_r, mask_n, mask_r)
            qk = tl.dot(qr, tl.trans(kr.to(QK_DTYPE)), qk, input_precision=DOT_PRECISION,
                        max_num_imprecise_acc=PROMOTE_R if QK_FP8 and QK_FP8_PROMOTE > 0 else None)
        if QK_FP8:
            qk = qk * qk_scale[:, None]
        else:
            qk = qk * (sm_scale_log2 * kv_scale)
        if TOKS_PB == 1:  # one token a program: its causal limit is the split's end, mask_n (no row vector)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        else:
            qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= row_pos[:, None]), qk, float("-inf"))
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, qk)
        p16 = p.to(DOT_DTYPE)
        acc0 = tl.dot(p16, kv0.to(DOT_DTYPE), acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        acc1 = tl.dot(p16, kv1.to(DOT_DTYPE), acc1 * alpha[:, None], input_precision=DOT_PRECISION)

    l_safe, lse2 = softmax_finish(m_i, l_i)
    inv = kv_scale / l_safe
    # the epilogue's row addresses are rebuilt here from scalar int64 bases and int32 row indices: reusing
    # the int64 row vectors of the query loads keeps them live over the loop, which spilled 32 bytes under
    # Triton 3.9 (docs/triton.md, "Compile report")
    e_tok = offs_m // HEADS_PB
    e_head = offs_m % HEADS_PB
    keep = (e_tok < toks_here) & (hb * HEADS_PB + e_head < num_heads) & ((offs_m * 0 + split) < n_split)
    e_tok64 = tl.where(keep, e_tok, 0).to(tl.int64)
    e_head64 = tl.where(keep, e_head, 0).to(tl.int64)
    t0_64 = t0.to(tl.int64)
    h0_64 = (hb * HEADS_PB).to(tl.int64)
    # each branch stores its own tiles: selecting the destination pointers first and storing once after the
    # branch keeps both scaled accumulators live across it, which spilled 2,112 bytes under Triton 3.6
    if n_split == 1:  # one split: the output and its natural-log LSE directly
        o_row = OUT + (t0_64 + e_tok64) * s_o_t + (h0_64 + e_head64) * s_o_h
        store_2d(o_row, offs_d, acc0 * inv[:, None], keep, mask_d0)
        store_2d(o_row + HALF, offs_d, acc1 * inv[:, None], keep, mask_d1)
        lse_row = LSE + (t0_64 + e_tok64) * s_lse_t + (h0_64 + e_head64) * s_lse_h
        tl.store(lse_row, lse2 * 0.6931471805599453, mask=keep)
    else:  # a partial (output dtype) and its base-2 LSE, for the merge
        o_row = PART_O + (t0_64 + e_tok64) * s_po_t + (h0_64 + e_head64) * s_po_h + split * s_po_s
        store_2d(o_row, offs_d, acc0 * inv[:, None], keep, mask_d0)
        store_2d(o_row + HALF, offs_d, acc1 * inv[:, None], keep, mask_d1)
        lse_row = PART_LSE + (t0_64 + e_tok64) * s_pl_t + (h0_64 + e_head64) * s_pl_h + split
        tl.store(lse_row, lse2, mask=keep)


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
    split_len,
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
    n_split = _split_count(tl.load(SEQ_LENS + req), split_len, max_splits)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < num_heads) & ((offs_h * 0 + n_split) > 1)
    merge_splits(
        PART_O, PART_LSE, OUT, LSE, t, offs_h, mask_h, tl.where(n_split > 1, n_split, 0),
        s_po_t, s_po_h, s_po_s, s_pl_t, s_pl_h, s_o_t, s_o_h, s_lse_t, s_lse_h, RANK, RANK_PAD, BLOCK_H,
    )
