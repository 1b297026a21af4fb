"""``FLASHINFER_MLA`` (fa2/fa3) and ``FLASHINFER_MLA_CUTLASS``: FlashInfer's paged MLA wrapper.

Each configured backend owns a pool of wrappers (:class:`~mla_backends.flashinfer_mla._common.WrapperPool`,
its resources); one 128 MiB workspace per (device, path) is shared by all. ``plan()`` runs once per step, in
``prepare`` (``plan_step``, outside any capture), on wrappers the step's state holds until it is dropped, and
``run()`` once per layer: nothing is planned in a layer call.
The cache is passed as the two strided views ``cache.latent [blocks, page, 512]`` and ``cache.rope [blocks,
page, 64]`` of the one 576-wide tensor; FlashInfer reads their strides (fa2/fa3) or recognises them as
adjacent halves of one packed row (cutlass), so nothing is copied.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..backends.contract import DEFAULT_TOLERANCES, AttentionSpec, Capabilities, QueryLenSupport, Tolerance
from ..backends.reasons import Reason, ReasonKind
from ..core.device import device_info_for
from ..core.dtypes import dtype_name, kv_cache_torch_dtype
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from . import api
from ._common import (
    FlashInferBackendBase,
    FlashInferStep,
    WrapperPool,
    deliver_outputs,
    dense_block_table,
    live_pages,
    output_buffers,
    pack_query,
    prepared_tables,
    run_padded_heads,
    scale_ratio,
)
from .fa_limits import fa_request_groups, fa_spec_reasons

__all__ = [
    "FlashInferMLABackend",
    "FlashInferCutlassMLABackend",
    "fa_backend_for",
    "fa_sm_count",
    "fa_plan_metadata",
    "plan_fa",
    "plan_cutlass",
    "cutlass_fixed_scale",
]

_DIMS = frozenset({(512, 64)})
_SM_COUNTS: dict[str, int] = {}
_ENTRY_POINTS = (("mla/_core.py", "BatchMLAPagedAttentionWrapper"), ("mla/_core.py", "MLAPlanMetadata"))


def fa_sm_count(device: torch.device) -> int:
    """SMs of a CUDA ``device`` (what FlashInfer's planner divides the work by); 0 for any other device."""
    if device.type != "cuda":
        return 0
    key = str(device)
    count = _SM_COUNTS.get(key)
    if count is None:
        count = _SM_COUNTS[key] = device_info_for(device).sm_count
    return count


def fa_backend_for(device: torch.device) -> str:
    """``fa3`` on SM90 (Hopper), ``fa2`` elsewhere (SM80/86/89)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        return "fa3"
    return "fa2"


def fa_plan_metadata(meta: BatchMetadata, requests: list[int] | None = None):
    """CSR ``MLAPlanMetadata`` of a batch (host int32 tensors; FlashInfer copies them to the device).

    ``qo_indptr [B+1]`` = query offsets, ``kv_len_arr [B]`` = seq lens, ``kv_indptr [B+1]`` = cumulative live
    page counts, ``kv_indices`` = the live block ids of every request, concatenated. ``requests``: plan only
    these (processing-order indices, ascending, their tokens contiguous); default every request.
    """
    if requests is None:
        requests = list(range(meta.num_requests))
    pages = [live_pages(meta)[b] for b in requests]
    rows = torch.tensor(requests, dtype=torch.int64)
    bt = meta.block_table.to("cpu", torch.int32)[rows]
    cols = torch.arange(bt.shape[1])[None, :]
    live = cols < torch.tensor(pages, dtype=torch.int64)[:, None]
    kv_indices = bt[live].contiguous()
    kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    if pages:
        kv_indptr[1:] = torch.tensor(pages, dtype=torch.int64).cumsum(0).to(torch.int32)
    q_lens = [meta.query_lens_list[b] for b in requests]
    qo_indptr = torch.zeros(len(requests) + 1, dtype=torch.int32)
    if requests:
        qo_indptr[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    kv_len_arr = torch.tensor([meta.seq_lens_list[b] for b in requests], dtype=torch.int32)
    return api.load_plan_metadata_class().csr(**api.csr_metadata_kwargs(qo_indptr, kv_indptr, kv_indices,
                                                                          kv_len_arr))


def plan_fa(wrapper, meta: BatchMetadata, *, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
            scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, requests: list[int] | None = None) -> None:
    """``wrapper.plan(...)`` for fa2/fa3 on ``meta`` (host sync: FlashInfer schedules on the CPU); ``requests``
    as for :func:`fa_plan_metadata`."""
    wrapper.plan(**api.fa_plan_kwargs(fa_plan_metadata(meta, requests), num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                                      rope_dim=rope_dim, page_size=page_size, sm_scale=scale, q_dtype=q_dtype,
                                      kv_dtype=kv_dtype))


def cutlass_fixed_scale(rope_dim: int) -> float:
    """The softmax scale FlashInfer's cutlass MLA kernel hard-codes: ``1 / sqrt(128 + head_dim_kpe)``."""
    return 1.0 / math.sqrt(128 + rope_dim)


def plan_cutlass(wrapper, meta: BatchMetadata, *, kv_lora_rank: int, rope_dim: int, page_size: int,
                 dtype: torch.dtype, table: torch.Tensor | None = None) -> None:
    """``wrapper.plan(...)`` for cutlass: dense metadata whose block-table width is a multiple of
    ``128 / page_size`` (FlashInfer's alignment rule), 128 heads, the kernel's fixed scale. ``table [B, W]``:
    the step's aligned table when already built (default: built here with :func:`dense_block_table`)."""
    if table is None:
        table = dense_block_table(meta, align=128 // page_size)
    metadata = api.load_plan_metadata_class().dense(**api.dense_metadata_kwargs(
        meta.query_start_loc.to(torch.int32).contiguous(), table, meta.seq_lens.to(torch.int32).contiguous(),
        max(1, meta.max_query_len)))
    wrapper.plan(**api.cutlass_plan_kwargs(metadata, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                                           page_size=page_size, sm_scale=cutlass_fixed_scale(rope_dim),
                                           dtype=dtype))


class FlashInferMLABackend(FlashInferBackendBase):
    """FlashInfer's paged MLA wrapper with the fa3 kernels on SM90 and fa2 on SM80/86/89.

    Any page size, any head count, variable query lengths (causal, bottom-right aligned), natural-log LSE.
    fp8_e4m3 caches only on SM90 with bfloat16 queries (FlashInfer's fa3 fp8 path, per-tensor scale).
    """

    name: ClassVar[str] = "FLASHINFER_MLA"
    description: ClassVar[str] = "FlashInfer BatchMLAPagedAttentionWrapper (fa3 on SM90, fa2 on SM80/86/89)"
    entry_points = _ENTRY_POINTS
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(8, 0), (8, 6), (8, 9), (9, 0)}),
        preferred_page_size=64,
        dims=_DIMS,
        query_len=QueryLenSupport.VARLEN,
        returns_lse=True,
        deterministic=True,
        requires=("flashinfer",),
        extra="flashinfer",
        # fp8: the kernels apply the cache scale rounded to bf16 (fa_limits.FA_FP8_SCALE_MAX_BIAS, up to
        # 2**-8 relative on every score and value); on the conformance fp8 cases (scales 0.37 and 3.1) that
        # bias alone needs up to 6e-3 (atol and rtol), so the bf16 budget grows by that much to cover it
        tolerances={**DEFAULT_TOLERANCES, "bfloat16/fp8_e4m3": Tolerance(DEFAULT_TOLERANCES["bfloat16"].atol + 6e-3,
                                                                          DEFAULT_TOLERANCES["bfloat16"].rtol + 6e-3)},
    )

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        reasons = super().backend_reasons(spec) + cls._kv_matches_query_reason(spec)
        if cls._resolved_kv(spec) == "fp8_e4m3":
            if spec.device.is_cuda and spec.device.compute_capability != (9, 0):
                c0, c1 = spec.device.compute_capability
                reasons.append(Reason(ReasonKind.FP8, "fp8 cache", f"SM{c0}{c1}",
                                      "SM90 only (FlashInfer's fa3 fp8 path)"))
            if spec.dtype != torch.bfloat16:
                reasons.append(Reason(ReasonKind.FP8, "fp8 cache", f"{dtype_name(spec.dtype)} queries",
                                      "bfloat16 queries"))
        # what FlashInfer's fa2/fa3 planner refuses (causal tile ends inside a token; the work-item cap)
        reasons += fa_spec_reasons(spec.num_heads, spec.max_query_len, spec.uniform_query_len,
                                   spec.device.sm_count)
        return reasons

    prepare_needs_configuration: ClassVar[bool] = True  # plan() needs heads, dtypes and the scale

    def make_resources(self) -> WrapperPool:
        """The configuration's :class:`~mla_backends.flashinfer_mla._common.WrapperPool`."""
        return WrapperPool()

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        """Run the step's planned wrappers; see :meth:`_launch`."""
        self._launch(q_latent, q_rope, cache, meta, scale=scale, out=out, lse_out=lse_out, state=state)

    def _launch(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata,
                *, scale: float, out: torch.Tensor | None, lse_out: torch.Tensor | None,
                fi_backend: str | None = None, state: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the wrappers ``state`` planned (:meth:`prepare`; a launch without a planned state plans its own,
        for this call) into ``out`` / ``lse_out`` (fresh buffers when None; returned); inputs already validated.
        ``fi_backend`` overrides fa2/fa3."""
        T, H, r = q_latent.shape
        dev = cache.device
        result, lse = output_buffers(q_latent, out, lse_out)
        if T:
            call = (fi_backend or fa_backend_for(dev), H, q_latent.dtype, cache.data.dtype, cache.block_size, r,
                    cache.qk_rope_head_dim, float(scale))
            step = state if isinstance(state, FlashInferStep) and state.planned else self._fa_step(meta, call)
            step.require_call(call, self.name)
            fp8_scale = cache.scale_value if cache.is_fp8 else None  # the host copy set_scale keeps: no sync
            q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
            starts = meta.query_starts_list
            for requests, wrapper in step.planned:  # one run per request group: most batches are one group
                rows = slice(starts[requests[0]], starts[requests[-1] + 1])
                whole = rows == slice(0, T)  # the caller's buffers themselves, not views of them
                wrapper.run(**api.fa_run_kwargs(
                    q_latent if whole else q_latent[rows], q_rope if whole else q_rope[rows], cache.latent,
                    cache.rope, out=result if whole else result[rows], lse=lse if whole else lse[rows],
                    fp8_scale=fp8_scale))
        return deliver_outputs(result, lse, out, lse_out)

    def _fa_step(self, meta: BatchMetadata, call: tuple[Any, ...]) -> FlashInferStep:
        """A :class:`~mla_backends.flashinfer_mla._common.FlashInferStep` with one wrapper of ``call``'s path
        planned per request group of the batch (:func:`fa_request_groups`: most batches are one group)."""
        fi_backend, num_heads, q_dtype, kv_dtype, page_size, rank, rope, scale = call
        groups = fa_request_groups(meta.query_lens_list, num_heads, fa_sm_count(meta.device))

        def plan(wrapper: Any, requests: list[int] | None) -> None:
            plan_fa(wrapper, meta, num_heads=num_heads, kv_lora_rank=rank, rope_dim=rope, page_size=page_size,
                    scale=scale, q_dtype=q_dtype, kv_dtype=kv_dtype, requests=requests)

        return self.planned_step(meta, call, groups, plan, {})

    def prepare(self, meta: BatchMetadata) -> FlashInferStep | None:
        """This step's state: ``plan()`` of the configured backend's wrappers for ``meta``'s request groups
        (heads, dtypes and scale from its configuration; the page size the configuration names, else the
        step's), once per step and outside any capture, so ``forward_mqa`` only runs them. None when
        unconfigured (each call then plans its own)."""
        spec, scale = self.layer_spec, self.layer_scale
        if spec is None or scale is None:
            return None
        if not meta.num_tokens:
            return FlashInferStep()
        kv_dtype = kv_cache_torch_dtype(spec.resolved_kv_cache_dtype, spec.dtype)
        call = (fa_backend_for(meta.device), spec.num_heads, spec.dtype, kv_dtype, meta.block_size,
                spec.kv_lora_rank, spec.qk_rope_head_dim, float(scale))
        return self._fa_step(meta, call)


class FlashInferCutlassMLABackend(FlashInferBackendBase):
    """FlashInfer's cutlass MLA decode (the wrapper's ``cutlass`` backend) on SM100/SM103/SM110.

    The kernel takes exactly 128 heads: fewer heads are zero-padded to 128 and the output sliced back. It
    hard-codes the softmax scale ``1/sqrt(192)``; the requested scale is folded into the query (multiplied
    by ``scale * sqrt(192)`` in float32 while packing, which the padding copy does anyway). Single-token
    decode only, no LSE.
    """

    name: ClassVar[str] = "FLASHINFER_MLA_CUTLASS"
    description: ClassVar[str] = "FlashInfer cutlass MLA decode (SM100/103/110; heads padded to 128; no LSE)"
    entry_points = _ENTRY_POINTS
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16"}),
        compute_capabilities=frozenset({(10, 0), (10, 3), (11, 0)}),
        page_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
        preferred_page_size=128,
        dims=_DIMS,
        max_num_heads=128,
        query_len=QueryLenSupport.SINGLE,
        returns_lse=False,
        requires=("flashinfer",),
        extra="flashinfer",
    )

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        return super().backend_reasons(spec) + cls._kv_matches_query_reason(spec)

    prepare_needs_configuration: ClassVar[bool] = True  # plan() needs the query dtype

    def make_resources(self) -> WrapperPool:
        """The configuration's :class:`~mla_backends.flashinfer_mla._common.WrapperPool`."""
        return WrapperPool()

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        """Pad and run the step's planned wrapper; the kernel reads the cache as one packed tensor."""
        if not cache.data.is_contiguous():
            raise ValueError("cache.data: got a non-contiguous tensor; supported a contiguous "
                             "[blocks, page, 576] tensor")
        self._launch(q_latent, q_rope, cache, meta, scale=scale, out=out, state=state)

    def _cutlass_step(self, meta: BatchMetadata, call: tuple[Any, ...]) -> FlashInferStep:
        """The wrapper of ``call`` (``("cutlass", dtype, page size, kv_lora_rank, rope)``) planned for ``meta``
        with its aligned table (FlashInfer's rule: a width multiple of ``128 / page_size``)."""
        _, dtype, page_size, rank, rope = call
        tables = prepared_tables(meta, 128 // page_size)

        def plan(wrapper: Any, requests: list[int] | None) -> None:
            plan_cutlass(wrapper, meta, kv_lora_rank=rank, rope_dim=rope, page_size=page_size, dtype=dtype,
                         table=tables[128 // page_size])

        return self.planned_step(meta, call, [list(range(meta.num_requests))], plan, tables)

    def prepare(self, meta: BatchMetadata) -> FlashInferStep | None:
        """This step's state: the aligned table and the configured backend's wrapper planned for ``meta``
        (once per step, outside any capture). None when unconfigured (each call then plans its own)."""
        spec = self.layer_spec
        if spec is None:
            return None
        if not meta.num_tokens:
            return FlashInferStep()
        return self._cutlass_step(meta, ("cutlass", spec.dtype, meta.block_size, spec.kv_lora_rank,
                                         spec.qk_rope_head_dim))

    def _launch(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata,
                *, scale: float, out: torch.Tensor | None, state: object | None = None) -> tuple[torch.Tensor, None]:
        """Pad and run the planned wrapper (a launch without a planned state plans its own, for this call) into
        ``out`` (returned, with None); inputs already validated."""
        r = q_latent.shape[2]
        rope = cache.qk_rope_head_dim
        heads = self.capabilities.max_num_heads  # the kernel's fixed head count; fewer heads are padded

        def launch(full: torch.Tensor) -> None:
            query = pack_query(q_latent, q_rope, num_heads=heads, dtype=q_latent.dtype,
                               multiplier=scale_ratio(scale, cutlass_fixed_scale(rope)))
            call = ("cutlass", q_latent.dtype, cache.block_size, r, rope)
            step = state if isinstance(state, FlashInferStep) and state.planned else self._cutlass_step(meta, call)
            step.require_call(call, self.name)
            for _, wrapper in step.planned:
                wrapper.run(**api.cutlass_run_kwargs(query, cache.latent, cache.rope, out=full))

        return run_padded_heads(q_latent, out, heads, launch), None
