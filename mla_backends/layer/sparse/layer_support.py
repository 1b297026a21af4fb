"""What :class:`~mla_backends.layer.attention.MLAAttention` needs for DeepSeek-V3.2 sparse layers.

- :func:`layer_indexer_storage`: how a layer's cache stores the indexer keys (fp8 by default, the layer's dtype
  on request).
- :func:`build_indexer`: the layer's :class:`~.indexer.Indexer`, or None for dense layers and for layers the
  skip pattern marks as reusing the previous layer's top-k.
- :class:`SparseKVCache`: the latent cache plus the layer's indexer key cache, sharing one block table and one
  slot mapping (it *is* a :class:`~mla_backends.step.cache.LatentKVCache`, so backends take it unchanged).
- :func:`split_indexer_state_dict` / :func:`take_indexer_weights`: separate and check the ``indexer.*``
  weights of a layer's state dict (the names of DeepSeek's checkpoints and transformers'
  ``DeepseekV32Indexer``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...core.dims import MLADims
from ...core.validation import require_device, require_int
from ...loading.hf import check_hf_state_dict
from ...step.cache import LatentKVCache
from .indexer import Indexer
from .indexer_cache import IndexerKeyCache, storage_name

__all__ = ["SparseKVCache", "build_indexer", "split_indexer_state_dict", "take_indexer_weights",
           "random_indexer_state_dict", "INDEXER_PREFIX", "DEFAULT_INDEXER_STORAGE", "layer_indexer_storage"]

#: state-dict prefix of the indexer's weights inside a layer's ``self_attn``
INDEXER_PREFIX = "indexer."


def build_indexer(dims: MLADims, layer_idx: int, *, dtype: torch.dtype,
                  device: str | torch.device) -> Indexer | None:
    """Layer ``layer_idx``'s indexer; None when ``dims`` is dense or the layer reuses the previous top-k."""
    require_int("layer_idx", layer_idx, minimum=0)
    require_device("device", device)  # checked for dense layers too, which build nothing here
    if dims.indexer is None or not dims.indexer.indexes(layer_idx):
        return None
    return Indexer.from_dims(dims, dtype=dtype, device=device).requires_grad_(False)


#: what ``MLAAttention.allocate_cache(indexer_storage=...)`` takes by default: fp8 e4m3 keys with one float32
#: scale per 128 values (132 bytes a token), as vLLM and SGLang store them
DEFAULT_INDEXER_STORAGE = "fp8_e4m3"


def layer_indexer_storage(dims: MLADims, layer_dtype: torch.dtype, indexer_storage: str | torch.dtype) -> str:
    """The indexer key storage a layer's cache gets for ``indexer_storage``: ``"fp8_e4m3"`` (the default, as the
    engines store keys), ``"auto"`` (the layer's own dtype: keys exact, as transformers keeps them) or a float
    dtype (name or ``torch.dtype``). A dense layer keeps no indexer keys and takes only the default. Raises a
    ``ValueError`` naming ``indexer_storage`` (before anything is allocated)."""
    if dims.indexer is None:
        if indexer_storage != DEFAULT_INDEXER_STORAGE:
            raise ValueError(f"indexer_storage: got {indexer_storage!r} for a dense layer ({dims.name}), which keeps "
                             f"no indexer keys; supported {DEFAULT_INDEXER_STORAGE!r} (the default) here")
        return DEFAULT_INDEXER_STORAGE
    if isinstance(indexer_storage, str) and indexer_storage == "auto":
        indexer_storage = layer_dtype
    return storage_name(indexer_storage, "indexer_storage")


def split_indexer_state_dict(state_dict: Mapping[str, Any],
                             prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(attention weights, indexer weights)``; the second has ``prefix + "indexer."`` stripped."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: got {type(state_dict).__name__}; supported a mapping of tensors")
    head = prefix + INDEXER_PREFIX
    rest = {k: v for k, v in state_dict.items() if not k.startswith(head)}
    indexer = {k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)}
    return rest, indexer


