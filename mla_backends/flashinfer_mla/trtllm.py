"""``FLASHINFER_MLA_TRTLLM``: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` (trtllm-gen cubins).

SM100/SM103 only; page size 32 or 64; at most 64 heads or exactly 128; bfloat16 queries over a bfloat16 or
fp8_e4m3 cache; one query length shared by every request of the batch (decode or speculative decode);
natural-log LSE. The cache tensor ``cache.data [blocks, page, 576]`` is passed as is (no copy).

fp8 caches: the kernel needs query and cache in one dtype, so the query is quantised to fp8_e4m3 with a
per-tensor scale ``amax(|q|) / 448`` computed on the device; the scales reach the kernel as float32 device
tensors (``bmm1_scale = q_scale * kv_scale * scale``, ``bmm2_scale = kv_scale``), so there is no host sync.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backends.contract import AttentionSpec, Capabilities, QueryLenSupport
from ..backends.reasons import Reason, ReasonKind
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from . import api
from ._common import (
    FlashInferBackendBase,
    FlashInferStep,
    deliver_outputs,
    fp8_query_scale,
    output_buffers,
    pack_query,
    prepared_tables,
    workspace_for,
)

__all__ = ["FlashInferTrtllmMLABackend"]


class FlashInferTrtllmMLABackend(FlashInferBackendBase):
    """trtllm-gen MLA decode on SM100/SM103 (bf16 or fp8_e4m3 cache, page 32/64, heads <= 64 or 128)."""

    name: ClassVar[str] = "FLASHINFER_MLA_TRTLLM"
    description: ClassVar[str] = ("FlashInfer trtllm-gen MLA decode (SM100/SM103; page 32/64; heads <= 64 or "
                                  "exactly 128)")
    entry_points = (("decode.py", "trtllm_batch_decode_with_kv_cache_mla"),)
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16}),
        kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(10, 0), (10, 3)}),
        page_sizes=(32, 64),
        preferred_page_size=64,
        dims=frozenset({(512, 64)}),
        max_num_heads=128,
        query_len=QueryLenSupport.UNIFORM,
        returns_lse=True,
        requires=("flashinfer",),
        extra="flashinfer",
    )
    HEADS_TEXT: ClassVar[str] = "<= 64 or exactly 128"

    @staticmethod
    def heads_ok(num_heads: int) -> bool:
        """trtllm-gen rejects ``64 < heads < 128`` (FlashInfer ``_trtllm_gen_mla_incompatibility_reason``)."""
        return 1 <= num_heads <= 64 or num_heads == 128

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        reasons = super().backend_reasons(spec)
        # more than max_num_heads is the base class's reason; this adds the gap below it
        if spec.num_heads <= cls.capabilities.max_num_heads and not cls.heads_ok(spec.num_heads):
            reasons.append(Reason(ReasonKind.NUM_HEADS, "num_heads", str(spec.num_heads), cls.HEADS_TEXT))
        return reasons

    def prepare(self, meta: BatchMetadata) -> FlashInferStep:
        """This step's state: its dense block table, made once per step (from host lengths; no configuration needed)."""
        return FlashInferStep(prepared_tables(meta, 1))

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        """Build the trtllm-gen call and run it into ``out`` / ``lse_out``."""
        self._launch(q_latent, q_rope, cache, meta, scale=scale, out=out, lse_out=lse_out, state=state)

    def _launch(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata,
                *, scale: float, out: torch.Tensor | None, lse_out: torch.Tensor | None,
                state: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Build the call and run it; inputs already validated (``state``: the step's prepared state)."""
        T, H, r = q_latent.shape
        dev = cache.device
        step = self.step_state(meta, state)
        result, lse = output_buffers(q_latent, out, lse_out)
        if T:
            B = meta.num_requests
            q_len = T // B
            bmm1: float | torch.Tensor
            bmm2: float | torch.Tensor
            if cache.is_fp8:
                q_scale = fp8_query_scale(q_latent, q_rope)
                query = pack_query(q_latent, q_rope, num_heads=H, dtype=cache.data.dtype,
                                   multiplier=q_scale.reciprocal())
                bmm1 = q_scale * cache.scale * float(scale)
                bmm2 = cache.scale
            else:
                query = pack_query(q_latent, q_rope, num_heads=H, dtype=cache.data.dtype)
                bmm1, bmm2 = float(scale), 1.0
            fn = api.load_trtllm_decode()
            fn(**api.trtllm_kwargs(
                query.view(B, q_len, H, query.shape[-1]), cache.data, workspace_for(dev, "trtllm"),
                kv_lora_rank=r, rope_dim=cache.qk_rope_head_dim, block_tables=step.block_table(meta),
                seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len, out=result.view(B, q_len, H, r),
                lse=lse, bmm1_scale=bmm1, bmm2_scale=bmm2))
        return deliver_outputs(result, lse, out, lse_out)
