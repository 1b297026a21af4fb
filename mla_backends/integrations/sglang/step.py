"""One SGLang forward batch in mla-backends' terms: the batch's :class:`~mla_backends.step.metadata.BatchMetadata`
(built once, in the backend's per-batch metadata hook, shared by every layer), the per-batch MHA-or-absorbed
decision, and SGLang's token-to-KV pool buffer wrapped as a :class:`~mla_backends.step.cache.LatentKVCache`
(no copy). Pure PyTorch: nothing here imports SGLang.

SGLang's cache: each layer's pool buffer is ``[slots + page_size, 1, kv_lora_rank + rope]``; slot ``s`` lies in
page ``s // page_size`` at offset ``s % page_size`` (SGLang's paged allocator hands out whole pages, so a request's
positions ``j`` map to slots of page ``req_to_token[r, j - j % P] // P``). Viewing the buffer as ``[pages,
page_size, row]`` is the paged cache mla-backends reads; the page table is every ``page_size``-th column of
``req_to_token`` divided by the page size (page size 1: the slots themselves).

Host syncs: none on a GPU for decode. The host lengths come from SGLang's ``seq_lens_cpu`` (SGLang keeps a host
copy for every batch it schedules; :attr:`AttentionBackend.needs_cpu_seq_lens` stays True), and the page table is
SGLang's own, made by its allocator for this very pool, so it is trusted (``BatchMetadata.for_decode``), not read
back. An extend batch that runs absorbed (a cached prefix, below the crossover) is built with
:meth:`BatchMetadata.build`, which checks the page table on the host: one read of the table per extend batch on a
GPU (not per layer), the one place with a sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...backends.contract import Capabilities
from ...core.validation import require_int, require_tensor
from ...layer.dispatch import DispatchPolicy, PerBatchPolicy, clamp_to_backend, policy_from_table, table_from_env
from ...step.cache import LatentKVCache
from ...step.metadata import BatchMetadata

__all__ = ["page_table", "decode_metadata", "extend_metadata", "wrap_pool_buffer", "sglang_policy",
           "batch_absorbed", "expanded_attention", "ABSORBED", "EXPANDED"]

#: the two answers of :func:`batch_absorbed`'s caller, the dispatch handler (SGLang's forward methods)
ABSORBED = "absorbed"
EXPANDED = "expanded"


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
                    seq_lens_host: Sequence[int], page_size: int) -> BatchMetadata:
    """The :class:`BatchMetadata` of a decode batch (one new token per request, SGLang's order): the page table
    of :func:`page_table` and :meth:`BatchMetadata.for_decode` on the device lengths with their host copy
    (SGLang's ``seq_lens_cpu``); nothing on the device is read."""
    lens = tuple(int(v) for v in seq_lens_host)
    table = page_table(req_to_token, req_pool_indices, max(lens, default=1), page_size)
    return BatchMetadata.for_decode(table, seq_lens, lens, page_size)


def extend_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: Sequence[int],
                    extend_lens: Sequence[int], page_size: int, num_pages: int) -> BatchMetadata:
    """The :class:`BatchMetadata` of an extend batch run absorbed (``extend_lens[b]`` new tokens after
    ``prefix_lens[b]`` cached ones, SGLang's host lists), in SGLang's order (no reordering: the rows of SGLang's
    query are the metadata's tokens), page ids checked against the ``num_pages`` of the pool."""
    pre = [int(v) for v in prefix_lens]
    ext = [int(v) for v in extend_lens]
    if len(pre) != len(ext):
        raise ValueError(f"prefix_lens: got {len(pre)} entries; supported one per request ({len(ext)} extend_lens)")
    longest = max((p + e for p, e in zip(pre, ext, strict=True)), default=1)
    table = page_table(req_to_token, req_pool_indices, longest, page_size)
    return BatchMetadata.build(ext, pre, table, page_size, num_blocks=num_pages, reorder=False)


def wrap_pool_buffer(buffer: torch.Tensor, page_size: int, *, kv_lora_rank: int, model_dtype: torch.dtype,
                     previous: LatentKVCache | None = None) -> LatentKVCache:
    """SGLang's layer buffer ``[slots, 1, row]`` (``get_key_buffer(layer_id)``, fp8 already viewed as fp8) as a
    :class:`LatentKVCache` of ``[slots // page_size, page_size, row]`` sharing its memory (no copy);
    ``previous`` is returned as it is when it wraps the same memory the same way (made once per layer). fp8
    rows are read with scale 1.0: SGLang's MLA pool stores fp8 values as a plain cast."""
    require_tensor("buffer", buffer, ndim=3)
    require_int("page_size", page_size, minimum=1)
    if buffer.shape[1] != 1:
        raise ValueError(f"buffer: got shape {list(buffer.shape)}; supported [slots, 1, row] (SGLang's MLA pool: "
                         "one latent head)")
    if buffer.shape[0] % page_size:
        raise ValueError(f"buffer: got {buffer.shape[0]} slots; supported a multiple of page_size {page_size}")
    data = buffer.view(buffer.shape[0] // page_size, page_size, buffer.shape[2])
    if (previous is not None and previous.data.data_ptr() == data.data_ptr() and previous.data.shape == data.shape
            and previous.data.dtype == data.dtype):
        return previous
    return LatentKVCache.from_tensor(data, kv_lora_rank=kv_lora_rank, model_dtype=model_dtype, scale=1.0)


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


def batch_absorbed(policy: DispatchPolicy, capabilities: Capabilities, extend_lens: Sequence[int],
                   prefix_lens: Sequence[int]) -> bool:
    """mla-backends' decision for one SGLang extend batch: True (absorbed ``forward_mqa``) when ``policy``
    absorbs every request and the backend takes their query lengths, False (SGLang's expanded MHA) otherwise.
    SGLang runs one method per batch, so one expanded request makes the batch expanded."""
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities: got {type(capabilities).__name__}; supported Capabilities")
    q = [int(v) for v in extend_lens]
    c = [int(v) for v in prefix_lens]
    if len(q) != len(c):
        raise ValueError(f"prefix_lens: got {len(c)} entries; supported one per request ({len(q)} extend_lens)")
    wanted = policy.absorbed(q, c, backend_threshold=capabilities.decode_threshold)
    return all(clamp_to_backend(list(wanted), q, capabilities.query_len))


def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: Sequence[int],
                       k_starts: Sequence[int], prefix: Sequence[int], *, scale: float) -> torch.Tensor:
    """Causal attention of an expanded (MHA) extend batch, request by request, with PyTorch's SDPA.

    ``q [T, H, Dq]`` holds each request's new tokens (rows ``q_starts[b]:q_starts[b+1]``), ``k [Tk, H, Dq]`` and
    ``v [Tk, H, Dv]`` its keys and values (rows ``k_starts[b]:k_starts[b+1]``): every cached and new token when
    SGLang's one-shot MHA expanded the cached prefix (then new token ``i`` sits at position ``prefix[b] + i``),
    or only the new ones (then ``prefix`` must be all 0). The offsets are host ints (computed once per batch);
    nothing is read from the device. Returns ``[T, H, Dv]``.
    """
    require_tensor("q", q, ndim=3)
    require_tensor("k", k, ndim=3)
    require_tensor("v", v, ndim=3)
    if len(q_starts) != len(k_starts) or len(prefix) != len(q_starts) - 1:
        raise ValueError(f"q_starts/k_starts/prefix: got {len(q_starts)}, {len(k_starts)} and {len(prefix)} "
                         "entries; supported B + 1, B + 1 and B")
    if q_starts[-1] != q.shape[0] or k_starts[-1] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"q/k/v: got {q.shape[0]}, {k.shape[0]} and {v.shape[0]} rows; supported {q_starts[-1]} "
                         f"queries and {k_starts[-1]} keys and values")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for b in range(len(prefix)):
        qs, qe, ks, ke = q_starts[b], q_starts[b + 1], k_starts[b], k_starts[b + 1]
        if qe == qs:
            continue
        if ke - ks != prefix[b] + qe - qs:
            raise ValueError(f"k_starts: request {b} has {ke - ks} keys; supported its prefix {prefix[b]} + "
                             f"{qe - qs} new tokens")
        qi = torch.arange(qe - qs, device=q.device).unsqueeze(1) + prefix[b]
        mask = torch.arange(ke - ks, device=q.device).unsqueeze(0) <= qi
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), attn_mask=mask,
            scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out
