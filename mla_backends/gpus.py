"""A minimal GPU table for sizing (``mla-backends kv-cache --gpu NAME``): memory as the vendor states it
(GB = 10**9 bytes, so an H200 is 141e9 bytes), memory bandwidth, dense tensor-core peaks, compute capability
and SM count. (Placeholder until the package's shared GPU table lands; the fields are the ones it keeps.)"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUSpec", "GPUS", "gpu_spec"]


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model: ``memory_bytes`` (vendor GB, 10**9), ``bandwidth_bytes_per_s``, dense ``bf16_tflops`` /
    ``fp8_tflops`` (None: no fp8 tensor cores), ``compute_capability`` ``(major, minor)``, ``sms``."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    compute_capability: tuple[int, int]
    sms: int


GPUS: dict[str, GPUSpec] = {
    "a100": GPUSpec("A100 SXM 80GB", 80 * 10**9, 2.039e12, 312.0, None, (8, 0), 108),
    "h100": GPUSpec("H100 SXM", 80 * 10**9, 3.35e12, 989.4, 1978.9, (9, 0), 132),
    "h200": GPUSpec("H200 SXM", 141 * 10**9, 4.8e12, 989.4, 1978.9, (9, 0), 132),
    "b200": GPUSpec("B200", 180 * 10**9, 8.0e12, 2250.0, 4500.0, (10, 0), 148),
}


def gpu_spec(name: str) -> GPUSpec:
    """The table entry for ``name`` (case-insensitive; ``"H200"``, ``"h200"``)."""
    if not isinstance(name, str):
        raise TypeError(f"gpu: got {type(name).__name__}; supported a GPU name ({', '.join(GPUS)})")
    key = name.strip().lower().replace("-", "").replace(" ", "")
    for suffix in ("sxm", "80gb"):
        key = key.removesuffix(suffix)
    if key not in GPUS:
        raise ValueError(f"gpu: got {name!r}; supported {', '.join(GPUS)}")
    return GPUS[key]
