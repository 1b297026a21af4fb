"""What the engines' Triton MLA decode peers (vLLM's and SGLang's) share: the cache they take and why the CPU runs
them only under Triton's interpreter, without bf16."""

from __future__ import annotations

import torch

from ...backends.capabilities import AttentionSpec
from ...backends.reasons import Reason, ReasonKind
from ...core.device import DeviceInfo
from ...core.dtypes import dtype_name
from ...triton_mla.interpreter import interpreter_enabled

__all__ = ["triton_peer_reasons", "interpreter_device_reasons", "TRITON_PEER_DEVICES"]

#: the devices of a Triton peer's declaration: CUDA, or the CPU under Triton's interpreter only
TRITON_PEER_DEVICES: dict[str, object] = {
    "cpu": False,
    "cpu_env_switch": "TRITON_INTERPRET",
    "cpu_hint": "requires a CUDA device, or TRITON_INTERPRET=1 for Triton's interpreter",
    "fp8_min_compute_capability": (8, 9),
}


def triton_peer_reasons(spec: AttentionSpec, engine: str) -> list[Reason | str]:
    """A Triton peer's own rules: the cache in the query dtype (``engine``'s ``auto``) or fp8 e4m3, and no bf16
    under the interpreter (a CPU), which truncates bf16 conversions and multiplies bf16 ``tl.dot`` operands
    wrongly."""
    reasons: list[Reason | str] = []
    kv = spec.resolved_kv_cache_dtype
    if kv != "fp8_e4m3" and kv != dtype_name(spec.dtype):
        reasons.append(Reason(ReasonKind.KV_CACHE_DTYPE, "kv cache dtype", f"{kv} with {dtype_name(spec.dtype)} "
                              "queries", f"the query dtype ({engine}'s 'auto') or fp8_e4m3"))
    if not spec.device.is_cuda and spec.dtype == torch.bfloat16:
        reasons.append(Reason(ReasonKind.DEVICE, "bfloat16 under Triton's interpreter", "CPU",
                              "a CUDA device (the interpreter truncates bf16 conversions and multiplies bf16 "
                              "tl.dot operands wrongly)"))
    return reasons


def interpreter_device_reasons(device: DeviceInfo) -> list[Reason]:
    """On a CPU, the interpreter must be on before the kernel is first called."""
    if not device.is_cuda and not interpreter_enabled():
        return [Reason(ReasonKind.DEVICE, "device", "CPU without TRITON_INTERPRET=1",
                       "TRITON_INTERPRET=1 set before the kernel is first called")]
    return []
