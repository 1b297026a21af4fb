"""The vLLM attention backend that runs MLA decode on mla-backends (imports vLLM).

:class:`MLABackendsBackend` sits on vLLM's MLA base classes. Its impl keeps vLLM's prefill (``forward_mha``)
and cache writes (``do_kv_cache_update``; on the CPU, fp8 rows are written here, as ``LatentKVCache.write``
stores them); at start-up (each MLA layer's impl) it calls ``select_backend()`` for vLLM's configuration and
fails with the selection's reasons, and those of vLLM's own path around it, when nothing fits; every decode
calls ``forward_mqa`` of the selected class on the step's shared ``BatchMetadata`` (built by
:class:`MLABackendsMetadataBuilder`) and the layer's cache wrapped without a copy, fp8 caches viewed as the
format they were written in. What vLLM is told (dtypes, cache dtypes, head and block sizes, LSE, CUDA graphs)
is the chosen backend's ``Capabilities`` intersected with what vLLM's own MLA path takes on the platform.
"""

from __future__ import annotations

import functools
import inspect
import struct
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport, MultipleOf

from ...step.metadata import BatchMetadata
from ...step.plan import StepPlan, plan_step
from .. import engine_core as core
from .internals import INTERNALS
from .selection import (
    ENGINE,
    VLLMSelectionError,
    declarations,
    fp8_cache_view_dtype,
    intersect,
    request_from_vllm,
    select_at_startup,
    startup_line,
    vllm_path,
)
from .step import decode_batch_metadata, host_seq_lens

__all__ = ["MLABackendsBackend", "MLABackendsMetadataBuilder", "MLABackendsDecodeMetadata", "MLABackendsImpl",
           "MLABackendsCPUImpl", "SCALE_ATTR"]

logger = init_logger("vllm.mla_backends")


def _device() -> str:
    """The device ``select_backend()`` is asked about: vLLM's CPU platform or this process's CUDA device."""
    return core.device_name("cpu" if current_platform.is_cpu() else "cuda")


def _member() -> str:
    """The vLLM member this backend stands in for here (CPU: the overridden ``CPU_MLA``)."""
    return "CPU_MLA" if current_platform.is_cpu() else "CUSTOM"


def _path() -> Any:
    """What vLLM's own MLA code around the backend takes on this platform (:func:`.selection.vllm_path`): the
    head sizes its ``MLACommonMetadata`` checks, read from vLLM itself, and the platform's fp8 type."""
    return vllm_path("CPU" if current_platform.is_cpu() else str(getattr(current_platform, "device_name", "GPU")),
                     head_sizes=tuple(MLACommonBackend.get_supported_head_sizes()),
                     fp8_dtype=current_platform.fp8_dtype())


def _current_declarations() -> Any:
    """Declarations of the backend selected for the current vLLM config, narrowed to what vLLM's own path
    takes on this platform (None outside a config, or when the selection refuses it: the impl then fails at
    start-up with the reasons)."""
    cfg = get_current_vllm_config_or_none()
    if cfg is None or getattr(cfg, "model_config", None) is None:
        return None
    try:
        return intersect(declarations(request_from_vllm(cfg, device=_device()).select().backend.capabilities),
                         _path())
    except VLLMSelectionError:
        return None


#: the host copy of the layer's fp8 scale that decode reads (vLLM keeps it next to the ``_k_scale`` tensor)
SCALE_ATTR = "_k_scale_float"


def _same_float32(a: float, b: float) -> bool:
    """True when ``a`` and ``b`` are one float32 (the cache keeps its scale as a float32 tensor)."""
    return struct.pack("<f", a) == struct.pack("<f", b)


