"""mla-backends: DeepSeek-style Multi-head Latent Attention on the best kernel for the hardware at hand.

Everything a host engine needs is importable from here. Every public name loads on first use (a module
``__getattr__``): ``import mla_backends`` imports neither torch nor triton nor flashinfer, so
``mla-backends --version`` answers without torch; ``from mla_backends import MLADims`` imports what that name
needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _legacy

__version__ = "0.4.0"

# name -> module that defines it (imported on first attribute access). This is the public API: what an engine
# builder and a kernel author import. Everything else is internal and may move (docs/architecture.md, "What is
# public"); the modules under the sub-packages are not API.
_LAZY = {
    # the shape of a layer
    "MLADims": ".core.dims",
    "IndexerDims": ".core.dims",
    "RopeScaling": ".core.dims",
    "V4Dims": ".core.v4dims",
    "DeviceInfo": ".core.device",
    # one step: metadata, its plan, the cache it writes, the persistent metadata of CUDA-graph decode
    "BatchMetadata": ".step.metadata",
    "plan_step": ".step.plan",
    "StepPlan": ".step.plan",
    "StepPlanError": ".step.plan",
    "PlanRequest": ".step.plan",
    "Run": ".step.plan",
    "RunBatch": ".step.plan",
    "LatentKVCache": ".step.cache",
    "block_table_slots": ".step.cache",
    "DecodeGraphMetadata": ".step.graph",
    # the backend contract (what a kernel author implements and declares)
    "MLABackend": ".backends.contract",
    "configure_backend": ".backends.contract",
    "BackendContractError": ".backends.contract",
    "Capabilities": ".backends.capabilities",
    "AttentionSpec": ".backends.capabilities",
    "QueryLenSupport": ".backends.capabilities",
    "Tolerance": ".backends.capabilities",
    "DEFAULT_TOLERANCES": ".backends.capabilities",
    "Precision": ".backends.capabilities",
    "Reason": ".backends.reasons",
    "ReasonKind": ".backends.reasons",
    "RefTorchBackend": ".ref_torch",
    # dispatch: which requests run absorbed (forward_mqa) and which expanded (forward_mha)
    "DispatchPolicy": ".backends.dispatch",
    "PerRequestPolicy": ".backends.dispatch",
    "PerBatchPolicy": ".backends.dispatch",
    "ThresholdTable": ".backends.thresholds",
    # plugins and the registry
    "hookimpl": ".plugins.hookspecs",
    "register_backend": ".plugins.loading",
    "get_backend": ".plugins.loading",
    "registered_backends": ".plugins.loading",
    "BackendName": ".plugins.registry",
    "UnknownBackendError": ".plugins.registry",
    "RegistrationError": ".plugins.registry",
    # the layer, the shared prefill and its workspace
    "MLAAttention": ".layer.attention",
    "forward_mha": ".layer.prefill",
    "PrefillWorkspace": ".layer.workspace",
    "shared_workspace": ".layer.workspace",
    "SparseKVCache": ".layer.sparse",
    "Indexer": ".layer.sparse",
    "IndexerKeyCache": ".layer.sparse",
    # DeepSeek-V4 (docs/v4.md)
    "V4Attention": ".layer.v4",
    "V4LayerCache": ".layer.v4",
    "CompressedKeys": ".backends.v4_inputs",
    "V4PoolTables": ".step.v4",
    "PoolTable": ".step.v4",
    "plan_v4_step": ".step.v4",
    "RecordCache": ".step.records",
    # checkpoints
    "Checkpoint": ".loading.checkpoint",
    "CheckpointError": ".loading.checkpoint",
    "StateDictError": ".loading.hf",
    "load_attention_layers": ".layer.pretrained",
    # selection
    "select_backend": "selector",
    "Selection": "selector",
    "SelectionError": "selector",
    "NoBackendError": "selector",
    "BackendNotSupportedError": "selector",
    # the on/off environment switches (MLA_BACKENDS_VLLM, MLA_BACKENDS_SGLANG ...): a value that is neither
    "EnvSwitchError": ".core.env_switches",
}

__all__ = ["__version__", *_LAZY]

_legacy.install()  # the flat module paths of 0.3 keep working for one release (DeprecationWarning)


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
