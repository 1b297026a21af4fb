"""Which fused attention kernel the expanded prefill runs (:func:`choose_prefill_kernel`), and the CUDA ones.

:func:`mla_backends.layer.prefill.prefill_attention` needs, for ``n`` queries over ``m`` keys of the same ``H``
heads, the output *and* the natural-log LSE (chunks are merged by it). torch has private fused kernels that
return both; which one runs is decided here from the device, its compute capability, the dtype, the head
widths and the mask, with the reason kept in a :class:`KernelChoice` (logged once per distinct choice at
DEBUG level on ``mla_backends.layer.prefill_kernels``):

======================  ==================================================  =====================================
kernel                  torch op                                            runs when
======================  ==================================================  =====================================
``cpu_flash``           ``aten::_scaled_dot_product_flash_attention_for_cpu``  CPU, float32/bf16/fp16 (float32 math)
``cuda_flash``          ``aten::_scaled_dot_product_flash_attention``       CUDA SM80+, bf16/fp16, one head width
                                                                            <= 256 and a multiple of 8 (the
                                                                            value is zero-padded to the key's)
``cuda_efficient``      ``aten::_scaled_dot_product_efficient_attention``   CUDA SM50+, bf16/fp16/float32, head
                                                                            widths multiples of 8 (4 in float32)
``plain``               matmuls (``prefill._plain_attention``)              everywhere else, float64 included
======================  ==================================================  =====================================

Conventions of the CUDA ops (torch 2.x, read from ``torch/_meta_registrations.py``): inputs ``[B, H, S, D]``
with unit last stride; ``_scaled_dot_product_flash_attention`` returns ``(out [B, H, S_q, D], logsumexp
[B, H, S_q], ...)``; ``_scaled_dot_product_efficient_attention`` returns ``(out [B, H, S_q, D_v], log_sumexp
[B, H, ceil(S_q / 32) * 32], ...)`` (padded: sliced here). Both LSEs are float32 natural logs. Both align a
causal mask top-left, so every fused kernel takes a causal part only when the queries are the keys
(``n == m``: the new tokens of one request among themselves). The rope key (``[m, P]``, shared by all heads)
is broadcast into a materialised ``[keys, H, N + P]`` key; keys go in chunks (and queries in blocks) so no
materialised tensor passes :data:`CUDA_FUSED_BYTES`, and the parts are merged by LSE.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.attention_math import merge_attention_states

__all__ = [
    "blocked_attention",
    "PrefillKernel",
    "KernelChoice",
    "TORCH_OPS",
    "CUDA_FUSED_BYTES",
    "fused_prefill_kernel",
    "torch_op",
    "kernel_problem",
    "choose_prefill_kernel",
    "cuda_fused_attention",
]

log = logging.getLogger(__name__)

#: most bytes one materialised key, padded value, query block or output block of a CUDA fused call takes
CUDA_FUSED_BYTES = 1 << 30


class PrefillKernel(enum.StrEnum):
    """The prefill attention kernels, in the order they are preferred on their device."""

    CPU_FLASH = "cpu_flash"
    CUDA_FLASH = "cuda_flash"
    CUDA_EFFICIENT = "cuda_efficient"
    PLAIN = "plain"


#: fused kernel -> the ``torch.ops.aten`` op it calls
TORCH_OPS: dict[PrefillKernel, str] = {
    PrefillKernel.CPU_FLASH: "_scaled_dot_product_flash_attention_for_cpu",
    PrefillKernel.CUDA_FLASH: "_scaled_dot_product_flash_attention",
    PrefillKernel.CUDA_EFFICIENT: "_scaled_dot_product_efficient_attention",
}
_CUDA_ORDER = (PrefillKernel.CUDA_FLASH, PrefillKernel.CUDA_EFFICIENT)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel :func:`choose_prefill_kernel` picked and why (``reason`` names what ruled out the ones
    preferred before it; for ``plain`` it is why no fused kernel applies)."""

    kernel: PrefillKernel
    reason: str

    @property
    def fused(self) -> bool:
        return self.kernel != PrefillKernel.PLAIN

    def __str__(self) -> str:
        return f"{self.kernel.value}: {self.reason}"


def torch_op(kernel: PrefillKernel) -> Callable[..., Any] | None:
    """The ``torch.ops.aten`` op of a fused ``kernel``, or None when this torch lacks it (or ``plain``)."""
    name = TORCH_OPS.get(kernel)
    if name is None:
        return None
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def fused_prefill_kernel() -> Callable[..., Any] | None:
    """torch's blocked CPU flash attention returning ``(out, logsumexp)``
    (``aten::_scaled_dot_product_flash_attention_for_cpu``, a private op), or None when this torch lacks it."""
    return torch_op(PrefillKernel.CPU_FLASH)


