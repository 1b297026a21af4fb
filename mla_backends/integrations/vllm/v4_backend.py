"""DeepSeek-V4 attention in vLLM on mla-backends: vLLM's DSV4 interface on a library backend's ``forward_mqa``.

vLLM's V4 layer (``DeepseekV4Attention``, ``vllm/models/deepseek_v4/``) ends each layer's attention in
``forward_mqa(q, kv, positions, output)``, reading per step

- the sliding-window pool: its cache (``swa_cache_layer.kv_cache``: 584-byte ``fp8_ds_mla`` records, or plain
  bf16 rows, 64-token pages) and its ``DeepseekSparseSWAMetadata`` (``block_table``, ``block_size``,
  ``seq_lens``, ``query_start_loc_cpu``, ``token_to_req_indices``), whose request order is the step's;
- on compressed layers, the compressed pool: its cache (``self.kv_cache``, records or rows, ``block_size //
  compress_ratio`` entries a page) and its ``DeepseekV4FlashMLAMetadata`` (``block_table`` of 256-token logical
  pages, ``block_size``); the entries a token attends are the indexer's top-k (``topk_indices_buffer``, entry
  numbers of the token's request, ``-1`` padded) on CSA layers (ratio 4) and every visible entry,
  ``0 .. (p + 1) // ratio - 1``, on HCA layers (ratio 128);
- the layer's ``attn_sink [H]``, ``scale``, ``window_size``.

:class:`VLLMV4Attention` does what vLLM's CPU layer does with ``flash_mla_with_kvcache_cpu``, on the library:
once per step (the metadata object of the SWA pool, shared by every layer) it builds the step's
``BatchMetadata`` over the window pool (vLLM's order kept: ``reorder=False``; the host lengths come from
``query_start_loc_cpu`` and ``seq_lens``, one read of a GPU tensor a step) and plans it; per layer it wraps the
two caches without a copy (:class:`~mla_backends.step.records.RecordCache` for records,
``LatentKVCache.from_tensor`` for rows) and calls ``forward_mqa(q, ..., sinks=, window=, compressed=
CompressedKeys(compressed cache, its block table, the entries))``, writing into vLLM's ``output``. It imports no
vLLM: it reads the metadata's fields, so it is tested with vLLM's own metadata classes
(``tests/vllm_engine/test_vllm_v4.py``) and with stand-ins.

:func:`vllm_v4_attention_class` (imports vLLM) makes the subclass of one of vLLM's V4 attention classes whose
``forward_mqa`` is the above; how it is hooked into vLLM's model is in ``docs/integrations.md`` ("DeepSeek-V4").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...backends.capabilities import AttentionSpec
from ...backends.contract import MLABackend, configure_backend
from ...backends.reasons import ReasonKind, reasons_of, without_kinds
from ...backends.v4_inputs import CompressedKeys
from ...core.device import device_info_for
from ...core.validation import require_device, require_int
from ...plugins.loading import get_backend
from ...step.cache import LatentKVCache
from ...step.metadata import BatchMetadata
from ...step.plan import StepPlan, plan_step
from ...step.records import RecordCache

__all__ = ["VLLMV4Attention", "V4Step", "wrap_v4_cache", "v4_batch_metadata", "vllm_v4_attention_class"]

#: vLLM's V4 row: 448 plain + 64 rotated values, one KV head
HEAD_DIM = 512


def wrap_v4_cache(kv_cache: torch.Tensor, block_size: int, *, model_dtype: torch.dtype = torch.bfloat16
                  ) -> LatentKVCache:
    """vLLM's V4 cache tensor (a pool's pages, leading dimension the page: ``uint8`` ``fp8_ds_mla`` records or
    rows of 512 values) as a library cache, without a copy: ``block_size`` rows a page."""
    require_int("block_size", block_size, minimum=1)
    if kv_cache.dtype == torch.uint8:
        return RecordCache.from_tensor(kv_cache.reshape(kv_cache.shape[0], -1), block_size=block_size,
                                       kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0, model_dtype=model_dtype)
    rows = kv_cache.reshape(kv_cache.shape[0], block_size, HEAD_DIM)
    return LatentKVCache.from_tensor(rows, kv_lora_rank=HEAD_DIM, model_dtype=model_dtype)


def v4_batch_metadata(swa_metadata: Any, num_tokens: int) -> BatchMetadata:
    """The step's metadata over vLLM's window pool, in vLLM's order (``reorder=False``), from the SWA metadata's
    ``query_start_loc_cpu`` (host), ``seq_lens`` (read once: a sync on a GPU), ``block_table`` and
    ``block_size``."""
    starts = [int(v) for v in swa_metadata.query_start_loc_cpu.tolist()]
    query = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    seq = [int(v) for v in swa_metadata.seq_lens.tolist()][: len(query)]
    if sum(query) != num_tokens:
        raise ValueError(f"q: got {num_tokens} tokens; supported the step's {sum(query)} (query_start_loc_cpu)")
    context = [s - q for s, q in zip(seq, query, strict=True)]
    table = swa_metadata.block_table[: len(query)]
    return BatchMetadata.build(query, context, table, int(swa_metadata.block_size), reorder=False,
                               device=table.device)


@dataclass(frozen=True)
class V4Step:
    """One step as every layer of it reads it: vLLM's SWA metadata object it was made from, the library's
    metadata over the window pool and its plan for the backend."""

    source: Any
    meta: BatchMetadata
    plan: StepPlan


class VLLMV4Attention:
    """vLLM's DeepSeek-V4 ``forward_mqa`` on a library backend (module docstring).

    Args:
        num_heads: this rank's query heads (vLLM's ``n_local_heads``; padded heads are left alone).
        window: ``sliding_window``. compress_ratio: the layer's ratio (0 or 1: window only; 4: CSA; 128: HCA).
        scale: the softmax scale (``head_dim ** -0.5``).
        backend: a registered name or class (default: ``REF_TORCH`` on a CPU, ``TRITON_MLA`` on a GPU); it must
            declare sinks, windows and (compressed layers) compressed keys: refused otherwise, naming why.
        dtype / kv_cache_dtype / device: the queries' dtype, vLLM's cache dtype name (``auto`` or
            ``fp8_ds_mla``) and the device, for the backend's declarations.
    """

    def __init__(self, *, num_heads: int, window: int, compress_ratio: int, scale: float, backend: Any = None,
                 dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto",
                 device: str | torch.device = "cpu") -> None:
        self.num_heads = require_int("num_heads", num_heads, minimum=1)
        self.window = require_int("window", window, minimum=1)
        self.ratio = require_int("compress_ratio", compress_ratio, minimum=0)
        self.scale = float(scale)
        dev = require_device("device", device)
        kv = "fp8_ds_mla" if kv_cache_dtype in ("fp8", "fp8_ds_mla", "fp8_e4m3") else "auto"
        if backend is None:
            backend = "REF_TORCH" if dev.type == "cpu" else "TRITON_MLA"
        cls: type[MLABackend] = get_backend(backend)
        spec = AttentionSpec(num_heads=num_heads, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0, dtype=dtype,
                             kv_cache_dtype=kv, max_query_len=2, uniform_query_len=False,
                             device=device_info_for(dev), sinks=True, window=True, compressed=self.ratio > 1)
        reasons = without_kinds(reasons_of(cls, spec), ReasonKind.PACKAGE)
        if reasons:
            raise ValueError(f"backend: got {cls.name}, which cannot run vLLM's DeepSeek-V4 attention here: "
                             + "; ".join(map(str, reasons)))
        self.backend = configure_backend(cls, spec, self.scale)  # one configured backend per configuration
        self._step: V4Step | None = None

    def step(self, swa_metadata: Any, num_tokens: int) -> V4Step:
        """The step of ``swa_metadata`` (made on its first layer, then reused while the same object comes)."""
        cur = self._step
        if cur is None or cur.source is not swa_metadata:
            meta = v4_batch_metadata(swa_metadata, num_tokens)
            cur = V4Step(swa_metadata, meta, plan_step(meta, [self.backend]))
            self._step = cur
        return cur

    def forward(self, q: torch.Tensor, output: torch.Tensor, *, swa_metadata: Any, swa_cache: torch.Tensor,
                sinks: torch.Tensor, compressed_metadata: Any = None, compressed_cache: torch.Tensor | None = None,
                topk_indices: torch.Tensor | None = None) -> None:
        """Attention of ``q [T, >= num_heads, 512]`` (normed, rotated) into ``output [T, >= num_heads, 512]`` (the
        first ``num_heads`` heads), as vLLM's ``forward_mqa``. ``topk_indices``: CSA's ``[>= T, K]`` entry numbers
        (vLLM's ``topk_indices_buffer``); ignored on HCA layers, which attend every visible entry."""
        T, H = q.shape[0], self.num_heads
        st = self.step(swa_metadata, T)
        window_cache = wrap_v4_cache(swa_cache, int(swa_metadata.block_size), model_dtype=q.dtype)
        compressed = None
        if self.ratio > 1:
            if compressed_metadata is None or compressed_cache is None:
                raise ValueError(f"compressed_metadata/compressed_cache: got None for a layer of ratio {self.ratio}; "
                                 "supported the compressed pool's metadata and cache")
            per_page = int(compressed_metadata.block_size) // self.ratio
            ccache = wrap_v4_cache(compressed_cache, per_page, model_dtype=q.dtype)
            if topk_indices is not None and self.ratio == 4:
                picks = topk_indices[:T]
            else:  # every entry whose window is complete: 0 .. (p + 1) // ratio - 1
                width = max(1, max((s // self.ratio for s in st.meta.seq_lens_list), default=1))
                cols = torch.arange(width, device=q.device)[None, :]
                visible = (st.meta.token_positions + 1) // self.ratio
                picks = torch.where(cols < visible[:, None], cols, torch.full_like(cols, -1))
            table = compressed_metadata.block_table[: st.meta.num_requests]
            compressed = CompressedKeys(ccache, table, picks, trusted=True)  # the engine's indexer and tables
        self.backend.forward_mqa(q[:, :H], q[:, :H, :0], window_cache, st.meta, scale=self.scale, plan=st.plan,
                                 out=output[:T, :H], sinks=sinks[:H], window=self.window, compressed=compressed)


def vllm_v4_attention_class(base: type) -> type:
    """A subclass of vLLM's V4 attention class ``base`` (``DeepseekV4FlashMLAAttention``,
    ``DeepseekV4CPUAttention`` ...) whose ``forward_mqa`` runs on :class:`VLLMV4Attention` (imports vLLM)."""
    from vllm.forward_context import get_forward_context

    class MLABackendsV4Attention(base):  # type: ignore[misc, valid-type]
        """vLLM's DeepSeek-V4 attention layer with ``forward_mqa`` on mla-backends."""

        def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                        output: torch.Tensor) -> None:
            metadata = get_forward_context().attn_metadata
            if metadata is None:  # warm-up / profile run
                output.zero_()
                return
            runner = self.__dict__.get("_mla_backends_v4")
            if runner is None:
                runner = VLLMV4Attention(num_heads=self.n_local_heads, window=self.window_size,
                                         compress_ratio=self.compress_ratio, scale=self.scale, dtype=q.dtype,
                                         kv_cache_dtype=("fp8_ds_mla" if self.swa_cache_layer.kv_cache.dtype
                                                         == torch.uint8 else "auto"), device=q.device)
                self.__dict__["_mla_backends_v4"] = runner
            runner.forward(q, output, swa_metadata=metadata[self.swa_cache_layer.prefix],
                           swa_cache=self.swa_cache_layer.kv_cache, sinks=self.attn_sink,
                           compressed_metadata=metadata.get(self.prefix), compressed_cache=self.kv_cache,
                           topk_indices=self.topk_indices_buffer)

    MLABackendsV4Attention.__qualname__ = f"MLABackendsV4Attention[{base.__name__}]"
    return MLABackendsV4Attention
