"""Probe the real device through NVML (``pynvml`` from ``nvidia-ml-py``), never through torch or CUDA.

NVML answers without creating a CUDA context, so detection is cheap and safe before fork. Every failure
(``pynvml`` not installed, ``NVMLError_LibraryNotFound`` on a machine without a driver, any other
``NVMLError``, no GPU) means "the CPU": detection never raises for a missing GPU. It logs why at debug level.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from mla_backends.core.device import CPU_DEVICE, DeviceInfo, parse_device_spec

__all__ = ["detect_device", "detect_devices", "resolve_device", "clear_device_cache"]

log = logging.getLogger(__name__)

_CACHE: dict[tuple[int, str | None], DeviceInfo] = {}
_LOCK = threading.Lock()


def clear_device_cache() -> None:
    """Forget probed devices (tests swap the ``pynvml`` module; a real driver does not change under us)."""
    with _LOCK:
        _CACHE.clear()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle(nvml: Any, index: int) -> Any:
    """NVML handle of logical CUDA device ``index``, honouring ``CUDA_VISIBLE_DEVICES`` (ints or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        if visible is not None:  # set but empty: CUDA sees no device
            raise IndexError("CUDA_VISIBLE_DEVICES is empty")
        return nvml.nvmlDeviceGetHandleByIndex(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise IndexError(f"index {index} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
    ident = ids[index]
    if ident.isascii() and ident.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(ident))
    return nvml.nvmlDeviceGetHandleByUUID(ident)


def _probe(index: int) -> DeviceInfo:
    try:
        import pynvml as nvml
    except ImportError as exc:
        log.debug("device probe: pynvml not importable (%s); using the CPU", exc)
        return CPU_DEVICE
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        log.debug("device probe: NVML unavailable (%s: %s); using the CPU", type(exc).__name__, exc)
        return CPU_DEVICE
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            log.debug("device probe: NVML reports no GPU; using the CPU")
            return CPU_DEVICE
        handle = _handle(nvml, index)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        name = _text(nvml.nvmlDeviceGetName(handle))
        try:
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception:  # memory info is informational only
            total = 0
        try:
            sm_count = int(nvml.nvmlDeviceGetAttributes(handle).multiprocessorCount)
        except Exception:
            sm_count = 0
        return DeviceInfo(kind="cuda", name=name, compute_capability=(int(major), int(minor)),
                          total_memory=total, index=index, sm_count=sm_count)
    except Exception as exc:  # NVMLError on the device queries, or index not visible
        log.debug("device probe: device %d unreadable (%s: %s); using the CPU", index, type(exc).__name__,
                  exc)
        return CPU_DEVICE
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def detect_device(index: int = 0) -> DeviceInfo:
    """The CUDA device ``index`` (logical, as torch numbers it) read through NVML, or the CPU.

    Cached per (index, ``CUDA_VISIBLE_DEVICES``); :func:`clear_device_cache` forgets the results.
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"device index: got {index!r}; supported an int >= 0")
    key = (index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    found = _CACHE.get(key)
    if found is None:
        found = _probe(index)
        with _LOCK:
            _CACHE[key] = found
    return found


def detect_devices() -> tuple[DeviceInfo, ...]:
    """Every CUDA device this process can see (logical indices 0, 1, ...; ``CUDA_VISIBLE_DEVICES``
    honoured), read through NVML; empty on a machine without a GPU, a driver or ``pynvml``. Never raises."""
    try:
        import pynvml as nvml
    except ImportError:
        return ()
    try:
        nvml.nvmlInit()
    except Exception as exc:
        log.debug("device list: NVML unavailable (%s: %s)", type(exc).__name__, exc)
        return ()
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:
        count = 0
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    found = []
    for index in range(count):
        dev = detect_device(index)
        if not dev.is_cuda:  # not visible under CUDA_VISIBLE_DEVICES, or unreadable: the list ends
            break
        found.append(dev)
    return tuple(found)


def resolve_device(device: object = None) -> DeviceInfo:
    """Any accepted device argument -> :class:`DeviceInfo` (probing NVML for ``None``/``"auto"``/an index)."""
    parsed = parse_device_spec(device)
    if isinstance(parsed, DeviceInfo):
        return parsed
    return detect_device(0 if parsed is None else parsed)
