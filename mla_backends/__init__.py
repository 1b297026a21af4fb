"""mla-backends: DeepSeek-style Multi-head Latent Attention on the best kernel for the hardware at hand.

Everything a host engine needs is importable from here. Every public name loads on first use (a module
``__getattr__``): ``import mla_backends`` imports neither torch nor triton nor flashinfer, so
``mla-backends --version`` answers without torch; ``from mla_backends import MLADims`` imports what that name
needs.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it (imported on first attribute access)
_LAZY = {
    "AttentionSpec": ".backend",
    "Capabilities": ".backend",
    "MLABackend": ".backend",
    "QueryLenSupport": ".backend",
    "Tolerance": ".backend",
    "LatentKVCache": ".cache",
    "IndexerDims": ".dims",
    "MLADims": ".dims",
    "RopeScaling": ".dims",
    "BatchMetadata": ".metadata",
    "StepPlan": ".step_plan",
    "StepPlanError": ".step_plan",
    "PlanRequest": ".step_plan",
    "Run": ".step_plan",
    "plan_step": ".step_plan",
    "BackendName": ".registry",
    "get_backend": ".plugins",
    "registered_backends": ".plugins",
    "RefTorchBackend": ".ref_torch",
    "MLAAttention": ".layer",
    "load_attention_layers": ".pretrained",
    "Checkpoint": ".checkpoint",
    "forward_mha": ".prefill",
    "select_backend": "selector",
    "Selection": "selector",
    "NoBackendError": "selector",
    "BackendNotSupportedError": "selector",
    "DeviceInfo": ".device",
    "Indexer": ".sparse",
    "IndexerKeyCache": ".sparse",
    "SparseKVCache": ".sparse",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mla_backends' has no attribute {name!r}")
    module = importlib.import_module(mod, __name__) if mod.startswith(".") else importlib.import_module(mod)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
