"""The flat module paths of mla-backends 0.3 (``mla_backends.cache``, ``mla_backends.layer`` ...): importing one
imports its new home and warns (``DeprecationWarning``) naming it. Removed in 0.6, one release later than 0.4.0
said, since 0.4.0 had dropped seven of them by mistake.

The table is data (:data:`MOVED`); ``tests/test_public_api.py`` checks that every old path resolves to the new
module and warns. Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "MOVED_NAMES", "install"]

#: old module (below ``mla_backends``) -> its home since 0.4
MOVED: dict[str, str] = {
    "dims": "core.dims", "dtypes": "core.dtypes", "rope": "core.rope", "validation": "core.validation",
    "errors": "core.errors", "attention_math": "core.attention_math", "device": "core.device", "gpus": "core.gpus",
    "config_fields": "core.config_fields", "memory": "core.memory", "progress": "core.progress",
    "host_sync": "core.host_sync",
    "metadata": "step.metadata", "dcp_layout": "step.metadata", "step_plan": "step.plan",
    "meta_checks": "step.checks", "decode_graph": "step.graph", "cache": "step.cache",
    "backend": "backends.contract", "capabilities": "backends.capabilities", "reasons": "backends.reasons",
    "mqa_inputs": "backends.inputs", "naive": "backends.naive",
    "hookspecs": "plugins.hookspecs", "registry": "plugins.registry", "aliases": "plugins.aliases",
    "builtin_backends": "plugins.builtins",
    "layer_weights": "layer.weights", "layer_inputs": "layer.attention", "projections": "layer.projections",
    "dispatch": "layer.dispatch", "threshold_table": "layer.thresholds", "dcp": "layer.dcp",
    "prefill": "layer.prefill", "prefill_kernels": "layer.prefill_kernels", "workspace": "layer.workspace",
    "sparse": "layer.sparse", "sparse.indexer": "layer.sparse.indexer",
    "sparse.indexer_cache": "layer.sparse.indexer_cache", "sparse.layer_support": "layer.sparse.layer_support",
    "checkpoint": "loading.checkpoint", "pretrained": "layer.pretrained", "fp8_checkpoint": "loading.fp8",
    "hf_loading": "loading.hf",
    "costs": "planning.costs", "roofline": "planning.roofline", "deployment": "planning.deployment",
    "reserve": "planning.reserve", "tuning": "planning.tuning",
}
#: names an old module gave that live in another module since 0.4: old module -> name -> its home. Importing the
#: old path (which warns) puts them on the module it aliases, so ``from mla_backends.prefill import
#: default_workspace_rows`` keeps working
MOVED_NAMES: dict[str, dict[str, str]] = {
    "prefill": {"default_workspace_rows": "layer.workspace"},
}
# ``mla_backends.layer`` and ``mla_backends.plugins`` are packages now: their old names (``from mla_backends.layer
# import MLAAttention``, ``from mla_backends.plugins import get_backend``) are served by the packages' own lazy
# re-exports, not by this table.

_PREFIX = "mla_backends."


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str, names: dict[str, str]) -> None:
        self.new = new
        self.names = names

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran already; give it back its own spec (the import system set the alias's), and the
        names that left it (:data:`MOVED_NAMES`)."""
        module.__spec__ = self.own_spec
        for name, home in self.names.items():
            if not hasattr(module, name):
                setattr(module, name, getattr(importlib.import_module(_PREFIX + home), name))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        old = fullname[len(_PREFIX):]
        new = MOVED.get(old)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to mla_backends.{new} in mla-backends 0.4; import the public name from "
                      "mla_backends (or the new module); the old path goes in 0.6", DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(_PREFIX + new, MOVED_NAMES.get(old, {})))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import mla_backends`` calls it)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
