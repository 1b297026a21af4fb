"""The paged indexer key cache of DeepSeek-V3.2 sparse attention (one per *indexing* layer).

Every cached token holds one ``index_head_dim``-wide indexer key (128 for V3.2), stored as fp8 e4m3 values
with one float32 scale per 128-value block. For V3.2 that is ``128 + 4 = 132`` bytes per token per layer, kept
as a ``uint8`` tensor ``[num_blocks, block_size, 132]``. Row layout (bytes)::

    [ 0 .. 127 ]  fp8 e4m3 values  (value_i = round_to_fp8(k_i / scale_b))
    [ 128 .. 131]  float32 scale of block 0 (native byte order)

(a wider head adds one more 128-value block and one more 4-byte scale per 128 values, scales after values).
The scale of a block is ``max(|k|) / 448`` over its 128 values (448 is the largest finite e4m3 value), or that
rounded up to a power of two with ``scale_fmt="ue8m0"``. Reads return ``values * scale`` in float32.

The cache is paged exactly like the latent cache (:class:`~mla_backends.step.cache.LatentKVCache`): the same block
ids, the same ``block_size``, the same slot mapping, written by the same step. A float storage dtype
(``float32``/``float64``/``bfloat16``) is accepted for references and tests; it stores keys as they are.
"""

from __future__ import annotations

import torch

from ...core.dims import MLADims
from ...core.dtypes import FP8_E4M3_MAX, canonical_kv_cache_dtype, kv_cache_torch_dtype
from ...core.validation import require_device, require_int, require_on_device, require_tensor
from ...step.cache import LatentKVCache, PagedRows, SlotSource

__all__ = [
    "IndexerKeyCache",
    "QUANT_BLOCK",
    "FP8_E4M3_MAX",
    "indexer_bytes_per_token",
    "quantize_fp8_blockwise",
    "dequantize_fp8_blockwise",
    "pack_rows",
    "unpack_rows",
    "storage_name",
]

#: values per quantisation block (one float32 scale each)
QUANT_BLOCK = 128
#: smallest block maximum used to form a scale (all-zero blocks get a tiny, non-zero scale)
_AMAX_FLOOR = 1e-10
_SCALE_FMTS = (None, "ue8m0")
_STORAGE_NAMES = ("fp8_e4m3", "float32", "float64", "bfloat16", "float16")


def indexer_bytes_per_token(head_dim: int = 128) -> int:
    """Bytes one token's fp8 indexer key takes per layer: ``head_dim + 4 * head_dim / 128`` (132 for 128)."""
    require_int("head_dim", head_dim, minimum=QUANT_BLOCK)
    if head_dim % QUANT_BLOCK:
        raise ValueError(f"head_dim: got {head_dim}; supported a multiple of {QUANT_BLOCK} (one scale each)")
    return head_dim + head_dim // QUANT_BLOCK * 4


def _check_scale_fmt(scale_fmt: str | None) -> None:
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"scale_fmt: got {scale_fmt!r}; supported None (amax/448) or 'ue8m0' (power of two)")


