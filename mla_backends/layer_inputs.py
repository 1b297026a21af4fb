"""The checks :class:`~mla_backends.layer.MLAAttention` runs on one step's inputs before any projection."""

from __future__ import annotations

import torch

from .cache import LatentKVCache
from .dims import MLADims
from .metadata import BatchMetadata
from .validation import require_tensor

__all__ = ["check_step_inputs"]


def check_step_inputs(dims: MLADims, dtype: torch.dtype, device: torch.device, hidden_states: torch.Tensor,
                      positions: torch.Tensor | None, cache: LatentKVCache, meta: BatchMetadata,
                      topk_indices: torch.Tensor | None, *, reuses_topk: bool, layer_idx: int) -> None:
    """Types, shapes, dtypes and devices of a layer step: ``hidden_states [T, hidden_size]`` in ``dtype``,
    ``positions [T]`` int, ``topk_indices [T, K]`` on sparse layers only (required where the layer reuses the
    previous layer's top-k), a cache of the layer's row widths and page size, everything on ``device``."""
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache (layer.allocate_cache)")
    T = meta.num_tokens
    require_tensor("hidden_states", hidden_states, shape=(T, dims.hidden_size), dtypes=(dtype,))
    if positions is not None:
        require_tensor("positions", positions, shape=(T,), dtypes=(torch.int32, torch.int64))
    if topk_indices is not None:
        if dims.indexer is None:
            raise ValueError("topk_indices: got a tensor on a dense layer; supported None")
        require_tensor("topk_indices", topk_indices, shape=(T, None), dtypes=(torch.int32, torch.int64))
    elif dims.indexer is not None and reuses_topk:
        raise ValueError(f"topk_indices: got None on layer {layer_idx}, which reuses the previous "
                         "layer's top-k; supported that layer's last_topk_indices")
    if (cache.kv_lora_rank, cache.qk_rope_head_dim) != (dims.kv_lora_rank, dims.qk_rope_head_dim):
        raise ValueError(f"cache: got rows of {cache.kv_lora_rank}+{cache.qk_rope_head_dim}; supported "
                         f"{dims.kv_lora_rank}+{dims.qk_rope_head_dim} (this layer's dims)")
    if meta.block_size != cache.block_size:
        raise ValueError(f"meta.block_size: got {meta.block_size}; supported the cache's {cache.block_size}")
    for name, dev in (("hidden_states", hidden_states.device), ("cache", cache.device), ("meta", meta.device)):
        if dev != device:
            raise ValueError(f"{name}: got device {dev}; supported the layer's device {device}")
