"""SGLang's own MLA decode kernel as a third-party backend, called exactly as SGLang's Triton backend calls it.

:class:`SglangTritonMLADecode`: ``sglang.kernels.ops.attention.decode_attention.decode_attention_fwd``, the kernel
``TritonAttnBackend.forward_decode`` launches for an MLA model (``sglang/srt/layers/attention/triton_backend.py``;
SGLang 0.5.23): the query ``[B, H, kv_lora_rank + rope]``, the layer's key buffer ``[slots, 1, 576]`` (one KV
head) and its value buffer (the first ``kv_lora_rank`` columns of the same rows), token-level ``kv_indptr`` /
``kv_indices`` (one flat slot per position, ``slot = page * page_size + offset``) with ``page_size`` passed for
the page-aware address arithmetic, float32 split scratch ``attn_logits [B, H, max_kv_splits, kv_lora_rank]`` and
``attn_lse [B, H, max_kv_splits]``, SGLang's default ``max_kv_splits`` (``--triton-attention-num-kv-splits``, 8)
and its per-request split counts (``get_num_kv_splits``: every request ``max_kv_splits`` on a device without a
core count, as on a CPU; SGLang's own ``get_num_kv_splits_triton`` on a GPU), the layer's ``k_scale`` /
``v_scale`` as ``k_descale`` / ``v_descale`` (1.0 without an fp8 cache), ``has_mla=True``, ``page_size`` the
cache's. SGLang's decode returns no LSE; its decode-context-parallel path derives one from the same call as
``logsumexp`` over the splits' LSEs (``attn_lse`` filled with ``-inf`` first): that is the LSE returned here.

The kernel casts the query to the cache's storage dtype before the score product (``q.to(K_Buffer.dtype)``) and the
probabilities to it before the value product, so an fp8 cache means fp8 query and probability products: declared
with an explicit band (:data:`FP8_QUERY_TOLERANCE`). On a CPU it runs under Triton's interpreter, whose bf16
conversions truncate and whose fp8 conversions are not exactly the GPU's: the interpreted variant withholds bf16
and the fp8 cache. Nothing
here imports sglang or triton before the first kernel call.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import ClassVar

import torch

from ...backends.capabilities import AttentionSpec
from ...backends.contract import Capabilities, MLABackend, Precision, QueryLenSupport, Tolerance
from ...backends.reasons import Reason
from ...step.cache import LatentKVCache, position_slots
from ...step.metadata import BatchMetadata
from ._triton_peers import TRITON_PEER_DEVICES, interpreter_device_reasons, triton_peer_reasons

__all__ = ["SglangTritonMLADecode", "DECODE_MODULE", "MAX_KV_SPLITS", "FP8_QUERY_TOLERANCE", "SIXTEEN_BIT_PRODUCTS"]

#: the module holding SGLang's Triton decode kernel (0.5.23; ``srt/layers/attention/triton_ops`` before it)
DECODE_MODULE = "sglang.kernels.ops.attention.decode_attention"
#: SGLang's default ``--triton-attention-num-kv-splits``
MAX_KV_SPLITS = 8
#: with an fp8 cache and more than one head the kernel rounds the queries to fp8 before the score product
#: (``q.to(K_Buffer.dtype)``, no scale: 2**-4 relative error per element, about 0.1 in a score) and the
#: probabilities to fp8 before the value product (``p.to(v.dtype)``). Measured under Triton's interpreter (whose
#: fp8 conversions are nearly, not exactly, round-to-nearest) on the suite's cases: output errors up to 0.92 and
#: LSE errors up to 0.65; a GPU run measures the compiled kernel (``docs/conformance.md``)
FP8_QUERY_TOLERANCE = Tolerance(1.2, 0.1)
#: with one head SGLang takes its MHA kernel (``_fwd_kernel_stage1``), whose scores are ``tl.sum(q * k)``: each
#: product rounded to the 16-bit query dtype before the sum (on the suite's fp16 cases: LSE errors of 8e-4, four
#: times a float32-accumulating kernel's allowance), so 16-bit queries are declared 16-bit-accumulating; the LSE
#: (``logsumexp`` of the float32 split LSEs) stays float32
SIXTEEN_BIT_PRODUCTS = {"float16": Precision(torch.float16, torch.float32),
                        "bfloat16": Precision(torch.bfloat16, torch.float32)}


class SglangTritonMLADecode(MLABackend):
    """SGLang's Triton MLA decode (``decode_attention_fwd``), launched as ``TritonAttnBackend.forward_decode`` does.

    Declared as SGLang runs it for DeepSeek: the cache in the query dtype or fp8 e4m3, any page size, 512/64 and
    256/32 dims (the kernel's split of a 576- or 288-wide row; others are not MLA there), any head count, one
    query token per request (SGLang's speculative verification runs the extend kernel, not this one), an LSE as
    SGLang's context-parallel path derives it.
    """

    name: ClassVar[str] = "SGLANG_TRITON_MLA_DECODE"
    description: ClassVar[str] = ("SGLang's Triton MLA decode kernel (decode_attention.decode_attention_fwd) as "
                                  "TritonAttnBackend calls it")
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3"}),
        **TRITON_PEER_DEVICES,  # type: ignore[arg-type]
        min_compute_capability=(8, 0),
        page_sizes=None,
        preferred_page_size=16,
        dims=frozenset({(512, 64), (256, 32)}),
        query_len=QueryLenSupport.SINGLE,
        returns_lse=True,
        deterministic=True,
        requires=("sglang", "triton"),
        tolerances={"fp8_e4m3": FP8_QUERY_TOLERANCE},
        precision=dict(SIXTEEN_BIT_PRODUCTS),
    )

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        return triton_peer_reasons(spec, "SGLang")

    @classmethod
    def interpreted(cls) -> type[SglangTritonMLADecode]:
        """The kernel as Triton's interpreter runs it on a CPU: declared for the CPU, bf16 and fp8 withheld."""
        return _INTERPRETED

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        from ...triton_mla.interpreter import launch_guard

        kernels = importlib.import_module(DECODE_MODULE)
        r, P = cache.kv_lora_rank, cache.block_size
        q = torch.cat((q_latent, q_rope), dim=-1)  # forward_decode: q.view(-1, H, qk_head_dim)
        B, H = q.shape[0], q.shape[1]
        o = torch.empty(B, H, r, dtype=q.dtype, device=q.device)  # q.new_empty((..., H * v_head_dim))
        k_buffer = cache.data.view(-1, 1, cache.row_width)  # MLATokenToKVPool.get_key_buffer: [slots, 1, 576]
        v_buffer = k_buffer[..., :r]  # get_value_buffer: the latent columns of the same rows
        lens = meta.seq_lens_list
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
        kv_indptr[1:] = torch.cumsum(meta.seq_lens.to(torch.int32), 0)
        req = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lens)]).to(q.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(q.device)
        kv_indices = position_slots(meta.block_table, req, pos, P)  # token-level: one flat slot per position
        attn_logits = torch.empty(B, H, MAX_KV_SPLITS, r, dtype=torch.float32, device=q.device)
        attn_lse = torch.full((B, H, MAX_KV_SPLITS), float("-inf"), dtype=torch.float32, device=q.device)
        num_kv_splits = self._num_kv_splits(meta, H, q.device)
        descale = float(cache.scale_value) if cache.is_fp8 else 1.0  # layer.k_scale_float / v_scale_float
        with launch_guard(q.device.type != "cuda"):
            kernels.decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                                         num_kv_splits, MAX_KV_SPLITS, scale, descale, descale, has_mla=True,
                                         page_size=P)
        out.copy_(o)
        if lse_out is not None:  # the context-parallel path's LSE: logsumexp over the splits
            lse_out.copy_(torch.logsumexp(attn_lse, dim=-1))

    @staticmethod
    def _num_kv_splits(meta: BatchMetadata, num_heads: int, device: torch.device) -> torch.Tensor:
        """``TritonAttnBackend.get_num_kv_splits``: ``max_kv_splits`` for every request where the device reports
        no core count (a CPU), else SGLang's ``get_num_kv_splits_triton`` with the SM count."""
        splits = torch.full((meta.num_requests,), MAX_KV_SPLITS, dtype=torch.int32, device=device)
        if device.type != "cuda":
            return splits
        metadata = importlib.import_module("sglang.kernels.ops.attention.metadata")
        cores = torch.cuda.get_device_properties(device).multi_processor_count
        schedule = 256 if meta.num_requests < 256 else 1 << (meta.num_requests - 1).bit_length()
        metadata.get_num_kv_splits_triton[(1,)](splits, meta.seq_lens.to(torch.int32), meta.num_requests, 1,
                                                num_heads, 1, MAX_KV_SPLITS, cores, MAX_NUM_SEQ=schedule)
        return splits


class _InterpretedSglangTritonMLADecode(SglangTritonMLADecode):
    """:class:`SglangTritonMLADecode` under Triton's interpreter (``TRITON_INTERPRET=1``): the CPU; no bf16 (the
    interpreter truncates bf16 conversions) and no fp8 cache (the kernel rounds queries and probabilities to fp8,
    and the interpreter's fp8 conversions are not the GPU's)."""

    name: ClassVar[str] = "SGLANG_TRITON_MLA_DECODE"
    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        SglangTritonMLADecode.capabilities,
        dtypes=frozenset({torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"float16", "float32"}),
        cpu=True, cpu_env_switch=None, cpu_hint=None,
    )

    @classmethod
    def device_reasons(cls, device):  # type: ignore[no-untyped-def]
        return super().device_reasons(device) + interpreter_device_reasons(device)


_INTERPRETED = _InterpretedSglangTritonMLADecode
