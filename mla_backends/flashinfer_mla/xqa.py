"""``FLASHINFER_MLA_XQA``: ``flashinfer.decode.xqa_batch_decode_with_kv_cache_mla`` on SM120/SM121.

The XQA MLA kernel takes exactly 128 query heads (one KV head, head-group ratio 128), one query token per
request, query and cache in one dtype (both bfloat16 or both fp8_e4m3), page sizes 16/32/64/128 in
flashinfer-python 0.7.4 (``gen_xqa_module_mla``), a block table whose width is a multiple of
``128 / page_size``, and returns no LSE. Fewer heads are zero-padded to 128 and the output sliced back.

fp8 caches: the query is quantised to fp8_e4m3 with the per-tensor scale ``amax(|q|) / 448``. The scales reach
the kernel as float32 device tensors ``[1]`` (``bmm1 = q_scale * kv_scale * scale``, ``bmm2 = kv_scale``; XQA
reads ``ptr[0]`` in place of its float argument), so the fp8 path makes no host sync either.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backends.contract import Capabilities, QueryLenSupport
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from . import api
from ._common import (
    FlashInferBackendBase,
    FlashInferStep,
    fp8_query_scale,
    pack_query,
    prepared_tables,
    run_padded_heads,
    workspace_for,
)

__all__ = ["FlashInferXqaMLABackend"]


class FlashInferXqaMLABackend(FlashInferBackendBase):
    """XQA MLA decode on SM120/SM121 (consumer/workstation Blackwell): bf16 or fp8, q length 1, no LSE."""

    name: ClassVar[str] = "FLASHINFER_MLA_XQA"
    description: ClassVar[str] = "FlashInfer XQA MLA decode (SM120/SM121; heads padded to 128; no LSE)"
    entry_points = (("decode.py", "xqa_batch_decode_with_kv_cache_mla"),)
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16}),
        kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(12, 0), (12, 1)}),
        page_sizes=(16, 32, 64, 128),
        preferred_page_size=64,
        dims=frozenset({(512, 64)}),
        max_num_heads=128,
        query_len=QueryLenSupport.SINGLE,
        returns_lse=False,
        requires=("flashinfer",),
        extra="flashinfer",
    )

    def prepare(self, meta: BatchMetadata) -> FlashInferStep:
        """This step's state: its dense block table, its width a multiple of ``128 / page_size``, made once per
        step (from host lengths; no configuration needed)."""
        return FlashInferStep(prepared_tables(meta, max(1, 128 // meta.block_size)))

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        """Pad, quantise (fp8) and run into ``out``."""
        self._launch(q_latent, q_rope, cache, meta, scale=scale, out=out, state=state)

    def _launch(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata,
                *, scale: float, out: torch.Tensor | None,
                state: object | None = None) -> tuple[torch.Tensor, None]:
        """Pad, quantise (fp8) and run; inputs already validated (``state``: the step's prepared state)."""
        step = self.step_state(meta, state)
        heads = self.capabilities.max_num_heads  # the kernel's fixed head count; fewer heads are padded

        def launch(full: torch.Tensor) -> None:
            bmm1: float | torch.Tensor
            bmm2: float | torch.Tensor
            T, _, r = full.shape
            dev = cache.device
            if cache.is_fp8:
                q_scale = fp8_query_scale(q_latent, q_rope)  # float32 [1] on the device
                query = pack_query(q_latent, q_rope, num_heads=heads, dtype=cache.data.dtype,
                                   multiplier=q_scale.reciprocal())
                bmm1, bmm2 = q_scale * cache.scale * float(scale), cache.scale
            else:
                query = pack_query(q_latent, q_rope, num_heads=heads, dtype=cache.data.dtype)
                bmm1, bmm2 = float(scale), 1.0  # floats: XQA takes tensor scales on its fp8 path only
            fn = api.load_xqa_decode()
            fn(**api.xqa_kwargs(
                query.view(T, 1, heads, query.shape[-1]), cache.data, workspace_for(dev, "xqa"),
                kv_lora_rank=r, rope_dim=cache.qk_rope_head_dim,
                block_tables=step.block_table(meta, align=max(1, 128 // cache.block_size)),
                seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len, out=full, bmm1_scale=bmm1,
                bmm2_scale=bmm2))

        return run_padded_heads(q_latent, out, heads, launch), None