def take_indexer_weights(indexer: Indexer | None, state_dict: Mapping[str, Any],
                         prefix: str = "") -> tuple[Mapping[str, Any], Callable[[], None]]:
    """Split ``state_dict`` for a layer with ``indexer``; check the indexer part but load nothing yet.

    Returns ``(attention weights, load)``: call ``load()`` once the attention weights are in, so that a bad
    dict writes nothing. With ``indexer=None`` (dense layers, layers reusing the previous top-k) the dict is
    returned unchanged (stray ``indexer.*`` keys are then reported as unexpected by the attention check).
    Raises :class:`~mla_backends.loading.hf.StateDictError` listing missing, unexpected and misshaped keys.
    """
    if indexer is None:
        return state_dict, lambda: None
    rest, part = split_indexer_state_dict(state_dict, prefix)
    head = prefix + INDEXER_PREFIX
    want = {k: tuple(v.shape) for k, v in indexer.state_dict().items()}
    found = check_hf_state_dict({head + k: v for k, v in part.items()}, want, head)

    def load() -> None:
        with torch.no_grad():
            indexer.load_state_dict(found)

    return rest, load


def random_indexer_state_dict(dims: MLADims, *, seed: int = 0, std: float = 0.02,
                              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random ``indexer.*`` weights for ``dims`` (normal(0, std), LayerNorm weight near 1), for demos."""
    if not isinstance(dims, MLADims) or dims.indexer is None or dims.q_lora_rank is None:
        raise ValueError(f"dims: got {dims!r}; supported a sparse (V3.2) MLADims with a q_lora_rank")
    ix, hid = dims.indexer, dims.hidden_size
    shapes = {"wq_b.weight": (ix.n_heads * ix.head_dim, dims.q_lora_rank), "wk.weight": (ix.head_dim, hid),
              "k_norm.weight": (ix.head_dim,), "k_norm.bias": (ix.head_dim,),
              "weights_proj.weight": (ix.n_heads, hid)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = std * torch.randn(shape, generator=g, dtype=torch.float64)
        if name == "k_norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        out[INDEXER_PREFIX + name] = t.to(dtype)
    return out


class SparseKVCache(LatentKVCache):
    """A layer's latent cache together with its indexer key cache (same pages, same slots).

    ``write`` stores latent rows as usual; the indexer writes its keys into :attr:`indexer_cache` in the same
    step with the same ``slot_mapping``. :attr:`indexer_cache` is None on layers that reuse the previous
    layer's top-k (they keep no indexer keys).

    Attributes:
        indexer_cache: :class:`IndexerKeyCache` ``[num_blocks, block_size, 132]`` uint8, or None.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                 *, indexer_head_dim: int | None = 128, indexer_storage: str | torch.dtype = "fp8_e4m3",
                 indexer_scale_fmt: str | None = None, **kwargs: Any) -> None:
        super().__init__(num_blocks, block_size, kv_lora_rank, qk_rope_head_dim, **kwargs)
        self.indexer_cache: IndexerKeyCache | None = None
        if indexer_head_dim is not None:
            self.indexer_cache = IndexerKeyCache.like(self, indexer_head_dim, storage=indexer_storage,
                                                      scale_fmt=indexer_scale_fmt)

    @classmethod
    def allocate(cls, dims: MLADims, num_blocks: int, block_size: int,  # type: ignore[override]
                 kv_cache_dtype: str | torch.dtype = "auto", *,
                 model_dtype: str | torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", scale: float = 1.0, layer_idx: int = 0,
                 indexer_storage: str | torch.dtype = "fp8_e4m3",
                 indexer_scale_fmt: str | None = None) -> SparseKVCache:
        """Both caches of layer ``layer_idx``; no indexer cache when that layer skips indexing."""
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
        if dims.indexer is None:
            raise ValueError(f"dims: got {dims.name!r} without an indexer; supported a sparse (V3.2) MLADims")
        require_int("layer_idx", layer_idx, minimum=0)
        head_dim = dims.indexer.head_dim if dims.indexer.indexes(layer_idx) else None
        return cls(num_blocks, block_size, dims.kv_lora_rank, dims.qk_rope_head_dim,
                   indexer_head_dim=head_dim, indexer_storage=indexer_storage,
                   indexer_scale_fmt=indexer_scale_fmt, kv_cache_dtype=kv_cache_dtype,
                   model_dtype=model_dtype, device=device, scale=scale)

    @property
    def indexer_bytes_per_token(self) -> int:
        """Indexer key bytes per token of this layer: 132 (V3.2, fp8), 0 on a layer that skips indexing."""
        return 0 if self.indexer_cache is None else self.indexer_cache.bytes_per_token

    def __repr__(self) -> str:
        return super().__repr__().replace("LatentKVCache(", "SparseKVCache(", 1)[:-1] + \
            f", indexer={self.indexer_cache!r})"
