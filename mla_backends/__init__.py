"""mla-backends: DeepSeek-style Multi-head Latent Attention on the best kernel for the hardware at hand.

Everything a host engine needs is importable from here. Heavy or optional pieces (the layer, the selector,
kernel packages) load lazily: ``import mla_backends`` never imports triton or flashinfer.
"""

from __future__ import annotations

import importlib
from typing import Any

from .backend import AttentionSpec, Capabilities, MLABackend, QueryLenSupport, Tolerance
from .cache import LatentKVCache
from .dims import IndexerDims, MLADims, RopeScaling
from .metadata import BatchMetadata

__version__ = "0.1.0"

# name -> module that defines it (imported on first attribute access)
_LAZY = {
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

__all__ = [
    "AttentionSpec", "BatchMetadata", "Capabilities", "IndexerDims", "LatentKVCache", "MLABackend", "MLADims",
    "QueryLenSupport", "RopeScaling", "Tolerance", "__version__", *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mla_backends' has no attribute {name!r}")
    module = importlib.import_module(mod, __name__) if mod.startswith(".") else importlib.import_module(mod)
    value = getattr(module, name)
    globals()[name] = value
    return value
