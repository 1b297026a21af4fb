"""The paged stores of one DeepSeek-V4 layer: :class:`V4LayerCache`.

==================  =================================  ============================  ============================
store               row (per token or entry)            addressed by                  kinds
==================  =================================  ============================  ============================
``window``          ``head_dim`` (512) values           token position, step table    every layer
``compressed``      ``head_dim`` values                 entry number, derived table   CSA, HCA
``state``           ``kv | gate`` (``2 c head_dim``)    token position, step table    CSA (``c`` = 2), HCA (1)
``indexer_keys``    ``index_head_dim`` key (132 B fp8)  entry number, derived table   CSA
``indexer_state``   ``kv | gate`` (``4 index_head_dim``) token position, step table   CSA
==================  =================================  ============================  ============================

Every store has the same ``num_blocks`` page ids as the step's block table; a compressed store's page holds
``entries_per_page = max(1, block_size // ratio)`` entries (:mod:`mla_backends.step.v4`). The window and
compressed rows are :class:`~mla_backends.step.cache.LatentKVCache` s of width ``head_dim`` and no separate rope
slice, which is what ``forward_mqa`` reads; how a row is stored is the :class:`RowFormat`'s business (plain
model-dtype rows here; DeepSeek's 584-byte fp8 records plug in as another format). The compressor state keeps
the projected ``kv`` and biased ``gate`` of each token in float32 (float64 for float64 models), for the tokens of
unfinished windows (and, for CSA, the window before).

Which positions must stay cached: a step reads window rows ``p - sliding_window + 1 .. p`` and state rows back
to ``(context_len // ratio) * ratio - (c - 1) * ratio``, so a page may be recycled once every position on it is
older than ``seq_len - max(sliding_window, c * ratio)`` of its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.dtypes import accumulate_dtype, dtype_name, kv_cache_torch_dtype
from ...core.v4dims import CSA, SLIDING, V4Dims
from ...core.validation import require_device, require_int, require_on_device, require_tensor
from ...step.cache import LatentKVCache, PagedRows
from ...step.v4 import check_page_ratio, entries_per_page
from ..sparse.indexer_cache import IndexerKeyCache

__all__ = ["V4LayerCache", "CompressorStateCache", "RowFormat", "PLAIN_ROWS"]


@dataclass(frozen=True)
class RowFormat:
    """How window and compressed rows are stored: here a plain cache dtype (``auto``: the model dtype, or an fp8
    per-tensor format). DeepSeek's 584-byte fp8 records (448 fp8 values with a power-of-two scale per 64, 64 bf16
    rotary values) are another format: it allocates its own :class:`LatentKVCache` subclass (quantising in
    ``quantize``, reading back in ``dequantize``) and states its bytes per row."""

    kv_cache_dtype: str = "auto"

    def allocate(self, num_blocks: int, block_size: int, width: int, *, model_dtype: torch.dtype,
                 device: torch.device) -> LatentKVCache:
        """A zeroed store of ``num_blocks`` pages of ``block_size`` rows of ``width`` values."""
        return LatentKVCache(num_blocks, block_size, width, 0, kv_cache_dtype=self.kv_cache_dtype,
                             model_dtype=model_dtype, device=device)

    def bytes_per_row(self, width: int, model_dtype: torch.dtype) -> int:
        """Bytes one row of ``width`` values takes."""
        return width * kv_cache_torch_dtype(self.kv_cache_dtype, model_dtype).itemsize


#: model-dtype rows
PLAIN_ROWS = RowFormat()


class CompressorStateCache(PagedRows):
    """A compressor's state: per token position, its projected ``kv [c * d]`` and position-biased ``gate
    [c * d]`` (``[num_blocks, block_size, 2 * c * d]``, float32, or float64 for float64 models), with a sink row
    for skipped writes."""

    def __init__(self, num_blocks: int, block_size: int, width: int, *, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        require_int("num_blocks", num_blocks, minimum=1)
        require_int("block_size", block_size, minimum=1)
        require_int("width", width, minimum=2)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = self._allocate_with_sink(width, dtype, require_device("device", device))

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.data.dtype)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return stored if dtype is None else stored.to(dtype)

    def write(self, rows: torch.Tensor, slot_mapping: torch.Tensor, *, trusted: bool = False) -> None:
        """Store ``rows [T, width]`` at ``slot_mapping [T]`` (``-1`` skips; ``trusted``: slots from metadata
        ``BatchMetadata.build`` validated)."""
        require_tensor("rows", rows, shape=(None, self.row_width))
        require_tensor("slot_mapping", slot_mapping, shape=(rows.shape[0],), dtypes=(torch.int32, torch.int64))
        require_on_device(self.device, rows=rows, slot_mapping=slot_mapping)
        self._write_rows(rows, slot_mapping, trusted=trusted)

    def __repr__(self) -> str:
        return (f"CompressorStateCache(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"row={self.row_width}, dtype={dtype_name(self.data.dtype)})")


class V4LayerCache:
    """Every store of one V4 layer (module docstring); ``None`` where the layer's kind has none.

    Attributes:
        window, compressed: :class:`LatentKVCache` s (``[num_blocks, block_size, head_dim]`` and
            ``[num_blocks, entries_per_page, head_dim]``).
        state, indexer_state: :class:`CompressorStateCache`. indexer_keys: an
            :class:`~mla_backends.layer.sparse.indexer_cache.IndexerKeyCache` with ``entries_per_page`` rows a page.
        kind, ratio, num_blocks, block_size.
    """

    def __init__(self, *, kind: str, ratio: int, window: LatentKVCache, compressed: LatentKVCache | None,
                 state: CompressorStateCache | None, indexer_keys: IndexerKeyCache | None,
                 indexer_state: CompressorStateCache | None) -> None:
        self.kind, self.ratio = kind, ratio
        self.window, self.compressed, self.state = window, compressed, state
        self.indexer_keys, self.indexer_state = indexer_keys, indexer_state

    @classmethod
    def allocate(cls, dims: V4Dims, layer_idx: int, num_blocks: int, block_size: int, *,
                 model_dtype: torch.dtype, device: str | torch.device = "cpu", row_format: RowFormat = PLAIN_ROWS,
                 indexer_storage: str | torch.dtype = "fp8_e4m3", indexer_scale_fmt: str | None = "ue8m0",
                 ) -> V4LayerCache:
        """Zeroed stores of layer ``layer_idx`` with ``num_blocks`` pages of ``block_size`` tokens.

        ``row_format`` stores the window and compressed rows; ``indexer_storage`` the CSA indexer keys (fp8 with
        a power-of-two scale per 128 values, 132 bytes, as vLLM; or ``float32``/``float64``/``bfloat16``).
        """
        if not isinstance(dims, V4Dims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported V4Dims")
        require_int("num_blocks", num_blocks, minimum=1)
        require_int("block_size", block_size, minimum=1)
        if not isinstance(row_format, RowFormat):
            raise TypeError(f"row_format: got {type(row_format).__name__}; supported a RowFormat")
        dev = require_device("device", device)
        kind, ratio = dims.kind(layer_idx), dims.ratio(layer_idx)
        D = dims.head_dim
        window = row_format.allocate(num_blocks, block_size, D, model_dtype=model_dtype, device=dev)
        if kind == SLIDING:
            return cls(kind=kind, ratio=0, window=window, compressed=None, state=None, indexer_keys=None,
                       indexer_state=None)
        check_page_ratio(block_size, ratio)
        epp = entries_per_page(block_size, ratio)
        c = 2 if kind == CSA else 1
        sdt = accumulate_dtype(model_dtype)
        compressed = row_format.allocate(num_blocks, epp, D, model_dtype=model_dtype, device=dev)
        state = CompressorStateCache(num_blocks, block_size, 2 * c * D, dtype=sdt, device=dev)
        keys = istate = None
        if kind == CSA:
            Di = dims.index_head_dim
            keys = IndexerKeyCache(num_blocks, epp, Di, storage=indexer_storage, scale_fmt=indexer_scale_fmt,
                                   device=dev)
            istate = CompressorStateCache(num_blocks, block_size, 4 * Di, dtype=sdt, device=dev)
        return cls(kind=kind, ratio=ratio, window=window, compressed=compressed, state=state, indexer_keys=keys,
                   indexer_state=istate)

    # ---- what engines and wrappers read ---------------------------------------------------------------
    @property
    def stores(self) -> dict[str, Any]:
        """``{name: store}`` of the stores this layer has."""
        names = ("window", "compressed", "state", "indexer_keys", "indexer_state")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def num_blocks(self) -> int:
        return self.window.num_blocks

    @property
    def block_size(self) -> int:
        return self.window.block_size

    @property
    def device(self) -> torch.device:
        return self.window.device

    @property
    def kv_cache_dtype(self) -> str:
        return self.window.kv_cache_dtype

    def bytes_per_page(self) -> dict[str, int]:
        """Bytes one page takes in each store (``rows a page x bytes a row``)."""
        return {n: s.block_size * s.bytes_per_token for n, s in self.stores.items()}

    def copy_from(self, old: V4LayerCache) -> None:
        """Copy every store of ``old`` (fewer or as many pages, same layout) into this one's first pages (a pool
        grown by reallocation)."""
        if set(old.stores) != set(self.stores) or old.block_size != self.block_size:
            raise ValueError("old: got a cache of another layout; supported the same layer's smaller cache")
        for name, store in self.stores.items():
            src = old.stores[name]
            store.data[: src.num_blocks].copy_(src.data)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={s!r}" for n, s in self.stores.items())
        return f"V4LayerCache(kind={self.kind}, ratio={self.ratio}, {inner})"
