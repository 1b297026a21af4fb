"""``selector.device``: the device description, kept importable here for the public API.

It lives in :mod:`mla_backends.core.device` (backends and the layer use it, and ``mla_backends`` never imports the
selector); this module re-exports it unchanged. NVML probing is :mod:`selector.detect`.
"""

from __future__ import annotations

from mla_backends.core.device import (
    CPU_DEVICE,
    SIMULATED_NAMES,
    DeviceInfo,
    cuda_device_index,
    device_info_for,
    parse_device_spec,
    simulated_device,
)

__all__ = ["DeviceInfo", "CPU_DEVICE", "SIMULATED_NAMES", "simulated_device", "parse_device_spec",
           "cuda_device_index", "device_info_for"]
