"""One vLLM decode step in mla-backends' terms: the step's :class:`~mla_backends.metadata.BatchMetadata`
(built once by the metadata builder, shared by every layer) and each layer's cache tensor wrapped as a
:class:`~mla_backends.cache.LatentKVCache` (no copy).

Host syncs: none on a GPU. The host lists the metadata carries (``context_lens_list``: they size REF_TORCH's
work) come from vLLM's host copy ``CommonAttentionMetadata.seq_lens_cpu_upper_bound``, which vLLM documents as
exact for decode rows except under *asynchronous speculative decoding* (optimistic there); the adapter
declares single-token decode, so vLLM does not send speculative rows to it. When a vLLM build gives no host
copy, the device lengths are read once per step (one sync), the one place without a host source. Block ids:
on the CPU the table is host memory and is checked against the cache as :meth:`BatchMetadata.build` would; on
a GPU the table is vLLM's own, made by its allocator for this very cache, and is recorded as checked instead
of being read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...cache import LatentKVCache
from ...metadata import BatchMetadata
from ...validation import require_int, require_tensor

__all__ = ["decode_batch_metadata", "host_seq_lens", "wrap_cache", "trust_block_ids"]


def host_seq_lens(seq_lens: torch.Tensor, upper_bound: torch.Tensor | None) -> tuple[int, ...]:
    """Host copy of a step's decode lengths: ``upper_bound`` (vLLM's host tensor, first ``len(seq_lens)``
    rows) when given, else ``seq_lens`` itself (free on the CPU, one sync on a GPU)."""
    n = seq_lens.shape[0]
    src = upper_bound[:n] if upper_bound is not None else seq_lens
    return tuple(int(v) for v in src.tolist())


def decode_batch_metadata(block_table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: Sequence[int],
                          block_size: int, *, slot_mapping: torch.Tensor | None = None) -> BatchMetadata:
    """The :class:`BatchMetadata` of ``B`` single-token decode requests, in vLLM's order (no reordering).

    Args:
        block_table: ``[B, max_blocks]`` int page ids (vLLM's decode ``block_table``), on the cache's device.
        seq_lens: ``[B]`` int lengths including this step's token, same device.
        seq_lens_host: the same lengths as host ints (:func:`host_seq_lens`); nothing on the device is read.
        block_size: tokens per page of the layer caches.
        slot_mapping: ``[B]`` slots of the new tokens (vLLM writes them itself; default all ``-1``).
    """
    require_tensor("block_table", block_table, ndim=2)
    B = block_table.shape[0]
    require_tensor("seq_lens", seq_lens, shape=(B,))
    require_int("block_size", block_size, minimum=1)
    lens = tuple(seq_lens_host)
    if len(lens) != B:
        raise ValueError(f"seq_lens_host: got {len(lens)} lengths; supported one per request ({B})")
    for b, s in enumerate(lens):
        require_int(f"seq_lens_host[{b}]", s, minimum=1)
        if -(-s // block_size) > block_table.shape[1]:
            raise ValueError(f"block_table: request {b} holds {s} tokens and needs {-(-s // block_size)} pages "
                             f"of {block_size}; got a row of {block_table.shape[1]} entries")
    dev = block_table.device
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    ctx = seq - 1
    rows = torch.arange(B, device=dev)
    slots = (torch.full((B,), -1, dtype=torch.int64, device=dev) if slot_mapping is None
             else slot_mapping[:B].to(torch.int64))
    max_ids = None
    if dev.type == "cpu":  # host memory: the per-request largest live block id, as build() keeps it
        need = torch.tensor([-(-s // block_size) for s in lens], dtype=torch.int64)
        live = torch.arange(table.shape[1])[None, :] < need[:, None]
        max_ids = tuple(torch.where(live, table.long(), torch.full_like(table, -1, dtype=torch.long))
                        .amax(dim=1).tolist()) if B else ()
        if B and int(torch.where(live, table.long(), torch.zeros_like(table, dtype=torch.long)).min()) < 0:
            raise ValueError("block_table: got a negative block id in a live page; supported ids >= 0")
    return BatchMetadata(
        block_size=block_size, order=rows, token_order=rows, query_lens=torch.ones(B, dtype=torch.int32, device=dev),
        context_lens=ctx, seq_lens=seq, query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
        block_table=table, slot_mapping=slots, token_request=rows, token_positions=ctx.long(),
        query_lens_list=(1,) * B, context_lens_list=tuple(s - 1 for s in lens), max_block_ids=max_ids,
        verified_block_table=table)


def trust_block_ids(meta: BatchMetadata, cache: LatentKVCache) -> None:
    """Record ``meta``'s block ids as checked against ``cache`` when they cannot be read without a sync (a GPU
    table: vLLM's allocator made it for this cache); host tables keep the real check."""
    if meta.max_block_ids is None:
        meta.step_plan.block_ids_checked.add(cache.num_blocks)


def wrap_cache(data: torch.Tensor, *, kv_lora_rank: int, model_dtype: torch.dtype, scale: float,
               previous: LatentKVCache | None = None) -> LatentKVCache:
    """``data`` (vLLM's layer cache ``[num_blocks, block_size, 576]``, fp8 already viewed as fp8) as a
    :class:`LatentKVCache` sharing its memory; ``previous`` is returned as it is when it wraps the same tensor
    (address, shape, strides, dtype) with the same scale (the wrapper is made once per layer, not per step)."""
    if (previous is not None and previous.data.data_ptr() == data.data_ptr() and previous.data.shape == data.shape
            and previous.data.stride() == data.stride() and previous.data.dtype == data.dtype
            and previous.scale_value == scale):
        return previous
    fp8 = data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return LatentKVCache.from_tensor(data, kv_lora_rank=kv_lora_rank, model_dtype=model_dtype,
                                     scale=scale if fp8 else 1.0)
