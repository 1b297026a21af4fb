"""The paged latent KV cache: one ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` tensor.

Each cached token is one 576-wide row (DeepSeek-V3): the RMS-normalised latent ``kv_c`` (512) followed by the
roped ``k_pe`` (64). Per-head keys and values are never stored. fp8 caches hold ``value / scale`` and are read
back as ``stored * scale`` (one per-tensor scale, float32).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..core.dims import MLADims
from ..core.dtypes import (
    FP8_CACHE_DTYPES,
    canonical_kv_cache_dtype,
    dtype_name,
    kv_cache_torch_dtype,
    parse_model_dtype,
)
from ..core.validation import require_device, require_int, require_on_device, require_scale, require_tensor

#: storage dtypes a wrapped engine cache may have (LatentKVCache.from_tensor)
_STORAGE_TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
                         torch.float8_e5m2)

#: the layouts LatentKVCache.from_tensor wraps, as its errors state them
_LAYOUTS = ("rows contiguous in memory (last stride 1) and block / slot strides under which no two slots "
            "overlap: a contiguous tensor, or one whose blocks are spaced, padded or permuted")

__all__ = ["LatentKVCache", "PagedRows", "SlotSource", "check_slot_mapping", "block_table_slots",
           "position_slots", "duplicate_slot", "overlapping_layout"]


class SlotSource(ABC):
    """Where a step's new rows go, already validated when the step was described: what ``write`` trusts.

    :class:`~mla_backends.step.metadata.BatchMetadata` (``build`` checked every slot: in range, one writer each) and
    the step's :class:`~mla_backends.step.plan.StepPlan` are slot sources; a raw ``[T]`` tensor is not, and its
    values are range-checked on every write.
    """

    @abstractmethod
    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """``[T]`` int64 slots of the new tokens (``-1``: skip), after a host-side check that ``cache`` holds
        the step (page size, block ids); no device read."""


def duplicate_slot(slots: torch.Tensor) -> tuple[int, int] | None:
    """``(first, second)`` indices of two entries of a host ``slots [T]`` tensor naming the same slot (``-1``
    entries, skipped tokens, never clash), or None when every slot is written once. Host tensors only."""
    if slots.numel() < 2:
        return None
    if slots.numel() <= 1 << 16:  # a Python set is the fastest way to say "all distinct" at decode sizes
        values = slots.tolist()
        kept = [v for v in values if v >= 0]
        if len(set(kept)) == len(kept):
            return None
    ordered, idx = torch.sort(slots, stable=True)
    same = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    if not bool(same.any()):
        return None
    k = int(same.to(torch.uint8).argmax())
    return int(idx[k]), int(idx[k + 1])


def check_slot_mapping(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """``slot_mapping [T]`` values must be ``-1`` (skip the token) or a slot in ``[0, num_blocks * block_size)``.

    Reads the tensor's min/max (a host sync on GPU tensors); an empty mapping passes.
    """
    if slot_mapping.numel():
        num_slots = num_blocks * block_size
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping: got values in [{lo}, {hi}]; supported -1 (skip) or "
                             f"[0, {num_slots - 1}] for {num_blocks} blocks of {block_size}")


def overlapping_layout(shape: tuple[int, ...] | torch.Size, strides: tuple[int, ...]) -> bool:
    """True unless the layout provably gives every index of a tensor with this ``shape`` and these element
    ``strides`` its own memory: an ``expand``ed view, a zero stride and overlapping ``as_strided`` windows are
    caught. Dimensions are taken in increasing stride order and each must step past everything the smaller
    ones span (a sufficient rule: every layout that slicing, padding or permuting a contiguous buffer makes
    passes; a few exotic interleavings that do not overlap are refused too)."""
    span = 0  # the largest offset the dimensions seen so far reach
    for stride, size in sorted((st, n) for st, n in zip(strides, shape, strict=True) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def position_slots(block_table: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """Flat int64 slots of ``positions`` of ``requests`` (same shape, any shape; valid positions only).

    ``slot = block_table[request, position // block_size] * block_size + position % block_size``.
    """
    return block_table.long()[requests, positions // block_size] * block_size + positions % block_size


def block_table_slots(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat slots ``[length]`` int64 of positions ``0..length-1`` of one sequence, from its block-table row."""
    require_int("length", length, minimum=0)
    pos = torch.arange(length, device=block_table_row.device)
    return position_slots(block_table_row[None], torch.zeros_like(pos), pos, block_size)


def _flat_view(data: torch.Tensor, width: int) -> torch.Tensor | None:
    """``data [blocks, block_size, width]`` viewed as ``[blocks * block_size, width]`` (no copy), or None."""
    try:
        return data.view(-1, width)
    except RuntimeError:  # blocks not packed one after another: address them by (block, offset)
        return None


def _block_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots // block_size, slots % block_size)``: the 2-D index of flat slots into ``data``."""
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


class PagedRows:
    """What every paged per-token store shares: ``data [num_blocks, block_size, row_width]``, one row per token
    slot (``slot = block * block_size + offset``), rows written by slot and read back dequantised.

    Subclasses set ``num_blocks``, ``block_size`` and ``data`` and define ``quantize(values) -> rows`` and
    ``dequantize(rows, dtype) -> values`` (they may change the last dimension, e.g. packed fp8 + scales).
    """

    num_blocks: int
    block_size: int
    data: torch.Tensor

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def row_width(self) -> int:
        """Last dimension of :attr:`data` (576 for the DeepSeek latent cache, 132 for fp8 indexer keys)."""
        return self.data.shape[-1]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer: ``row_width * element size`` (1,152 for the V3 bf16 latent)."""
        return self.row_width * self.data.element_size()

    def rows_with_sink(self) -> torch.Tensor | None:
        """``[num_slots + 1, row_width]``: every slot's row, then one *sink* row that skipped tokens (slot
        ``-1``) are written to, so a write keeps static shapes (no mask, no sync). None when this store was
        allocated without a sink, or its ``data`` was replaced by a tensor that is not a view of it."""
        store = getattr(self, "_sink_store", None)
        if (store is None or self.data.data_ptr() != store.data_ptr() or not self.data.is_contiguous()
                or self.data.numel() != self.num_slots * self.row_width):
            return None
        return store

    def _allocate_with_sink(self, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
        """Zeroed ``data [num_blocks, block_size, width]``, the leading view of a store one row longer."""
        self._sink_store = torch.zeros(self.num_blocks * self.block_size + 1, width, dtype=dtype, device=device)
        return self._sink_store[:-1].view(self.num_blocks, self.block_size, width)

    def flat_rows(self) -> torch.Tensor | None:
        """:attr:`data` as ``[num_slots, row_width]`` without a copy (slot ``s`` is row ``s``), or None when its
        layout cannot be seen that way (spaced, padded or permuted blocks of a wrapped engine tensor)."""
        return _flat_view(self.data, self.row_width)

    def stored_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored (not dequantised) rows ``[*slots.shape, row_width]`` at flat int64 ``slots`` (all valid),
        for every layout :attr:`data` may have: one index into :meth:`flat_rows` when there is one, else a
        ``(block, offset)`` index."""
        flat = self.flat_rows()
        if flat is not None:
            return flat[slots]
        return self.data[_block_offset(slots, self.block_size)]

    def _write_rows(self, values: torch.Tensor, slot_mapping: torch.Tensor, *, trusted: bool = False) -> None:
        """Store ``quantize(values [T, ...])`` at ``slot_mapping [T]`` (``-1`` skips); callers validated shapes
        and devices. ``trusted``: the slots come from metadata ``BatchMetadata.build`` validated (no check
        here); otherwise they are range-checked (a host sync on GPU tensors). With a sink row
        (:meth:`rows_with_sink`) the write is one ``index_copy_`` of every row, skipped ones into the sink."""
        if not trusted:
            check_slot_mapping(slot_mapping, self.num_blocks, self.block_size)
        store = self.rows_with_sink()
        if store is not None:
            slots = slot_mapping.long()
            target = torch.where(slots >= 0, slots, torch.full_like(slots, self.num_slots))
            rows = self.quantize(values)
            if rows.element_size() == 1:  # fp8: copy the bytes (index_copy_ has no fp8 kernel on every device)
                store, rows = store.view(torch.uint8), rows.view(torch.uint8)
            store.index_copy_(0, target, rows)
            return
        # no sink (a wrapped engine tensor, or replaced data): drop the skipped rows (a sync). index_select and
        # index_copy_ rather than boolean-mask indexing and indexed assignment: on the CPU those run an OpenMP
        # region each, which costs a scheduler time slice (~16 ms) per call on a loaded machine
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        slots = slot_mapping.index_select(0, kept).long()
        data, rows = self.data, self.quantize(values.index_select(0, kept))
        if rows.element_size() == 1:  # fp8: move the bytes (index_put_ has no fp8 kernel on every device)
            data, rows = data.view(torch.uint8), rows.view(torch.uint8)
        flat = _flat_view(data, self.row_width)
        if flat is not None:
            flat.index_copy_(0, slots, rows)
        else:
            data[_block_offset(slots, self.block_size)] = rows

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantised values ``[*slots.shape, ...]`` for flat slot indices (all must be valid)."""
        return self.dequantize(self.stored_rows(slots.long()), dtype)

    def gather(
        self, block_table_row: torch.Tensor, length: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Values ``[length, ...]`` of one sequence, in position order, from its block-table row."""
        return self.read_slots(block_table_slots(block_table_row, length, self.block_size), dtype)


