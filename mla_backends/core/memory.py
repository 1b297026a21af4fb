"""How much memory a device has free, and refusing work that cannot fit before anything is allocated.

Used by :mod:`mla_backends.planning.tuning` (the timing cache and queries of ``mla-backends tune``): a grid whose
largest context cannot fit is a ``ValueError`` naming the argument, not an out-of-memory crash half-way.
"""

from __future__ import annotations

import os

import torch

__all__ = ["available_bytes", "require_fits"]

_GIB = 1 << 30


def available_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (CUDA: ``torch.cuda.mem_get_info``; CPU: the kernel's
    ``MemAvailable``, else physical memory); None when it cannot be told (the check then passes)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def require_fits(name: str, given: object, need_bytes: int, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` naming ``name`` (whose value was ``given``) when ``need_bytes`` for ``what`` exceed
    the memory free on ``device``."""
    free = available_bytes(device)
    if free is not None and need_bytes > free:
        raise ValueError(f"{name}: got {given}, which needs about {need_bytes / _GIB:,.1f} GiB for {what}; "
                         f"supported sizes that fit the {free / _GIB:,.1f} GiB free on {device}")
