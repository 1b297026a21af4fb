"""DeepSeek's fp8 cache records (cache dtype ``fp8_ds_mla``): :class:`RecordLayout` and :class:`RecordCache`.

A record stores one row as fp8 e4m3 values with a scale per group of values, plus a bf16 tail that is kept
exact. vLLM calls both layouts ``fp8_ds_mla``; which one a cache holds follows from its rows:

=====================  ==========  =============================================================================
layout                 rows        bytes of one row
=====================  ==========  =============================================================================
:data:`V4_RECORD`      512 + 0     584: 448 fp8 values, 64 bf16 (the rotated tail), then 7 ue8m0 scale bytes
(DeepSeek-V4)                      (one per 64 values, ``2 ** (byte - 127)``) and one zero pad byte. Within a page
                                   every row's 576 data bytes come first, then every row's 8 scale bytes; a page is
                                   rounded up to a multiple of 576 bytes.
:data:`DSMLA_RECORD`   512 + 64    656: 512 fp8 values (the latent), 4 float32 scales (one per 128), 64 bf16 (the
(DeepSeek-V3.2)                    rotary part), row after row.
=====================  ==========  =============================================================================

Writing (:func:`quantize_records`) follows vLLM's cache writers byte for byte: V4 scales are
``2 ** ceil(log2(max(amax, 1e-4) / 448))`` per group of 64 (vLLM's ``quantize_and_insert_k_cache``), V3.2 scales
``max(amax / 448, FLT_MIN)`` per group of 128 stored as float32 (its ``concat_and_cache_ds_mla_kernel``); values
are ``value / scale`` rounded to nearest-even e4m3 (saturated at 448, as ``cvt.rn.satfinite``), the tail is the
bf16 value. Reading (:func:`dequantize_records`) is ``fp8 * scale``, exact in float32 for the power-of-two V4
scales. ``tests/vllm_engine/test_vllm_v4.py`` holds the byte-identity evidence.

A :class:`RecordCache` is a :class:`~mla_backends.step.cache.LatentKVCache` whose ``data`` holds bytes
(``uint8``): ``[num_blocks, page_bytes]`` for V4, ``[num_blocks, block_size, 656]`` for V3.2 (vLLM's shapes), with
slots addressed as in every cache (``slot = page * block_size + offset``). It writes and reads rows through
``write`` / ``read_slots`` / ``stored_rows`` + ``dequantize``; kernels read the bytes in place
(``mla_backends/triton_mla/kernels_v4.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.dtypes import FP8_E4M3_MAX, parse_model_dtype
from ..core.validation import require_device, require_int, require_tensor
from .cache import LatentKVCache, check_slot_mapping

__all__ = ["RecordLayout", "V4_RECORD", "DSMLA_RECORD", "RecordCache", "record_layout_for", "quantize_records",
           "dequantize_records", "V4_SCALE_FLOOR"]

#: the smallest group maximum V4's scales are computed from (vLLM's writer: ``fmaxf(amax, 1e-4)``)
V4_SCALE_FLOOR = 1e-4
#: float32's smallest normal value: V3.2's scale floor (``fmaxf(amax / 448, FLT_MIN)``)
_FLT_MIN = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class RecordLayout:
    """One fp8 record layout (module docstring).

    Attributes:
        name: ``"v4"`` or ``"v32"``. kv_lora_rank / rope: the row widths it stores (value part, key-only part).
        fp8_cols: leading values stored as fp8. group: values sharing one scale. ue8m0: scales are one byte
            each (``2 ** (b - 127)``), else float32. scale_bytes: bytes of a record's scale field.
        bf16_cols: trailing values stored as bf16. split_page: a page holds every data part, then every scale
            part (V4); otherwise whole records one after another. page_align: pages round up to this many bytes.
        scale_offset / bf16_offset: byte offsets of the scales and the bf16 tail within a record (the record
            as :func:`quantize_records` lays it out: V4 ``data | scales``, V3.2 ``fp8 | scales | bf16``).
    """

    name: str
    kv_lora_rank: int
    rope: int
    fp8_cols: int
    group: int
    ue8m0: bool
    scale_bytes: int
    bf16_cols: int
    split_page: bool
    page_align: int
    scale_offset: int
    bf16_offset: int

    @property
    def width(self) -> int:
        """Values a row holds (``fp8_cols + bf16_cols``)."""
        return self.fp8_cols + self.bf16_cols

    @property
    def record_bytes(self) -> int:
        """Bytes one row takes (584 / 656)."""
        return self.fp8_cols + 2 * self.bf16_cols + self.scale_bytes

    @property
    def data_bytes(self) -> int:
        """V4: the bytes of a row's data part (576) that precede the scale rows of its page."""
        return self.fp8_cols + 2 * self.bf16_cols

    @property
    def groups(self) -> int:
        return self.fp8_cols // self.group

    def page_bytes(self, block_size: int) -> int:
        """Bytes of a page of ``block_size`` rows, rounded up to :attr:`page_align`."""
        raw = block_size * self.record_bytes
        return -(-raw // self.page_align) * self.page_align


#: DeepSeek-V4's 584-byte record (448 fp8 + 64 bf16, 7 ue8m0 scales + 1 pad; data rows then scale rows a page)
V4_RECORD = RecordLayout("v4", 512, 0, 448, 64, True, 8, 64, True, 576, scale_offset=576, bf16_offset=448)
#: DeepSeek-V3.2's 656-byte ``fp8_ds_mla`` record (512 fp8, 4 float32 scales, 64 bf16), row after row
DSMLA_RECORD = RecordLayout("v32", 512, 64, 512, 128, False, 16, 64, False, 1, scale_offset=512, bf16_offset=528)
_LAYOUTS = (V4_RECORD, DSMLA_RECORD)


def record_layout_for(kv_lora_rank: int, qk_rope_head_dim: int) -> RecordLayout:
    """The record layout of rows ``kv_lora_rank + qk_rope_head_dim`` wide: 512 + 0 (V4) or 512 + 64 (V3.2)."""
    for layout in _LAYOUTS:
        if (layout.kv_lora_rank, layout.rope) == (kv_lora_rank, qk_rope_head_dim):
            return layout
    raise ValueError(f"kv_lora_rank/qk_rope_head_dim: got {kv_lora_rank}/{qk_rope_head_dim} for an fp8_ds_mla cache; "
                     "supported 512/0 (DeepSeek-V4, 584-byte records) or 512/64 (DeepSeek-V3.2, 656-byte records)")


def _scales(amax: torch.Tensor, layout: RecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale float32, stored scale bytes)`` per group from the groups' float32 maxima ``amax [n, groups]``."""
    if layout.ue8m0:
        raw = torch.clamp_min(amax, V4_SCALE_FLOOR) / FP8_E4M3_MAX  # float32, as the writer divides
        mant, exp = torch.frexp(raw)  # raw = mant * 2**exp, mant in [0.5, 1): ceil(log2(raw)) exactly
        e = torch.where(mant == 0.5, exp - 1, exp)
        scale = torch.ldexp(torch.ones_like(raw), e)
        return scale, (e + 127).clamp(0, 255).to(torch.uint8)
    scale = torch.clamp_min(amax / FP8_E4M3_MAX, _FLT_MIN)
    return scale, scale.contiguous().view(torch.uint8).view(amax.shape[0], -1)


def quantize_records(values: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """Rows ``values [n, layout.width]`` (any float dtype) -> records ``[n, layout.record_bytes]`` uint8, laid
    out as the layout's record (module docstring; V4: ``data | scale bytes | pad``)."""
    n = values.shape[0]
    x = values.to(torch.float32)
    head = x[:, : layout.fp8_cols].reshape(n, layout.groups, layout.group)
    scale, scale_bytes = _scales(head.abs().amax(-1), layout)
    q = (head / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    tail = values[:, layout.fp8_cols:].to(torch.bfloat16).contiguous().view(torch.uint8).view(n, -1)
    out = torch.zeros(n, layout.record_bytes, dtype=torch.uint8, device=values.device)
    out[:, : layout.fp8_cols] = q.view(torch.uint8).view(n, -1)
    out[:, layout.scale_offset: layout.scale_offset + scale_bytes.shape[1]] = scale_bytes
    out[:, layout.bf16_offset: layout.bf16_offset + 2 * layout.bf16_cols] = tail
    return out


def dequantize_records(records: torch.Tensor, layout: RecordLayout, dtype: torch.dtype) -> torch.Tensor:
    """Records ``[..., record_bytes]`` uint8 -> rows ``[..., width]`` in ``dtype`` (``fp8 * scale``; the tail as
    stored)."""
    lead = records.shape[:-1]
    flat = records.reshape(-1, layout.record_bytes)
    n = flat.shape[0]
    q = flat[:, : layout.fp8_cols].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    raw = flat[:, layout.scale_offset: layout.scale_offset + (layout.groups if layout.ue8m0 else 4 * layout.groups)]
    if layout.ue8m0:
        scale = torch.ldexp(torch.ones(n, layout.groups, device=flat.device), raw.to(torch.int32) - 127)
    else:
        scale = raw.contiguous().view(torch.float32).view(n, layout.groups)
    head = (q.view(n, layout.groups, layout.group) * scale[..., None]).view(n, layout.fp8_cols)
    tail = flat[:, layout.bf16_offset: layout.bf16_offset + 2 * layout.bf16_cols].contiguous().view(torch.bfloat16)
    return torch.cat([head.to(dtype), tail.to(dtype)], dim=-1).view(*lead, layout.width)


class RecordCache(LatentKVCache):
    """A paged cache of fp8 records (``kv_cache_dtype == "fp8_ds_mla"``; module docstring).

    ``data`` holds bytes: ``[num_blocks, page_bytes]`` for V4 records, ``[num_blocks, block_size, 656]`` for
    V3.2 ones. ``row_width`` / ``bytes_per_token`` are the record's bytes (584 / 656; a V4 page adds its
    rounding). Rows are written with ``write`` (quantised on the way in) and read with ``read_slots``,
    ``stored_rows`` (records) + ``dequantize``; ``latent`` / ``rope`` views do not exist (the bytes are mixed).
    A cache allocated here has a sink page that skipped tokens (slot ``-1``) write to, so writes keep static
    shapes; a wrapped engine tensor (:meth:`from_tensor`) has none and masks them (one sync).
    """

    def __init__(self, num_blocks: int, block_size: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 0, *,
                 model_dtype: str | torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> None:
        require_int("num_blocks", num_blocks, minimum=1)
        require_int("block_size", block_size, minimum=1)
        layout = record_layout_for(kv_lora_rank, qk_rope_head_dim)
        dev = require_device("device", device)
        self._init_common(layout, num_blocks, block_size, model_dtype)
        page = layout.page_bytes(block_size)
        self._store = torch.zeros(num_blocks + 1, page, dtype=torch.uint8, device=dev)  # + the sink page
        self.data = self._shaped(self._store[:num_blocks])
        self._page_stride, self._has_sink = page, True
        self._bytes = self._store.view(-1)
        self.scale = torch.ones(1, dtype=torch.float32, device=dev)

    def _init_common(self, layout: RecordLayout, num_blocks: int, block_size: int,
                     model_dtype: str | torch.dtype) -> None:
        self.layout = layout
        self.model_dtype = parse_model_dtype(model_dtype)
        self.kv_cache_dtype = "fp8_ds_mla"
        self.kv_lora_rank, self.qk_rope_head_dim = layout.kv_lora_rank, layout.rope
        self.num_blocks, self.block_size = num_blocks, block_size
        self._scale_host = 1.0

    def _shaped(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages [n, page_bytes]`` as this layout's ``data``: V3.2 ``[n, block_size, 656]``, V4 as it is."""
        if self.layout.split_page:
            return pages
        return pages[:, : self.block_size * self.layout.record_bytes].view(-1, self.block_size,
                                                                            self.layout.record_bytes)

    @classmethod
    def allocate_rows(cls, num_blocks: int, block_size: int, width: int, *, model_dtype: torch.dtype,
                      device: torch.device) -> RecordCache:
        """A zeroed V4 record store of rows ``width`` wide (512: ``RowFormat("fp8_ds_mla")``)."""
        return cls(num_blocks, block_size, width, 0, model_dtype=model_dtype, device=device)

    @classmethod
    def from_tensor(cls, data: torch.Tensor, *, block_size: int | None = None,  # type: ignore[override]
                    kv_lora_rank: int = 512, qk_rope_head_dim: int = 0,
                    model_dtype: str | torch.dtype = torch.bfloat16, **_: object) -> RecordCache:
        """Wrap an engine's record tensor without copying: a V4 cache ``[num_blocks, >= page_bytes]`` (or any
        shape whose leading dimension is the page, as vLLM binds it) with ``block_size`` rows a page, or a V3.2
        cache ``[num_blocks, block_size, 656]``. Pages must be contiguous bytes (``uint8``); their stride may
        pad them."""
        require_tensor("data", data, dtypes=(torch.uint8,))
        layout = record_layout_for(kv_lora_rank, qk_rope_head_dim)
        if not layout.split_page:
            require_tensor("data", data, shape=(None, None, layout.record_bytes), dtypes=(torch.uint8,))
            block_size = int(data.shape[1]) if block_size is None else block_size
            if block_size != data.shape[1] or data.stride(2) != 1 or data.stride(1) != layout.record_bytes:
                raise ValueError(f"data: got shape {list(data.shape)}, strides {list(data.stride())}; supported "
                                 f"[num_blocks, block_size, {layout.record_bytes}] with whole records back to back")
            pages = data
        else:
            if block_size is None:
                raise TypeError("block_size: got None for a DeepSeek-V4 record tensor; supported the rows a page holds")
            require_int("block_size", block_size, minimum=1)
            if data.dim() < 1 or data.shape[0] < 1:
                raise ValueError(f"data: got shape {list(data.shape)}; supported [num_blocks, page bytes]")
            pages = data.reshape(data.shape[0], -1) if data.dim() != 2 else data
            need = block_size * layout.record_bytes
            if pages.shape[1] < need or pages.stride(1) != 1 or (pages.shape[0] > 1 and pages.stride(0) < need):
                raise ValueError(f"data: got pages of {pages.shape[1]} bytes (stride {pages.stride(0)}); supported "
                                 f">= {need} contiguous bytes a page ({block_size} rows of {layout.record_bytes})")
        self = cls.__new__(cls)
        self._init_common(layout, int(data.shape[0]), block_size, model_dtype)
        self.data = data
        self._page_stride = int(pages.stride(0))
        self._has_sink = False
        span = (self.num_blocks - 1) * self._page_stride + (
            layout.page_bytes(block_size) if layout.split_page else block_size * layout.record_bytes)
        self._bytes = torch.as_strided(data, (span,), (1,), data.storage_offset())
        self.scale = torch.ones(1, dtype=torch.float32, device=data.device)
        return self

    # ---- what the rest of the library reads ---------------------------------------------------------------
    @property
    def row_width(self) -> int:
        """Bytes of one record (584 / 656)."""
        return self.layout.record_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.layout.record_bytes

    @property
    def page_stride(self) -> int:
        """Bytes from one page to the next in :attr:`data`."""
        return self._page_stride

    @property
    def byte_span(self) -> torch.Tensor:
        """Every byte of the cache as one 1-D ``uint8`` view (page ``i`` starts at ``i * page_stride``; a cache
        allocated here ends with its sink page): what kernels index by byte offset."""
        return self._bytes

    @property
    def is_fp8(self) -> bool:
        """False: no per-tensor fp8 scale (the scales live in the records)."""
        return False

    @property
    def latent(self) -> torch.Tensor:
        raise TypeError("RecordCache.latent: fp8_ds_mla records mix fp8 values, scales and bf16 bytes; "
                        "supported reads: read_slots(slots) or stored_rows + dequantize")

    @property
    def rope(self) -> torch.Tensor:
        raise TypeError("RecordCache.rope: fp8_ds_mla records mix fp8 values, scales and bf16 bytes; "
                        "supported reads: read_slots(slots) or stored_rows + dequantize")

    def flat_rows(self) -> torch.Tensor | None:
        return None

    def rows_with_sink(self) -> torch.Tensor | None:
        return None

    def set_scale(self, scale: float | torch.Tensor) -> None:
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != 1.0:
            raise ValueError(f"scale: got {scale!r} for an fp8_ds_mla cache; supported 1.0 (its scales are "
                             "stored per group in the records)")

    def __repr__(self) -> str:
        return (f"RecordCache(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"record={self.layout.record_bytes} B ({self.layout.name}), device={self.device})")

    # ---- bytes ----------------------------------------------------------------------------------------------
    def record_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Byte offsets ``[*slots.shape, record_bytes]`` into the cache's byte span of the records at ``slots``
        (all >= 0), in record order (V4: data bytes, then the scale bytes at the end of the page)."""
        lay, bs = self.layout, self.block_size
        slots = slots.long()
        page, off = torch.div(slots, bs, rounding_mode="floor"), slots % bs
        base = page * self._page_stride
        if not lay.split_page:
            return (base + off * lay.record_bytes)[..., None] + torch.arange(lay.record_bytes, device=slots.device)
        data = (base + off * lay.data_bytes)[..., None] + torch.arange(lay.data_bytes, device=slots.device)
        scales = (base + bs * lay.data_bytes + off * lay.scale_bytes)[..., None] + torch.arange(
            lay.scale_bytes, device=slots.device)
        return torch.cat([data, scales], dim=-1)

    def stored_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The records ``[*slots.shape, record_bytes]`` at flat ``slots`` (all valid)."""
        return self._bytes[self.record_offsets(slots)]

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        return quantize_records(values, self.layout)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_records(stored, self.layout, dtype or self.model_dtype)

    def _write_rows(self, values: torch.Tensor, slot_mapping: torch.Tensor, *, trusted: bool = False) -> None:
        """Quantise ``values [T, width]`` and store the records at ``slot_mapping [T]`` (``-1`` skips: to the
        sink page, or masked out for a wrapped tensor, one sync)."""
        if not trusted:
            check_slot_mapping(slot_mapping, self.num_blocks, self.block_size)
        slots = slot_mapping.long()
        records = self.quantize(values)
        if self._has_sink:
            slots = torch.where(slots >= 0, slots, torch.full_like(slots, self.num_blocks * self.block_size))
        else:
            keep = slots >= 0
            slots, records = slots[keep], records[keep]
        self._bytes.index_put_((self.record_offsets(slots).reshape(-1),), records.reshape(-1))