def quantize_fp8_blockwise(x: torch.Tensor,
                           scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` (D a multiple of 128) to fp8 e4m3 with one float32 scale per 128 values.

    Returns ``(values [..., D] float8_e4m3fn, scales [..., D // 128] float32)`` with
    ``values * scale ~= x`` (relative error <= 2**-4 per value, e4m3's half ulp).
    """
    require_tensor("x", x)
    if not x.is_floating_point():
        raise TypeError(f"x: got dtype {x.dtype}; supported a floating-point tensor")
    if x.dim() < 1 or x.shape[-1] % QUANT_BLOCK or x.shape[-1] == 0:
        raise ValueError(f"x: got shape {list(x.shape)}; supported [..., D], D a positive multiple of 128")
    _check_scale_fmt(scale_fmt)
    D = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], D // QUANT_BLOCK, QUANT_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(_AMAX_FLOOR)
    scale = amax / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize_fp8_blockwise(values: torch.Tensor, scales: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blockwise`: ``values [..., D]`` fp8 and ``scales [..., D // 128]``
    -> ``values * scale`` as ``[..., D]`` in ``dtype``."""
    require_tensor("values", values, dtypes=(torch.float8_e4m3fn,))
    D = values.shape[-1]
    require_tensor("scales", scales, shape=(*values.shape[:-1], D // QUANT_BLOCK))
    blocks = values.to(torch.float32).reshape(*values.shape[:-1], D // QUANT_BLOCK, QUANT_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(values.shape).to(dtype)


def pack_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values [..., D]`` fp8 + ``scales [..., D // 128]`` float32 -> ``uint8 [..., D + 4 * D // 128]``."""
    v = values.contiguous().view(torch.uint8)
    s = scales.to(torch.float32).contiguous().view(torch.uint8)
    return torch.cat([v, s], dim=-1)


def unpack_rows(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [..., head_dim + 4 * head_dim // 128]`` -> ``(values [..., head_dim], scales [..., nb])``."""
    rows = require_tensor("rows", rows, dtypes=(torch.uint8,))
    width = indexer_bytes_per_token(head_dim)
    if rows.shape[-1] != width:
        raise ValueError(f"rows: got last dim {rows.shape[-1]}; supported {width} for head_dim={head_dim}")
    values = rows[..., :head_dim].contiguous().view(torch.float8_e4m3fn)
    scales = rows[..., head_dim:].contiguous().view(torch.float32)
    return values, scales


class IndexerKeyCache(PagedRows):
    """Paged cache of indexer keys, one ``head_dim``-wide key per token, paged like the latent cache.

    Attributes:
        data: ``uint8 [num_blocks, block_size, head_dim + 4 * head_dim // 128]`` (fp8 storage, 132 wide for
            V3.2), or ``[num_blocks, block_size, head_dim]`` of a float dtype (reference storage).
        head_dim: indexer key width (128 for V3.2).
        storage: ``"fp8_e4m3"`` or a float dtype name.
        scale_fmt: ``None`` (scale = amax / 448) or ``"ue8m0"`` (rounded up to a power of two).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        head_dim: int = 128,
        *,
        storage: str | torch.dtype = "fp8_e4m3",
        scale_fmt: str | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        require_int("num_blocks", num_blocks, minimum=1)
        require_int("block_size", block_size, minimum=1)
        require_int("head_dim", head_dim, minimum=1)
        device = require_device("device", device)
        _check_scale_fmt(scale_fmt)
        self.storage = storage_name(storage)
        self.num_blocks, self.block_size, self.head_dim = num_blocks, block_size, head_dim
        self.scale_fmt = scale_fmt
        # one sink row after the last slot: a write of skipped (-1) slots keeps static shapes (no mask, no sync)
        if self.storage == "fp8_e4m3":
            self.data = self._allocate_with_sink(indexer_bytes_per_token(head_dim), torch.uint8, device)
        else:
            self.data = self._allocate_with_sink(head_dim, kv_cache_torch_dtype(self.storage, torch.float32), device)

    @classmethod
    def allocate(
        cls,
        dims: MLADims,
        num_blocks: int,
        block_size: int,
        *,
        storage: str | torch.dtype = "fp8_e4m3",
        scale_fmt: str | None = None,
        device: str | torch.device = "cpu",
    ) -> IndexerKeyCache:
        """A zeroed cache for ``dims.indexer`` (``dims`` must describe a sparse, V3.2-style layer)."""
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
        if dims.indexer is None:
            raise ValueError(f"dims: got {dims.name!r} without an indexer; supported a sparse (V3.2) MLADims")
        return cls(num_blocks, block_size, dims.indexer.head_dim, storage=storage, scale_fmt=scale_fmt,
                   device=device)

    @classmethod
    def like(cls, cache: LatentKVCache, head_dim: int = 128, *, storage: str | torch.dtype = "fp8_e4m3",
             scale_fmt: str | None = None) -> IndexerKeyCache:
        """A cache paged like ``cache`` (same pages and device): one block table serves both."""
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache")
        return cls(cache.num_blocks, cache.block_size, head_dim, storage=storage, scale_fmt=scale_fmt,
                   device=cache.device)

    # ---- properties (row_width / bytes_per_token: 132 for fp8 storage at head_dim=128) ------------------
    @property
    def is_fp8(self) -> bool:
        return self.storage == "fp8_e4m3"

    def __repr__(self) -> str:
        return (f"IndexerKeyCache(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"head_dim={self.head_dim}, storage={self.storage}, bytes_per_token={self.bytes_per_token}, "
                f"device={self.device})")

    # ---- write / read ----------------------------------------------------------------------------------
    def quantize(self, k: torch.Tensor) -> torch.Tensor:
        """``k [..., head_dim]`` -> rows ``[..., row_width]`` (packed fp8 + scales, or a cast)."""
        if not self.is_fp8:
            return k.to(self.data.dtype)
        return pack_rows(*quantize_fp8_blockwise(k, self.scale_fmt))

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows ``[..., row_width]`` -> keys ``[..., head_dim]`` in ``dtype`` (default float32)."""
        dtype = dtype or torch.float32
        if not self.is_fp8:
            return rows.to(dtype)
        return dequantize_fp8_blockwise(*unpack_rows(rows, self.head_dim), dtype=dtype)

    def write(self, k: torch.Tensor, slot_mapping: torch.Tensor | SlotSource) -> None:
        """Store keys ``k [T, head_dim]`` at ``slot_mapping [T]`` (the latent cache's slots; ``-1`` skips). A
        :class:`~mla_backends.step.cache.SlotSource` (a step's plan) is trusted, as in ``LatentKVCache.write``;
        a raw tensor is range-checked (one read)."""
        trusted = isinstance(slot_mapping, SlotSource)
        if trusted:
            slot_mapping = slot_mapping.slots_for(self)
        require_tensor("k", k, shape=(None, self.head_dim))
        if not k.is_floating_point():
            raise TypeError(f"k: got dtype {k.dtype}; supported floating point")
        require_tensor("slot_mapping", slot_mapping, shape=(k.shape[0],), dtypes=(torch.int32, torch.int64))
        require_on_device(self.device, k=k, slot_mapping=slot_mapping)
        self._write_rows(k, slot_mapping, trusted=trusted)


def storage_name(storage: str | torch.dtype, argument: str = "storage") -> str:
    """Canonical storage name (the cache-dtype aliases of :func:`canonical_kv_cache_dtype`); fp8 means e4m3.
    Anything else is a ``ValueError`` naming ``argument``."""
    try:
        name = canonical_kv_cache_dtype(storage)
    except (TypeError, ValueError):
        name = None
    if name not in _STORAGE_NAMES:
        raise ValueError(f"{argument}: got {storage!r}; supported fp8_e4m3 (132 bytes/token, the V3.2 layout), "
                         + ", ".join(_STORAGE_NAMES[1:]))
    return name