class LatentKVCache(PagedRows):
    """Paged cache of 576-wide latent rows shared by every head of one layer.

    Attributes:
        data: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` storage tensor.
        kv_cache_dtype: canonical cache dtype name (``bfloat16``, ``fp8_e4m3`` ...; ``auto`` is resolved).
        model_dtype: dtype of the activations that are written and of dequantised reads.
        scale: per-tensor fp8 scale, a float32 tensor of shape ``[1]`` on the cache's device (1.0 otherwise).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        *,
        kv_cache_dtype: str | torch.dtype = "auto",
        model_dtype: str | torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        scale: float = 1.0,
    ) -> None:
        require_int("num_blocks", num_blocks, minimum=1)
        require_int("block_size", block_size, minimum=1)
        require_int("kv_lora_rank", kv_lora_rank, minimum=1)
        require_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        device = require_device("device", device)
        self.model_dtype = parse_model_dtype(model_dtype)
        storage = kv_cache_torch_dtype(kv_cache_dtype, self.model_dtype)
        self.kv_cache_dtype = canonical_kv_cache_dtype(storage)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = self._allocate_with_sink(kv_lora_rank + qk_rope_head_dim, storage, device)
        self.scale = torch.ones(1, dtype=torch.float32, device=self.data.device)
        self._scale_host = 1.0
        self.set_scale(scale)

    @classmethod
    def allocate(
        cls,
        dims: MLADims,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str | torch.dtype = "auto",
        *,
        model_dtype: str | torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        scale: float = 1.0,
    ) -> LatentKVCache:
        """Allocate a zeroed cache for ``dims`` (``num_blocks * block_size`` token slots)."""
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
        return cls(num_blocks, block_size, dims.kv_lora_rank, dims.qk_rope_head_dim,
                   kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, device=device, scale=scale)

    @classmethod
    def from_tensor(
        cls,
        data: torch.Tensor,
        *,
        kv_lora_rank: int = 512,
        model_dtype: str | torch.dtype = torch.bfloat16,
        scale: float | torch.Tensor = 1.0,
    ) -> LatentKVCache:
        """Wrap an engine's existing cache tensor ``data [num_blocks, block_size, kv_lora_rank + rope]`` without
        copying it (vLLM's per-layer MLA cache). The cache dtype is ``data``'s dtype (fp8 tensors must already
        be viewed as ``float8_e4m3fn`` / ``float8_e5m2``); ``scale`` is the per-tensor fp8 scale (the engine's
        layer ``k_scale``: a tensor is read once, one sync on a GPU; pass the host float when the engine keeps
        one). The wrapper has no sink row, so :meth:`write` masks skipped slots; engines that write their own
        rows never call it.

        Layouts: every row must be contiguous (last stride 1) and no two slots may share memory; the block and
        slot strides are otherwise free (vLLM's layer-interleaved layouts space blocks apart; a permuted
        ``[block_size, num_blocks, row]`` buffer viewed back works too), and every path (reads, writes,
        gathers, dense and sparse decode) takes them. An ``expand``ed or otherwise overlapping view is refused
        here, naming its strides, since a write to one slot would change others.
        """
        require_tensor("data", data, ndim=3, dtypes=_STORAGE_TORCH_DTYPES)
        require_int("kv_lora_rank", kv_lora_rank, minimum=1)
        if data.shape[2] < kv_lora_rank or data.shape[0] < 1 or data.shape[1] < 1:
            raise ValueError(f"data: got shape {list(data.shape)}; supported at least one block of one slot and "
                             f"rows of >= kv_lora_rank ({kv_lora_rank}) values")
        if data.stride(-1) != 1:
            raise ValueError(f"data: got strides {list(data.stride())} for shape {list(data.shape)}; supported "
                             f"{_LAYOUTS}")
        if overlapping_layout(data.shape, data.stride()):
            raise ValueError(f"data: got strides {list(data.stride())} for shape {list(data.shape)}, under which "
                             f"slots may share memory (an expand()ed or overlapping view); supported {_LAYOUTS}")
        kv = canonical_kv_cache_dtype(data.dtype)
        self = cls.__new__(cls)
        self.model_dtype = parse_model_dtype(model_dtype)
        self.kv_cache_dtype = kv
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = data.shape[2] - kv_lora_rank
        self.num_blocks, self.block_size = int(data.shape[0]), int(data.shape[1])
        self.data = data
        self.scale = torch.ones(1, dtype=torch.float32, device=data.device)
        self._scale_host = 1.0
        self.set_scale(scale)
        return self

    # ---- properties (row_width = kv_lora_rank + qk_rope_head_dim: 576 for DeepSeek-V3) -------------------
    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype in FP8_CACHE_DTYPES

    @property
    def latent(self) -> torch.Tensor:
        """Strided view ``[num_blocks, block_size, kv_lora_rank]`` of the latent part (no copy)."""
        return self.data[..., : self.kv_lora_rank]

    @property
    def rope(self) -> torch.Tensor:
        """Strided view ``[num_blocks, block_size, qk_rope_head_dim]`` of the rope part (no copy)."""
        return self.data[..., self.kv_lora_rank:]

    @property
    def scale_value(self) -> float:
        """The fp8 scale as a Python float: the host copy :meth:`set_scale` keeps (no device read)."""
        return self._scale_host

    def set_scale(self, scale: float | torch.Tensor) -> None:
        """Set the per-tensor fp8 scale, checked here once (in place: the ``scale`` tensor keeps its address,
        so kernels and captured CUDA graphs read the new value). Set it only through this method: the host
        copy (:attr:`scale_value`) and the device tensor stay equal, and no write or forward re-checks it. A
        tensor ``scale`` is read once (one sync, at set time)."""
        value = require_scale("scale", scale, tensor_ok=True)
        if not self.is_fp8 and value != 1.0:
            raise ValueError(
                f"scale: got {value} for a {self.kv_cache_dtype} cache; supported 1.0 (scales are fp8-only)")
        self.scale.fill_(float(value))
        self._scale_host = float(value)

    def __repr__(self) -> str:
        return (f"LatentKVCache(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"row={self.row_width}, dtype={self.kv_cache_dtype}, "
                f"model_dtype={dtype_name(self.model_dtype)}, device={self.device})")

    # ---- write / read ----------------------------------------------------------------------------------
    def write(self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor | SlotSource) -> None:
        """Store rows. ``kv_c [T, kv_lora_rank]``, ``k_pe [T, qk_rope_head_dim]`` (or ``[T, 1, rope]``).

        ``slot_mapping`` is either

        - a :class:`SlotSource`, the step's :class:`~mla_backends.step.plan.StepPlan` or
          :class:`~mla_backends.step.metadata.BatchMetadata` (the hot path): its slots are trusted, since ``build``
          validated them (slots in range, no two new tokens on one slot); only its host-side check against this
          cache's size is taken. No device read, static shapes: CUDA-graph safe.
        - a raw ``[T]`` int tensor (slot = block * block_size + offset; ``-1`` skips the token): its values are
          range-checked here, which reads them (one sync on a GPU).

        Slots of ``-1`` go to the sink row (:meth:`rows_with_sink`). fp8 caches store ``value / scale``,
        saturated to the format's finite range.
        """
        trusted = isinstance(slot_mapping, SlotSource)
        if trusted:
            slot_mapping = slot_mapping.slots_for(self)
        require_tensor("kv_c", kv_c, shape=(None, self.kv_lora_rank))
        if isinstance(k_pe, torch.Tensor) and k_pe.dim() == 3 and k_pe.shape[1] == 1:
            k_pe = k_pe.squeeze(1)
        require_tensor("k_pe", k_pe, shape=(kv_c.shape[0], self.qk_rope_head_dim))
        require_tensor("slot_mapping", slot_mapping, shape=(kv_c.shape[0],),
                       dtypes=(torch.int32, torch.int64))
        if not kv_c.is_floating_point() or not k_pe.is_floating_point():
            raise TypeError(f"kv_c/k_pe: got dtypes {kv_c.dtype}/{k_pe.dtype}; supported floating point")
        require_on_device(self.device, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
        self._write_rows(torch.cat([kv_c, k_pe], dim=-1), slot_mapping, trusted=trusted)

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Convert model-dtype rows to the storage dtype (``rows / scale``, saturated, for fp8)."""
        if not self.is_fp8:
            return rows.to(self.data.dtype)
        fmax = torch.finfo(self.data.dtype).max
        return (rows.float() / self.scale).clamp(-fmax, fmax).to(self.data.dtype)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Convert stored rows to ``dtype`` (default: the model dtype), applying the fp8 scale (in float32; in
        float64 for float64 values, so that a float64 read is exact)."""
        dtype = dtype or self.model_dtype
        if not self.is_fp8:
            return stored.to(dtype)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (stored.to(wide) * self.scale.to(wide)).to(dtype)
