"""Backend names and lookup. (Minimal version; the plugin manager fills it through pluggy hooks.)"""

from __future__ import annotations

import difflib
import enum

from .backend import MLABackend

__all__ = ["BackendName", "get_backend", "registered_backends", "register_backend"]


class BackendName(str, enum.Enum):
    """Built-in backend names."""

    REF_TORCH = "REF_TORCH"
    TRITON_MLA = "TRITON_MLA"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    FLASHINFER_MLA_CUTLASS = "FLASHINFER_MLA_CUTLASS"
    FLASHINFER_MLA_TRTLLM = "FLASHINFER_MLA_TRTLLM"
    FLASHINFER_MLA_XQA = "FLASHINFER_MLA_XQA"


_REGISTRY: dict[str, type[MLABackend]] = {}


def register_backend(cls: type[MLABackend]) -> None:
    _REGISTRY[cls.name.upper()] = cls


def registered_backends() -> dict[str, type[MLABackend]]:
    if not _REGISTRY:
        from .ref_torch import RefTorchBackend

        register_backend(RefTorchBackend)
    return dict(_REGISTRY)


def get_backend(name: str | BackendName | type[MLABackend]) -> type[MLABackend]:
    """Resolve a backend by (case-insensitive) name, enum member or class."""
    if isinstance(name, type) and issubclass(name, MLABackend):
        return name
    if isinstance(name, BackendName):
        name = name.value
    if not isinstance(name, str):
        raise TypeError(f"backend: got {type(name).__name__}; supported a backend name or MLABackend subclass")
    reg = registered_backends()
    key = name.strip().upper()
    if key in reg:
        return reg[key]
    close = difflib.get_close_matches(key, list(reg), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"backend: got {name!r}; supported {', '.join(sorted(reg))}{hint}")