def _check_layers(vllm_config: Any, layer_names: Any, backend: Any) -> None:
    """At start-up (the metadata builder): the configuration's and every MLA layer's internals
    (:mod:`.internals`), every layer's impl running ``backend`` (the builder's configured backend: the plan it
    makes is the one they run), and, for an fp8 cache, every layer's host scale (a positive float)."""
    core.check_internals(ENGINE, INTERNALS, role="config", obj=vllm_config, where="vLLM's configuration")
    ctx = vllm_config.compilation_config.static_forward_context
    fp8 = fp8_cache_view_dtype(vllm_config.cache_config.cache_dtype) is not None
    for name in layer_names or ():
        if name not in ctx:
            raise VLLMSelectionError(f"mla-backends: layer {name!r} is not in vLLM's static_forward_context; "
                                     "supported layers registered there (each is checked at start-up)")
        layer = ctx[name]
        core.check_internals(ENGINE, INTERNALS, role="layer", obj=layer, where=f"layer {name!r}")
        if isinstance(layer.impl, _DecodeOnMLABackends) and layer.impl.mla_backend is not backend:
            raise VLLMSelectionError(
                f"mla-backends: layer {name!r} runs {layer.impl.mla_backend!r}, configured apart from the metadata "
                f"builder's {backend!r}; supported one configured backend for every layer of a step (the same "
                "selection, spec and softmax scale)")
        if fp8:
            core.fp8_scale(ENGINE, layer._k_scale_float, attr=SCALE_ATTR, where=f"layer {name!r}")


@dataclass
class MLABackendsDecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the step's :class:`BatchMetadata` and its :class:`StepPlan` (one per step,
    shared by every layer)."""

    batch: BatchMetadata | None = None
    plan: StepPlan | None = None


def _configured(vllm_config: Any, *, num_heads: int | None = None) -> tuple[Any, Any, float]:
    """``(selection, configured backend, softmax scale)`` for ``vllm_config``'s MLA layers: the same choice
    and the same configured instance (:func:`~..engine_core.configured_backend`) in the metadata builder, which
    plans the step, and in every layer's impl, which runs it."""
    request = request_from_vllm(vllm_config, device=_device(), num_heads=num_heads)
    dcp = int(vllm_config.parallel_config.decode_context_parallel_size or 1)
    if dcp == 1 and request.need_lse:
        request = replace(request, need_lse=False)
    sel = select_at_startup(request, _path())  # VLLMSelectionError, both sides' reasons: start-up fails
    scale = request.dims.softmax_scale
    return sel, core.configured_backend(sel, scale), scale


class MLABackendsMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA builder; each step's decode part also gets its :class:`BatchMetadata` and plan here, once.
    Made at start-up (after every layer's impl), it takes the configured backend and checks the layers
    (:func:`_check_layers`)."""

    def __init__(self, kv_cache_spec: Any, layer_names: Any, vllm_config: Any, device: Any, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self._mla_backend = _configured(vllm_config)[1]
        _check_layers(vllm_config, layer_names, self._mla_backend)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """Single-token-decode CUDA graphs only when the chosen backend declares ``cuda_graphs``."""
        try:
            caps = request_from_vllm(vllm_config, device=_device()).select().backend.capabilities
        except VLLMSelectionError:
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if caps.cuda_graphs else AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        d = m.decode
        if d is not None:
            # vLLM's own layer splits the step (its decode rows first, by its reorder threshold, and runs the
            # prefill rows on its MHA path); the library plans the decode rows, the whole of them absorbed, once
            # here: every layer's impl reads the plan (no dispatch of its own to mirror)
            common = common_attn_metadata
            upper = (common.seq_lens_cpu_upper_bound if d.dcp_tot_seq_lens is None  # DCP: this rank's lengths
                     else common.dcp_local_seq_lens_cpu_upper_bound)
            batch = decode_batch_metadata(d.block_table, d.seq_lens, host_seq_lens(d.seq_lens, upper),
                                          self.page_size)
            m.decode = MLABackendsDecodeMetadata(block_table=d.block_table, seq_lens=d.seq_lens,
                                                 dcp_tot_seq_lens=d.dcp_tot_seq_lens, batch=batch,
                                                 plan=plan_step(batch, [self._mla_backend]))
        return m


@functools.cache
def _takes_skip_scale(impl: type) -> bool:
    """Whether vLLM's cache write under ``impl`` (the base after :class:`_DecodeOnMLABackends` in its MRO) takes
    ``skip_scale`` (vLLM 0.33); decided once per class."""
    mro = impl.__mro__
    base = mro[mro.index(_DecodeOnMLABackends) + 1:]
    method = next(c.__dict__["do_kv_cache_update"] for c in base if "do_kv_cache_update" in c.__dict__)
    try:
        return "skip_scale" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class _DecodeOnMLABackends:
    """What both impls add to vLLM's: the start-up checks and selection, ``forward_mqa`` on the configured
    backend, version-tolerant cache writes."""

    lse_base_on_e: bool = True  # forward_mqa's LSE is the natural log
    mla_selection: Any
    mla_backend: Any
    mla_scale: float
    mla_fp8: torch.dtype | None  # the fp8 format the layer cache holds (None: not fp8)
    mla_caches: core.LayerCaches
    _mla_write_cache: Any = None  # the wrapper the CPU impl wrote fp8 rows through

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        core.check_internals(ENGINE, INTERNALS, role="impl", obj=self, where=type(self).__name__)
        cfg = get_current_vllm_config()
        sel, backend, scale = _configured(cfg, num_heads=self.num_heads)  # type: ignore[attr-defined]
        self.mla_scale = core.check_softmax_scale(ENGINE, self.scale, scale)  # type: ignore[attr-defined]
        self.mla_selection = sel
        self.mla_backend = backend
        self.mla_fp8 = fp8_cache_view_dtype(self.kv_cache_dtype)  # type: ignore[attr-defined]
        self.mla_caches = core.LayerCaches(self.kv_lora_rank, cfg.model_config.dtype)  # type: ignore[attr-defined]
        self.can_return_lse_for_decode = sel.backend.capabilities.returns_lse
        self.need_to_return_lse_for_decode = self.dcp_world_size > 1 and self.can_return_lse_for_decode  # type: ignore[attr-defined]
        self.supports_quant_query_input = False  # queries reach forward_mqa in the model dtype, as a pair
        core.log_once(logger, startup_line(_member(), sel, model=str(cfg.model_config.model),
                                      num_heads=int(self.num_heads)))  # type: ignore[attr-defined]

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: Any, layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vLLM's decode call: ``q`` is ``(ql_nope [B, H, R], q_pe [B, H, rope])`` (or one ``[B, H, R + rope]``
        tensor), the cache ``[num_blocks, block_size, R + rope]``; returns ``(out [B, H, R], lse [B, H] or
        None)`` from the configured backend's ``forward_mqa`` under the step's plan."""
        d = attn_metadata.decode
        if not isinstance(d, MLABackendsDecodeMetadata) or d.batch is None or d.plan is None:
            raise RuntimeError("mla-backends: the decode metadata carries no BatchMetadata and plan; supported "
                               "metadata built by MLABackendsMetadataBuilder (the backend's own builder)")
        r = self.kv_lora_rank  # type: ignore[attr-defined]
        q_latent, q_rope = q if isinstance(q, tuple) else q.split([r, q.shape[-1] - r], dim=-1)
        data, scale = kv_c_and_k_pe_cache, 1.0
        if self.mla_fp8 is not None:  # read as the format it was written in (vLLM views every fp8 cache as e4m3)
            data = data if data.dtype == self.mla_fp8 else data.view(self.mla_fp8)
            scale = layer._k_scale_float
            written = self._mla_write_cache  # the CPU impl's own fp8 writes (None elsewhere)
            if written is not None and not _same_float32(written.scale_value, scale):
                raise RuntimeError(f"mla-backends: fp8 rows were written with k_scale {written.scale_value} and "
                                   f"would be read with {SCALE_ATTR} {scale}; supported one scale for both")
        cache = self.mla_caches.get("read", data, scale)
        out, lse = self.mla_backend.forward_mqa(q_latent, q_rope, cache, d.batch, scale=self.mla_scale,
                                                plan=d.plan)
        return out, (lse if self.need_to_return_lse_for_decode else None)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                           skip_scale: bool = False) -> None:
        """vLLM's own cache write; ``skip_scale`` (vLLM 0.33) is passed on when vLLM's base takes it."""
        base = super().do_kv_cache_update  # type: ignore[misc]
        if _takes_skip_scale(type(self)):
            base(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale=skip_scale)
            return
        if skip_scale:
            raise TypeError("skip_scale: got True; supported False on this vLLM (its cache write has no "
                            "skip_scale)")
        base(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)