def kernel_problem(kernel: PrefillKernel, *, device_type: str, capability: tuple[int, int] | None,
                   dtype: torch.dtype, head_dim_qk: int, head_dim_v: int, n: int, m: int, causal: bool) -> str:
    """Why ``kernel`` cannot run ``n`` queries over ``m`` keys with these widths (empty string: it can)."""
    if kernel == PrefillKernel.PLAIN:
        return ""
    if m == 0 or n == 0:
        return f"{n} queries over {m} keys; it needs both"
    if causal and n != m:
        return f"causal with {n} queries over {m} keys; it aligns the mask top-left, so it needs n == m"
    if kernel == PrefillKernel.CPU_FLASH:
        if device_type != "cpu":
            return f"device {device_type}; it runs on the CPU only"
        if dtype == torch.float64:
            return "dtype float64; it computes in float32 (float64 keeps the plain path)"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype}; it takes float32, bfloat16, float16"
    else:
        if device_type != "cuda":
            return f"device {device_type}; it runs on CUDA only"
        cc = capability or (0, 0)
        if kernel == PrefillKernel.CUDA_FLASH:
            width = max(head_dim_qk, head_dim_v)
            if cc < (8, 0):
                return f"SM{cc[0]}{cc[1]}; it needs SM80 or newer"
            if dtype not in (torch.bfloat16, torch.float16):
                return f"dtype {str(dtype).removeprefix('torch.')}; it takes bfloat16, float16"
            if head_dim_v > head_dim_qk:
                return f"value width {head_dim_v} > key width {head_dim_qk}; it pads the value, never the key"
            if width > 256 or width % 8:
                return f"head width {width}; it takes one width <= 256, a multiple of 8"
        else:
            align = 4 if dtype == torch.float32 else 8
            if cc < (5, 0):
                return f"SM{cc[0]}{cc[1]}; it needs SM50 or newer"
            if dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return f"dtype {str(dtype).removeprefix('torch.')}; it takes bfloat16, float16, float32"
            if head_dim_qk % align or head_dim_v % align:
                return f"head widths {head_dim_qk}/{head_dim_v}; it takes multiples of {align}"
    if torch_op(kernel) is None:
        return f"torch {torch.__version__} has no aten::{TORCH_OPS[kernel]}"
    return ""


_LOGGED: set[tuple] = set()


def choose_prefill_kernel(device: torch.device, dtype: torch.dtype, *, head_dim_qk: int, head_dim_v: int, n: int,
                          m: int, causal: bool, capability: tuple[int, int] | None = None) -> KernelChoice:
    """The kernel for ``n`` queries over ``m`` keys (``head_dim_qk`` / ``head_dim_v`` wide) on ``device``.

    ``capability``: the CUDA device's ``(major, minor)``; read from ``device`` when None (pass it to ask
    about a device this machine does not have). The first fused kernel of the device's order that can run
    wins; otherwise ``plain``, with every fused kernel's obstacle in the reason.
    """
    if device.type == "cuda" and capability is None:
        capability = torch.cuda.get_device_capability(device)
    order = (PrefillKernel.CPU_FLASH,) if device.type == "cpu" else _CUDA_ORDER if device.type == "cuda" else ()
    ruled_out: list[str] = []
    for kernel in order:
        problem = kernel_problem(kernel, device_type=device.type, capability=capability, dtype=dtype,
                                 head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, n=n, m=m, causal=causal)
        if not problem:
            where = f"SM{capability[0]}{capability[1]}" if capability else device.type
            why = f"aten::{TORCH_OPS[kernel]} on {where}, {str(dtype).removeprefix('torch.')}"
            choice = KernelChoice(kernel, "; ".join([why] + [f"not {r}" for r in ruled_out]))
            break
        ruled_out.append(problem if device.type == "cpu" else f"{kernel.value}: {problem}")
    else:
        reason = "; ".join(ruled_out) or f"device {device.type}; the fused kernels run on the CPU and CUDA"
        choice = KernelChoice(PrefillKernel.PLAIN, reason)
    key = (choice.kernel, device.type, capability, dtype, head_dim_qk, head_dim_v, causal, n == m)
    if key not in _LOGGED and log.isEnabledFor(logging.DEBUG):
        _LOGGED.add(key)
        log.debug("prefill attention (%d x %d, causal=%s): %s", n, m, causal, choice)
    return choice


