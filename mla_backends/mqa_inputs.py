"""Validation of ``forward_mqa`` arguments, shared by every backend (run before any kernel launches)."""

from __future__ import annotations

import torch

from .cache import LatentKVCache
from .metadata import BatchMetadata
from .validation import require_on_device, require_tensor

__all__ = ["check_mqa_inputs", "QUERY_DTYPES"]

QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_mqa_inputs(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    scale: float,
    topk_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    check_values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the inputs of ``forward_mqa`` disagree.

    ``check_values=False`` skips the checks that read device tensors (block ids in range, top-k in window),
    which synchronise; backends pass it while a CUDA graph is being captured. The block-id check runs at
    most once per (metadata, cache size): every layer of a step shares one ``BatchMetadata``.
    """
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache")
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    T = meta.num_tokens
    require_tensor("q_latent", q_latent, shape=(T, None, cache.kv_lora_rank), dtypes=QUERY_DTYPES)
    H = q_latent.shape[1]
    require_tensor("q_rope", q_rope, shape=(T, H, cache.qk_rope_head_dim), dtypes=(q_latent.dtype,))
    if H < 1:
        raise ValueError(f"q_latent: got {H} heads; supported >= 1")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: got {scale!r}; supported a positive float (the unabsorbed softmax scale)")
    require_on_device(cache.device, q_latent=q_latent, q_rope=q_rope, **{"meta.block_table": meta.block_table})
    if meta.block_size != cache.block_size:
        raise ValueError(f"meta.block_size: got {meta.block_size}; supported the cache's {cache.block_size}")
    if meta.num_blocks is not None and meta.num_blocks > cache.num_blocks:
        raise ValueError(f"meta.num_blocks: got {meta.num_blocks}; supported <= the cache's {cache.num_blocks}")
    if check_values:
        _check_block_ids(meta, cache)
    if topk_indices is not None:
        require_tensor("topk_indices", topk_indices, shape=(T, None), dtypes=(torch.int32, torch.int64))
        if topk_indices.shape[1] < 1:
            raise ValueError("topk_indices: got width 0; supported >= 1 (pad with -1)")
        if check_values and topk_indices.numel():
            limit = meta.token_positions.to(topk_indices.device)[:, None]
            bad = (topk_indices < -1) | (topk_indices > limit)
            if bool(bad.any()):
                t = int(bad.any(dim=1).nonzero()[0])
                raise ValueError(
                    f"topk_indices: token {t} selects position(s) outside [0, {int(limit[t])}] (its causal "
                    f"window); supported -1 (padding) or a visible position"
                )
    if out is not None:
        require_tensor("out", out, shape=(T, H, cache.kv_lora_rank), dtypes=(q_latent.dtype,))
    if lse_out is not None:
        require_tensor("lse_out", lse_out, shape=(T, H), dtypes=(torch.float32,))


def _check_block_ids(meta: BatchMetadata, cache: LatentKVCache) -> None:
    """The block ids each sequence uses must lie inside ``cache``.

    Free when ``BatchMetadata.build`` already checked them against ``num_blocks`` (host side); otherwise the
    device check (one sync) runs once and its verdict is kept in ``meta.plans``, so later layers of the same
    step skip it. ``meta.block_table`` must therefore not be edited in place after the step has started.
    """
    if meta.num_blocks is not None or not meta.num_requests or not meta.max_seq_len:
        return  # num_blocks <= cache.num_blocks was checked above; build() checked the ids against it
    key = ("_block_ids_within", cache.num_blocks)
    if meta.plans.get(key):
        return
    used_pages = [-(-s // meta.block_size) for s in meta.seq_lens_list]
    width = max(used_pages)
    bt = meta.block_table[:, :width]
    mask = torch.arange(width, device=bt.device)[None, :] < torch.tensor(used_pages, device=bt.device)[:, None]
    ids = bt[mask]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.num_blocks):
        raise ValueError(f"meta.block_table: got block ids in [{int(ids.min())}, {int(ids.max())}]; "
                         f"supported [0, {cache.num_blocks - 1}] for this cache")
    meta.plans[key] = True
