"""One SGLang forward batch in mla-backends' terms: the batch's :class:`~mla_backends.step.metadata.BatchMetadata`
(built once, in the backend's per-batch metadata hook, shared by every layer), the per-batch MHA-or-absorbed
decision, SGLang's token-to-KV pool buffer seen as pages (wrapped as a
:class:`~mla_backends.step.cache.LatentKVCache` by the core's :class:`~..engine_core.LayerCaches`, no copy) and the
dense up-projection the expanded path runs ``forward_mha`` with. Pure PyTorch: nothing here imports SGLang.

SGLang's cache: each layer's pool buffer is ``[slots + page_size, 1, kv_lora_rank + rope]``; slot ``s`` lies in
page ``s // page_size`` at offset ``s % page_size`` (SGLang's paged allocator hands out whole pages, so a request's
positions ``j`` map to slots of page ``req_to_token[r, j - j % P] // P``). Viewing the buffer as ``[pages,
page_size, row]`` is the paged cache mla-backends reads; the page table is every ``page_size``-th column of
``req_to_token`` divided by the page size (page size 1: the slots themselves).

Host syncs: none on a GPU for decode. The host lengths come from SGLang's ``seq_lens_cpu`` (SGLang keeps a host
copy for every batch it schedules; :attr:`AttentionBackend.needs_cpu_seq_lens` stays True), and the page table is
SGLang's own, made by its allocator for this very pool, so it is trusted (``BatchMetadata.for_decode``), not read
back. An extend batch is built with :meth:`BatchMetadata.build`, which checks the page table on the host: one
read of the table per extend batch on a GPU (not per layer), the one place with a sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...core.validation import require_int, require_tensor
from ...layer.dispatch import DispatchPolicy, PerBatchPolicy, policy_from_table, table_from_env
from ...step.metadata import BatchMetadata

__all__ = ["page_table", "decode_metadata", "extend_metadata", "pool_pages", "sglang_policy",
           "dense_up_projection"]


def page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int, page_size: int
               ) -> torch.Tensor:
    """``[B, ceil(max_len / page_size)]`` int32 page ids of the batch's requests (``req_pool_indices``) from
    SGLang's ``req_to_token [pool rows, context len]`` slot table: every ``page_size``-th slot over the page
    size. Columns past a request's length hold whatever the table holds there (never read)."""
    require_tensor("req_to_token", req_to_token, ndim=2)
    require_tensor("req_pool_indices", req_pool_indices, ndim=1)
    require_int("max_len", max_len, minimum=0)
    require_int("page_size", page_size, minimum=1)
    if max_len > req_to_token.shape[1]:
        raise ValueError(f"max_len: got {max_len}; supported <= req_to_token's {req_to_token.shape[1]} columns")
    pages = max(1, -(-max_len // page_size))
    rows = req_to_token.index_select(0, req_pool_indices.to(torch.long))
    cols = rows[:, : pages * page_size: page_size]
    if page_size > 1:
        cols = torch.div(cols, page_size, rounding_mode="floor")
    return cols.to(torch.int32)


def decode_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    seq_lens_host: Sequence[int], page_size: int, *,
                    slot_mapping: torch.Tensor | None = None) -> BatchMetadata:
    """The :class:`BatchMetadata` of a decode batch (one new token per request, SGLang's order): the page table
    of :func:`page_table` and :meth:`BatchMetadata.for_decode` on the device lengths with their host copy
    (SGLang's ``seq_lens_cpu``) and the new tokens' slots (SGLang's ``out_cache_loc``, which the adapter writes
    through this metadata); nothing on the device is read."""
    lens = tuple(int(v) for v in seq_lens_host)
    table = page_table(req_to_token, req_pool_indices, max(lens, default=1), page_size)
    return BatchMetadata.for_decode(table, seq_lens, lens, page_size, slot_mapping=slot_mapping)


def extend_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: Sequence[int],
                    extend_lens: Sequence[int], page_size: int, num_pages: int) -> BatchMetadata:
    """The :class:`BatchMetadata` of an extend batch (``extend_lens[b]`` new tokens after ``prefix_lens[b]`` cached
    ones, SGLang's host lists), in SGLang's order (no reordering: the rows of SGLang's query are the metadata's
    tokens), page ids checked against the ``num_pages`` of the pool. Its slots (from the page table) are the
    ones SGLang allocated for the new tokens (``out_cache_loc``): the adapter writes through it."""
    pre = [int(v) for v in prefix_lens]
    ext = [int(v) for v in extend_lens]
    if len(pre) != len(ext):
        raise ValueError(f"prefix_lens: got {len(pre)} entries; supported one per request ({len(ext)} extend_lens)")
    longest = max((p + e for p, e in zip(pre, ext, strict=True)), default=1)
    table = page_table(req_to_token, req_pool_indices, longest, page_size)
    return BatchMetadata.build(ext, pre, table, page_size, num_blocks=num_pages, reorder=False)


def pool_pages(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang's layer buffer ``[slots, 1, row]`` (``get_key_buffer(layer_id)``, fp8 already viewed as fp8) seen as
    ``[slots // page_size, page_size, row]`` pages, sharing its memory (the paged cache mla-backends reads)."""
    require_tensor("buffer", buffer, ndim=3)
    require_int("page_size", page_size, minimum=1)
    if buffer.shape[1] != 1:
        raise ValueError(f"buffer: got shape {list(buffer.shape)}; supported [slots, 1, row] (SGLang's MLA pool: "
                         "one latent head)")
    if buffer.shape[0] % page_size:
        raise ValueError(f"buffer: got {buffer.shape[0]} slots; supported a multiple of page_size {page_size}")
    return buffer.view(buffer.shape[0] // page_size, page_size, buffer.shape[2])


def sglang_policy(backend_name: str) -> DispatchPolicy:
    """The dispatch policy of the SGLang handler: the measured per-request thresholds of
    ``MLA_BACKENDS_THRESHOLD_TABLE`` for ``backend_name`` when that table measured it (``mla-backends tune``),
    else :class:`PerBatchPolicy` (SGLang's own rule on the summed cached prefix)."""
    path = table_from_env()
    if path is not None:
        policy = policy_from_table(path, backend_name, strict=False, argument="MLA_BACKENDS_THRESHOLD_TABLE")
        if policy is not None:
            return policy
    return PerBatchPolicy()


def dense_up_projection(weight: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], *, rows: int,
                        kv_lora_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[rows, kv_lora_rank]`` matrix ``forward_mha`` up-projects the latent with (``kv_b_proj``: ``rows`` =
    heads * (qk_nope + v_head_dim), head-major): ``weight`` itself when it is that matrix in ``dtype``, else
    the dense equivalent of the engine's projection, ``project(identity).T``, computed once (a quantised
    ``kv_b_proj`` whose weight is not a plain matrix; ``project`` maps ``[n, kv_lora_rank]`` to ``[n, rows]``)."""
    require_int("rows", rows, minimum=1)
    require_int("kv_lora_rank", kv_lora_rank, minimum=1)
    if (isinstance(weight, torch.Tensor) and weight.dtype == dtype and tuple(weight.shape) == (rows, kv_lora_rank)):
        return weight
    with torch.no_grad():
        eye = torch.eye(kv_lora_rank, dtype=dtype, device=weight.device)
        dense = project(eye)
    require_tensor("kv_b_proj(identity)", dense, shape=(kv_lora_rank, rows))
    return dense.t().contiguous().to(dtype)
