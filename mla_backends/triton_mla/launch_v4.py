"""The launches of one ``TRITON_MLA`` call that takes the DeepSeek-V4 kernel, as data (no triton import at
module level): :func:`build_v4_launches`.

Calls that go there: every call with V4 inputs (sinks, a window, compressed keys: ``V4Keys``) and every call on
``fp8_ds_mla`` record caches (:class:`~mla_backends.step.records.RecordCache`), dense or sparse. The kernel
(:func:`~mla_backends.triton_mla.kernels_v4.v4_attention_stage1`) reads a position range of the main cache and
a gathered key set; this module says which:

================================  ===========================  =================================================
call                              range                        gathered keys
================================  ===========================  =================================================
V4 (``window``, ``compressed``)   ``p - window + 1 .. p``      ``compressed.indices`` (repeats counted once)
                                                               through ``compressed.block_table`` into
                                                               ``compressed.cache``
dense (records, or V4 without a   ``0 .. p``                   none
window)
sparse (``topk_indices``)         none                         the top-k positions through ``meta``'s table into
                                                               the main cache (each entry counts, as FlashMLA)
================================  ===========================  =================================================

The splits are :func:`~mla_backends.triton_mla.splits.choose_num_kv_splits` of the most keys a token has
(host values: the window, the step's longest sequence, the index width); the merge is stage 2 of the other
kernels.
"""

from __future__ import annotations

import torch

from ..backends.v4_inputs import V4Keys
from ..core.attention_math import distinct_topk
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from ..step.records import RecordCache
from .configs import INTERPRET_BLOCK_N, KernelConfig, stage1_grid
from .launch import LOG2E, Launch, dot_dtypes, stage2_launch
from .splits import SCRATCH, next_pow2

__all__ = ["build_v4_launches", "v4_key_count", "cache_views"]

#: the kernel's row layouts: plain rows, DeepSeek-V4 records, DeepSeek-V3.2 records
_LAYOUT = {None: 0, "v4": 1, "v32": 2}


def cache_views(cache: LatentKVCache) -> tuple[int, tuple[torch.Tensor, ...], int, int]:
    """``(layout, (KVE, KVU8, KV16, KV32), page stride, row stride)`` of a cache for the kernel: plain rows
    through ``data`` (element strides), records through byte / bf16 / float32 views of their bytes (byte
    strides)."""
    if isinstance(cache, RecordCache):
        raw = cache.byte_span
        n4 = raw.numel() // 4 * 4
        u8 = raw[:n4]
        views = (u8, u8, u8.view(torch.bfloat16), u8.view(torch.float32))
        return _LAYOUT[cache.layout.name], views, cache.page_stride, cache.layout.record_bytes
    kv = cache.data
    return 0, (kv, kv, kv, kv), kv.stride(0), kv.stride(1)


def v4_key_count(meta: BatchMetadata, keys: V4Keys | None, topk_width: int) -> int:
    """The most keys one token of the call attends (host values): window (or whole context) plus gathered."""
    if topk_width:
        return topk_width
    rng = meta.max_seq_len if keys is None or keys.window is None else min(keys.window, meta.max_seq_len)
    comp = 0 if keys is None or keys.compressed is None else int(keys.compressed.indices.shape[1])
    return rng + comp


def build_v4_launches(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    scale: float,
    keys: V4Keys | None,
    topk_indices: torch.Tensor | None,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    cfg: KernelConfig,
    splits: int,
    interpret: bool,
) -> list[Launch]:
    """The V4 kernel's stage 1 and the merge for one call (inputs validated by ``forward_mqa``; the table above
    says what the range and the gathered keys are). ``keys`` None: a dense or sparse call on record caches."""
    T, H, R = q_latent.shape
    P = cache.qk_rope_head_dim
    rank_pad, rope_pad = max(16, next_pow2(R)), max(16, next_pow2(P))
    dot, _, precision = dot_dtypes(cfg, q_latent.dtype, interpret)
    block_n = INTERPRET_BLOCK_N if interpret else cfg.block_n
    layout, views, s_b, s_p = cache_views(cache)
    sparse = topk_indices is not None
    comp = keys.compressed if keys is not None else None
    if sparse:  # V3.2 top-k: positions of the main cache, each entry counted
        gidx, gcache, gtable, gpage = topk_indices, cache, meta.block_table, cache.block_size
    elif comp is not None:
        gidx, gcache, gtable, gpage = distinct_topk(comp.indices), comp.cache, comp.block_table, comp.cache.block_size
    else:
        gidx, gcache, gtable, gpage = meta.token_positions[:, None], cache, meta.block_table, cache.block_size
    gidx = gidx.contiguous()
    _, gviews, g_b, g_p = cache_views(gcache)
    window = keys.window if keys is not None and keys.window is not None else 0
    sinks = keys.sinks if keys is not None and keys.sinks is not None else q_latent.new_zeros(1, dtype=torch.float32)
    K = int(gidx.shape[1]) if (sparse or comp is not None) else 0
    part_o, part_lse = SCRATCH.get(cache.device, T, H, splits, R)
    kv_scale = cache.scale_value if cache.is_fp8 else 1.0
    head_blocks = -(-H // cfg.block_h)
    stage1 = Launch("kernels_v4", "v4_attention_stage1", stage1_grid(T, head_blocks, splits), (
        q_latent, q_rope, *views, meta.block_table, *gviews, gtable, gidx,
        sinks, meta.token_request, meta.token_positions, part_o, part_lse,
        float(scale) * LOG2E, float(kv_scale), H, max(1, window), max(1, K), splits, head_blocks,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        s_b, s_p, meta.block_table.stride(0), g_b, g_p, gtable.stride(0), gidx.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
    ), dict(
        PAGE_SIZE=cache.block_size, GPAGE_SIZE=gpage, LAYOUT=layout, RANK=R, RANK_PAD=rank_pad, ROPE=P,
        ROPE_PAD=rope_pad, BLOCK_H=cfg.block_h, BLOCK_N=block_n, HAS_RANGE=not sparse, WINDOWED=window > 0,
        HAS_GATHER=K > 0, HAS_SINK=keys is not None and keys.sinks is not None, DOT_DTYPE=dot,
        DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=1 if interpret else cfg.num_stages,
    ))
    return [stage1, stage2_launch(part_o, part_lse, out, lse_out, splits, rank_pad)]
