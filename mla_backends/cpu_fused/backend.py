"""``CPU_FUSED``: absorbed MLA decode on the CPU in one compiled kernel that reads each cached row once.

The kernel (``csrc/mla_decode.cpp``, built by :mod:`mla_backends.cpu_fused.build`) walks each request's pages
through its block table and, for every tile of rows, computes the scores of all heads (and all new tokens of
a multi-token decode, causal among them), updates an online softmax and adds ``P x latent`` into fp32
accumulators while the tile is in cache. Rows are read in their stored width: fp32 straight from the page,
bf16 / fp16 / fp8 (e4m3, e5m2, times the cache's scale, in the order ``LatentKVCache.dequantize`` uses)
widened in registers. Work is cut into (request, head group, KV split) tasks by
:mod:`mla_backends.cpu_fused.plan`, once per step in :meth:`CpuFusedBackend.prepare`, and run on torch's
intra-op threads; splits are merged by their LSE.

The backend is selectable only where the kernel is built for this machine: otherwise
:meth:`CpuFusedBackend.backend_reasons` gives a ``PACKAGE`` reason saying what is missing and how to add it,
and the CPU ladder's next entry (``REF_TORCH``) serves. Selection never builds; ``mla-backends build`` (or
the first ``forward_mqa`` of an instance made by hand) does.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backends.capabilities import AttentionSpec
from ..backends.contract import Capabilities, MLABackend, QueryLenSupport
from ..backends.reasons import Reason, ReasonKind
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from . import build as _build
from .plan import FusedStep, plan_work

__all__ = ["CpuFusedBackend", "DIM_MULTIPLE"]

#: kv_lora_rank and qk_rope_head_dim must be multiples of this (the kernel's widest vector, 16 floats)
DIM_MULTIPLE = 16


class CpuFusedBackend(MLABackend):
    """The compiled CPU decode kernel: fp32/bf16/fp16 queries, fp32/bf16/fp16/fp8 caches, any page size,
    multi-token decode, LSE out; dense only."""

    name: ClassVar[str] = "CPU_FUSED"
    description: ClassVar[str] = ("compiled CPU decode (C++, AVX2/AVX-512): reads each cached row once, fused "
                                  "score, softmax and value sum, KV splits")
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
        cpu=True,
        compute_capabilities=frozenset(),  # the CPU only
        preferred_page_size=16,
        query_len=QueryLenSupport.VARLEN,
        decode_threshold=1,
        dense=True,
        sparse=False,
        returns_lse=True,
        host_sync_free=True,  # sizes come from the metadata's host lists; nothing reads a device value
        cuda_graphs=False,
    )

    @classmethod
    def build_reasons(cls) -> list[Reason]:
        """The ``PACKAGE`` reason the kernel cannot run here (not built for this machine, and what a build
        needs), or nothing when it is built. File checks only (none once the library is loaded in this
        process): never builds (the selector asks this)."""
        if _build.is_built():
            return []
        st = _build.build_status()
        if st.missing:
            how = f"install {' and '.join(st.missing)}, then run `mla-backends build`"
        else:
            how = f"run `mla-backends build` (compiles with {st.compiler}, about a minute)"
        return [Reason(ReasonKind.PACKAGE, "compiled kernel", "not built for this machine",
                       f"built ({st.path.parent})", hint=how)]

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        """Dims the kernel's vectors cannot take, and a kernel not built for this machine
        (:meth:`build_reasons`)."""
        reasons: list[Reason | str] = []
        if spec.kv_lora_rank % DIM_MULTIPLE or spec.qk_rope_head_dim % DIM_MULTIPLE:
            reasons.append(Reason(ReasonKind.DIMS, "kv_lora_rank/qk_rope_head_dim",
                                  f"{spec.kv_lora_rank}/{spec.qk_rope_head_dim}", f"multiples of {DIM_MULTIPLE}"))
        if not spec.device.is_cuda:
            reasons += cls.build_reasons()
        return reasons

    def prepare(self, meta: BatchMetadata) -> FusedStep | None:
        """This step's work list (:func:`~mla_backends.cpu_fused.plan.plan_work`) for the configured head count
        and torch's thread count, from the metadata's host lists; None for an instance not configured by a
        layer (its calls then plan for themselves)."""
        spec = self.layer_spec
        if spec is None or not meta.num_tokens:
            return None
        return plan_work(meta.query_lens_list, meta.context_lens_list, spec.num_heads, torch.get_num_threads())

    def forward_mqa_kernel(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentKVCache,
        meta: BatchMetadata,
        *,
        scale: float,
        topk_indices: torch.Tensor | None,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        state: object | None,
    ) -> None:
        """One call of the compiled kernel over ``meta``'s requests, writing ``out [T, H, r]`` and
        ``lse_out [T, H]`` in place (any strides); ``state`` is this step's :class:`FusedStep`, or None (an
        unconfigured instance, or one configured for another head count: the work list is made here)."""
        assert lse_out is not None and topk_indices is None  # returns_lse, dense only: forward_mqa checked
        op = _build.decode_op()
        H = q_latent.shape[1]
        step = state if isinstance(state, FusedStep) and state.heads == H else None
        if step is None:
            step = plan_work(meta.query_lens_list, meta.context_lens_list, H, torch.get_num_threads())
        op(q_latent, q_rope, cache.data, meta.block_table, step.requests, step.items, step.merges, float(scale),
           float(cache.scale_value), step.num_slots, step.slot_lanes, step.threads, out, lse_out)
