"""Compiled CPU decode backend (``CPU_FUSED``): one C++ kernel that reads each cached row once, built per machine
on first use or by ``mla-backends build`` (never at import)."""

from .backend import CpuFusedBackend

__all__ = ["CpuFusedBackend"]
