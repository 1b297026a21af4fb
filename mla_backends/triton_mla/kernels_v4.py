"""``TRITON_MLA``'s DeepSeek-V4 kernel: a position range plus a gathered key set plus a sink, one softmax.

Imported only on the first call that needs it (``import mla_backends`` never imports triton). The launch is
built by :mod:`.launch_v4`; the split merge is :func:`~mla_backends.triton_mla.kernels.mla_decode_stage2`.

:func:`v4_attention_stage1`, grid ``(tokens * head_blocks, splits)``: one program takes ``BLOCK_H`` heads of one
query token (position ``p``, request ``b``) and one slice of the token's keys, which are, in this order,

1. the **range** (``HAS_RANGE``): positions ``max(0, p - window + 1) .. p`` (``WINDOWED``) or ``0 .. p`` of the
   main cache through the step's block table (the window of a V4 layer; a dense call);
2. the **gathered** keys (``HAS_GATHER``): ``GIDX [T, K]`` numbers (``-1`` pads) mapped through their own block
   table ``GBT`` (``GPAGE_SIZE`` rows a page) into a second cache (V4's compressed entries; a V3.2 top-k, whose
   numbers are positions of the main cache);

and keeps an online softmax in base 2 over both (the same ``softmax_step`` as the other kernels). Split 0
also counts the head's sink (``HAS_SINK``): one more logit with no value, so the merged LSE is
``log(sum exp(s) + exp(sink))`` and the merged output ``sum exp(s - lse) row``, as the contract defines.

Rows are read in place in one of three layouts (``LAYOUT``): 0, plain rows of one dtype (``KVE``, element
strides; an fp8 cache's per-tensor scale multiplies the tile); 1, DeepSeek-V4's 584-byte records (448 fp8 +
64 bf16 per row, data rows then ue8m0 scale rows a page; byte strides); 2, V3.2's 656-byte records (512 fp8,
4 float32 scales, 64 bf16, row after row). Records are read through byte (``KVU8``), bf16 (``KV16``) and
float32 (``KV32``) views of the same bytes; fp8 bytes are decoded with integer arithmetic (exact, every SM80+
GPU and the interpreter), scales are applied in float32, the bf16 tail is exact.

Interpreter (``TRITON_INTERPRET=1``): dot operands are float32 (the interpreter multiplies bf16 as integers),
as in the other kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import load_2d, softmax_finish, softmax_step, store_2d

__all__ = ["v4_attention_stage1", "decode_e4m3", "record_tile"]

#: log2(e): natural-log logits (the sinks) into the kernels' base 2
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def decode_e4m3(b):
    """fp8 e4m3 (OCP ``e4m3fn``) bytes ``b`` (uint8 tile) -> float32 values divided by 256, with integer
    arithmetic (exact on every SM80+ GPU and in the interpreter): the byte's exponent and mantissa bits moved into
    an fp16 (``(b & 0x7f) << 7``, the sign to bit 15) are the same number times ``2 ** -8``, fp16 subnormals
    included; callers fold the 256 into their scale. ``0x7f``/``0xff`` (NaN) are never written by the cache
    writers."""
    x = b.to(tl.int16)
    h = ((x & 0x7F) << 7) | ((x & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ue8m0(b):
    """A ue8m0 scale byte -> ``2 ** (b - 127)`` (float32 bits; byte 0 is ``2**-127``, a subnormal)."""
    x = b.to(tl.int32)
    return tl.where(x == 0, 1 << 22, x << 23).to(tl.float32, bitcast=True)


@triton.jit
def record_tile(KVE, KVU8, KV16, KV32, page, off, cols, mask_n, mask_c, s_b, s_p, kv_scale,
                LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Columns ``cols [C]`` of the rows at ``(page [N] int64, off [N])`` as a float32 ``[N, C]`` tile (0 where
    masked). ``s_b`` / ``s_p``: page and row strides (elements for plain rows, bytes for records)."""
    m = mask_n[:, None] & mask_c[None, :]
    if LAYOUT == 0:
        row = page * s_b + off * s_p
        tile = tl.load(KVE + row[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32) * kv_scale
    elif LAYOUT == 1:  # DeepSeek-V4: data rows of 576 bytes, then the page's scale rows of 8
        base = page * s_b
        data = base + off * 576
        is8 = cols < 448
        c8 = tl.where(is8, cols, 0)
        m8 = m & is8[None, :]
        v8 = decode_e4m3(tl.load(KVU8 + data[:, None] + c8[None, :], mask=m8, other=0))
        sb = tl.load(KVU8 + (base + PAGE_SIZE * 576 + off * 8)[:, None] + (c8 // 64)[None, :], mask=m8, other=127)
        c16 = tl.where(is8, 0, cols - 448)
        v16 = tl.load(KV16 + ((data + 448) // 2)[:, None] + c16[None, :], mask=m & (~is8)[None, :],
                      other=0.0).to(tl.float32)
        tile = tl.where(is8[None, :], v8 * (_ue8m0(sb) * 256.0), v16)
    else:  # DeepSeek-V3.2's fp8_ds_mla: 512 fp8, 4 float32 scales, 64 bf16, record after record
        data = page * s_b + off * 656
        is8 = cols < 512
        c8 = tl.where(is8, cols, 0)
        m8 = m & is8[None, :]
        v8 = decode_e4m3(tl.load(KVU8 + data[:, None] + c8[None, :], mask=m8, other=0))
        sc = tl.load(KV32 + ((data + 512) // 4)[:, None] + (c8 // 128)[None, :], mask=m8, other=1.0)
        c16 = tl.where(is8, 0, cols - 512)
        v16 = tl.load(KV16 + ((data + 528) // 2)[:, None] + c16[None, :], mask=m & (~is8)[None, :],
                      other=0.0).to(tl.float32)
        tile = tl.where(is8[None, :], v8 * (sc * 256.0), v16)
    return tile


@triton.jit
def _attend_rows(KVE, KVU8, KV16, KV32, page, off, valid, s_b, s_p, kv_scale, q, qr, m_i, l_i, acc, sm_scale_log2,
                 offs_d, mask_d, offs_r, mask_r, LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr, RANK: tl.constexpr,
                 ROPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of keys, the rows at ``(page, off)`` (``valid`` ones; the others score ``-inf``): scores
    ``q . kv (+ qr . kr)`` scaled to base 2, folded into the online softmax and the accumulator."""
    kv = record_tile(KVE, KVU8, KV16, KV32, page, off, offs_d, valid, mask_d, s_b, s_p, kv_scale, LAYOUT, PAGE_SIZE)
    kvd = kv.to(DOT_DTYPE)
    qk = tl.dot(q, tl.trans(kvd), input_precision=DOT_PRECISION)
    if ROPE > 0:
        kr = record_tile(KVE, KVU8, KV16, KV32, page, off, RANK + offs_r, valid, mask_r, s_b, s_p, kv_scale, LAYOUT,
                         PAGE_SIZE)
        qk += tl.dot(qr, tl.trans(kr.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk = tl.where(valid[None, :], qk * sm_scale_log2, float("-inf"))
    m_i, l_i, alpha, p = softmax_step(m_i, l_i, qk)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kvd, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def v4_attention_stage1(
    QL, QR,
    KVE, KVU8, KV16, KV32, BT,
    GKVE, GKVU8, GKV16, GKV32, GBT, GIDX,
    SINKS, TOK_REQ, TOK_POS, PART_O, PART_LSE,
    sm_scale_log2, kv_scale, num_heads, window, gather_width, num_splits, head_blocks,
    s_ql_t, s_ql_h, s_qr_t, s_qr_h,
    s_kv_b, s_kv_p, s_bt_b,
    s_g_b, s_g_p, s_gbt_b, s_gi_t,
    s_po_t, s_po_h, s_po_s, s_pl_t, s_pl_h,
    PAGE_SIZE: tl.constexpr, GPAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RANGE: tl.constexpr, WINDOWED: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % head_blocks
    t = pid // head_blocks
    split = tl.program_id(1)
    t64 = t.to(tl.int64)
    req = tl.load(TOK_REQ + t).to(tl.int64)
    pos = tl.load(TOK_POS + t).to(tl.int32)
    lo = pos * 0
    n_range = pos * 0
    if HAS_RANGE:
        if WINDOWED:
            lo = tl.maximum(pos - window + 1, 0)
        n_range = pos + 1 - lo
    n_keys = n_range
    if HAS_GATHER:
        n_keys = n_range + gather_width
    per_split = tl.cdiv(n_keys, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, n_keys)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    h64 = offs_h.to(tl.int64)
    offs_d = tl.arange(0, RANK_PAD)
    mask_d = offs_d < RANK
    q = load_2d(QL + t64 * s_ql_t + h64 * s_ql_h, offs_d, mask_h, mask_d).to(DOT_DTYPE)
    qr = q
    offs_r = offs_d
    mask_r = mask_d
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_PAD)
        mask_r = offs_r < ROPE
        qr = load_2d(QR + t64 * s_qr_t + h64 * s_qr_h, offs_r, mask_h, mask_r).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    if HAS_RANGE:  # the window (or the whole causal context) of the main cache
        r_end = tl.minimum(end, n_range)
        bt_row = BT + req * s_bt_b
        for n0 in range(start, r_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = offs_n < r_end
            kpos = tl.where(valid, lo + offs_n, 0)
            page = tl.load(bt_row + kpos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_rows(KVE, KVU8, KV16, KV32, page, kpos % PAGE_SIZE, valid, s_kv_b, s_kv_p,
                                         kv_scale, q, qr, m_i, l_i, acc, sm_scale_log2, offs_d, mask_d, offs_r,
                                         mask_r, LAYOUT, PAGE_SIZE, RANK, ROPE, DOT_DTYPE, DOT_PRECISION)
    if HAS_GATHER:  # the gathered keys: numbers through their own table into their own cache
        g_start = tl.maximum(start, n_range) - n_range
        g_end = end - n_range
        gbt_row = GBT + req * s_gbt_b
        for n0 in range(g_start, g_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            inside = offs_n < g_end
            e = tl.load(GIDX + t64 * s_gi_t + offs_n, mask=inside, other=-1).to(tl.int32)
            valid = inside & (e >= 0)
            e = tl.where(valid, e, 0)
            page = tl.load(gbt_row + e // GPAGE_SIZE, mask=valid, other=0).to(tl.int64)
            valid = valid & (page >= 0)
            page = tl.where(valid, page, 0)
            m_i, l_i, acc = _attend_rows(GKVE, GKVU8, GKV16, GKV32, page, e % GPAGE_SIZE, valid, s_g_b, s_g_p,
                                         kv_scale, q, qr, m_i, l_i, acc, sm_scale_log2, offs_d, mask_d, offs_r,
                                         mask_r, LAYOUT, GPAGE_SIZE, RANK, ROPE, DOT_DTYPE, DOT_PRECISION)
    if HAS_SINK:  # split 0 counts each head's sink: a logit with no value
        sink = tl.load(SINKS + offs_h, mask=mask_h, other=float("-inf")).to(tl.float32) * _LOG2E
        sink = tl.where((offs_h * 0 + split) == 0, sink, float("-inf"))
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new

    l_safe, lse2 = softmax_finish(m_i, l_i)
    store_2d(PART_O + t64 * s_po_t + h64 * s_po_h + split * s_po_s, offs_d, acc / l_safe[:, None], mask_h, mask_d)
    tl.store(PART_LSE + t64 * s_pl_t + h64 * s_pl_h + split, lse2, mask=mask_h)