class MLABackendsImpl(_DecodeOnMLABackends, MLACommonImpl[MLACommonMetadata]):
    """CUDA (and other GPU platforms): vLLM's common MLA impl with decode on mla-backends."""


def _cpu_impl_base() -> type:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    return CPUMLAImpl


class MLABackendsCPUImpl(_DecodeOnMLABackends, _cpu_impl_base()):  # type: ignore[misc]
    """vLLM's CPU platform: vLLM's CPU MLA impl (SDPA prefill, its cache write) with decode on mla-backends.
    fp8 caches are written here instead (vLLM's CPU write casts values to the cache's raw uint8, which is no
    fp8 encoding): rows quantised with the layer's ``k_scale`` by :meth:`LatentKVCache.write`."""

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                           skip_scale: bool = False) -> None:
        stored = self.mla_fp8  # the impl's kv_cache_dtype, which vLLM passes as kv_cache_dtype
        if stored is None or kv_cache.numel() == 0:
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                                       skip_scale=skip_scale)
            return
        if skip_scale:
            raise TypeError("skip_scale: got True; supported False for fp8 rows the plugin writes on the CPU "
                            "(they are always quantised with the layer's k_scale)")
        data = kv_cache if kv_cache.dtype == stored else kv_cache.view(stored)
        scale = float(k_scale.reshape(-1)[0])  # host memory on the CPU: no sync
        cache = self.mla_caches.get("write", data, scale)
        self._mla_write_cache = cache
        slots = slot_mapping.reshape(-1)
        n = slots.shape[0]
        cache.write(kv_c_normed[:n], k_pe[:n], slots)


class MLABackendsBackend(MLACommonBackend):
    """vLLM's view of mla-backends: registered as ``CUSTOM`` (and ``CPU_MLA`` on CPU) by the plugin."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type:
        return MLABackendsCPUImpl if current_platform.is_cpu() else MLABackendsImpl

    @staticmethod
    def get_builder_cls() -> type:
        return MLABackendsMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        d = _current_declarations()
        return list(d.head_sizes) if d is not None else [576]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        d = _current_declarations()
        if d is None or d.block_size_multiple is not None:
            return [MultipleOf(d.block_size_multiple if d is not None else 1)]
        return list(d.block_sizes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        d = _current_declarations()
        return dtype in (d.dtypes if d is not None else cls.supported_dtypes)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        d = _current_declarations()
        names = d.kv_cache_dtypes if d is not None else cls.supported_kv_cache_dtypes
        return kv_cache_dtype is None or kv_cache_dtype in names

    @classmethod
    def supports_dcp(cls) -> bool:
        d = _current_declarations()
        return bool(d is not None and d.returns_lse)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: Any, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                             device_capability: Any) -> str | None:
        """vLLM's validation hook (CUDA): the selection's reasons when mla-backends refuses this model."""
        cfg = get_current_vllm_config_or_none()
        if cfg is None or getattr(cfg, "model_config", None) is None:
            return None
        try:
            select_at_startup(request_from_vllm(cfg, device=_device()), _path())
        except VLLMSelectionError as exc:
            return str(exc)
        return None
