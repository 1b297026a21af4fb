"""Backend selection for MLA: device detection, per-architecture ladders (data), overrides, explanations.

Attributes load lazily. ``DeviceInfo`` lives in ``mla_backends.core.device`` (``selector.device`` re-exports it).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DeviceInfo": "mla_backends.core.device",
    "select_backend": "selector.select",
    "Selection": "selector.select",
    "SelectionError": "selector.select",
    "NoBackendError": "selector.select",
    "BackendNotSupportedError": "selector.select",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'selector' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