def _rows(heads: int, width: int, element_size: int) -> int:
    """Rows of a ``[rows, heads, width]`` tensor that fit :data:`CUDA_FUSED_BYTES`."""
    return max(1, CUDA_FUSED_BYTES // (heads * width * element_size))


def cuda_fused_attention(kernel: PrefillKernel, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                         k_pe: torch.Tensor, v: torch.Tensor, scale: float,
                         causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuda_flash`` or ``cuda_efficient`` attention: ``(o [n, H, V], lse [n, H])`` in float32.

    Args as :func:`mla_backends.layer.prefill.prefill_attention` (``q_nope [n, H, N]``, ``q_pe [n, H, P]``,
    ``k_nope [m, H, N]``, ``k_pe [m, P]``, ``v [m, H, V]``); the checks of :func:`kernel_problem` passed
    (causal only with ``n == m``). Computes in the inputs' dtype; each part's output is taken to float32
    before the LSE merge. ``cuda_flash`` pads the value to the key width and drops the padded columns.
    """
    op = torch_op(kernel)
    assert op is not None and kernel in _CUDA_ORDER
    n = q_nope.shape[0]
    m, H, N = k_nope.shape
    P, V = k_pe.shape[1], v.shape[2]
    D = N + P
    pad_v = D - V if kernel == PrefillKernel.CUDA_FLASH else 0  # kernel_problem: V <= D there
    dt = q_nope.dtype
    f32 = torch.float32
    block = _rows(H, max(D, V), torch.finfo(dt).bits // 8)

    def keys(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([k_nope[k0:k1], k_pe[k0:k1, None, :].expand(k1 - k0, H, P)], dim=-1)
        vv = torch.nn.functional.pad(v[k0:k1], (0, pad_v)) if pad_v else v[k0:k1]
        return k.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)  # [1, H, rows, D | V']

    def call(q: torch.Tensor, k: torch.Tensor, vv: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rows = q.shape[2]
        if kernel == PrefillKernel.CUDA_FLASH:
            res = op(q, k, vv, 0.0, masked, False, scale=scale)
        else:
            res = op(q, k, vv, None, True, 0.0, masked, scale=scale)
        o, lse = res[0], res[1]
        return o[0, :, :, :V].transpose(0, 1).to(f32), lse[0, :, :rows].transpose(0, 1).to(f32)

    def queries(i0: int, i1: int) -> torch.Tensor:
        return torch.cat([q_nope[i0:i1], q_pe[i0:i1]], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]

    return blocked_attention(n, m, block, causal, heads=H, v_dim=V, device=q_nope.device, queries=queries,
                             attend=lambda q, k0, k1, masked: call(q, *keys(k0, k1), masked))


def blocked_attention(
    n: int,
    m: int,
    block: int,
    causal: bool,
    *,
    heads: int,
    v_dim: int,
    device: torch.device,
    queries: Callable[[int, int], torch.Tensor],
    attend: Callable[[torch.Tensor, int, int, bool], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``n`` queries over ``m`` keys in ``block``-row query blocks and key chunks, merged by LSE.

    ``queries(i0, i1)`` gives the kernel's query operand for queries ``i0 .. i1 - 1``; ``attend(q, k0, k1,
    masked)`` runs the kernel on it over keys ``k0 .. k1 - 1`` and returns ``(o [rows, H, V], lse [rows, H])``
    in float32 (``masked``: the kernel's top-left causal mask). Causal (queries are the keys, ``n == m``): a
    query block attends the keys before it unmasked and its own diagonal block masked.
    Returns ``(o [n, heads, v_dim], lse [n, heads])`` float32 on ``device``.
    """
    f32 = torch.float32
    o_all = torch.empty(n, heads, v_dim, dtype=f32, device=device)
    lse_all = torch.empty(n, heads, dtype=f32, device=device)
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        q = queries(i0, i1)
        stop = i0 if causal else m
        parts = [(k0, min(k0 + block, stop), False) for k0 in range(0, stop, block)]
        if causal:
            parts.append((i0, i1, True))  # the diagonal block: these queries are these keys
        o_acc: torch.Tensor | None = None
        lse_acc: torch.Tensor | None = None
        for k0, k1, masked in parts:
            o, lse = attend(q, k0, k1, masked)
            if o_acc is None or lse_acc is None:
                o_acc, lse_acc = o, lse
            else:
                o_acc, lse_acc = merge_attention_states(o_acc, lse_acc, o, lse)
        assert o_acc is not None and lse_acc is not None
        o_all[i0:i1] = o_acc
        lse_all[i0:i1] = lse_acc
    return o_all, lse_all
