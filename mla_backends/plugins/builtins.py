"""The built-in backends, registered through the same ``register_mla_backends`` hook as any plugin.

Targets are given as ``module:Class`` so this module imports nothing heavy; the registry imports each module
when it loads (the backend modules themselves never import triton or flashinfer at import time).
"""

from __future__ import annotations

from .hookspecs import RegisterFn, hookimpl
from .registry import BackendName

__all__ = ["BUILTIN_BACKENDS", "register_mla_backends"]

#: built-in name -> "module:Class"
BUILTIN_BACKENDS: dict[BackendName, str] = {
    BackendName.REF_TORCH: "mla_backends.ref_torch:RefTorchBackend",
    BackendName.CPU_FUSED: "mla_backends.cpu_fused:CpuFusedBackend",
    BackendName.TRITON_MLA: "mla_backends.triton_mla:TritonMLABackend",
    BackendName.FLASHINFER_MLA: "mla_backends.flashinfer_mla:FlashInferMLABackend",
    BackendName.FLASHINFER_MLA_CUTLASS: "mla_backends.flashinfer_mla:FlashInferCutlassMLABackend",
    BackendName.FLASHINFER_MLA_TRTLLM: "mla_backends.flashinfer_mla:FlashInferTrtllmMLABackend",
    BackendName.FLASHINFER_MLA_XQA: "mla_backends.flashinfer_mla:FlashInferXqaMLABackend",
}


@hookimpl
def register_mla_backends(register: RegisterFn) -> None:
    """Register every built-in backend by import path (ladder positions live in ``selector.ladders``)."""
    for name, target in BUILTIN_BACKENDS.items():
        register(target, name=name.value)
