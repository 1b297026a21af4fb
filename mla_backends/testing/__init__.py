"""The conformance suite shipped with mla-backends: prove a backend correct before an engine trusts it.

Subclass :class:`BackendConformance` in a pytest module (``backend = "MY_BACKEND"``), or run
``mla-backends conformance MY_BACKEND [--quick]``. The pieces:

- :mod:`.reference`: an independent float64 naive *expanded* MLA (the expected values);
- :mod:`.cases`: the case types; :mod:`.matrix`: the cases generated from the backend's declared
  capabilities (full and quick matrices, :func:`build_matrix`);
- :mod:`.inputs`: a case's inputs on a device and its expected values;
- :mod:`.checks`: the checks as plain functions raising ``AssertionError``;
- :mod:`.suite`: :class:`BackendConformance`, the pytest test class (needs pytest);
- :mod:`.plugin`: the opt-in pytest plugin (``-p mla_backends.testing.plugin``), never auto-loaded;
- :mod:`.broken`: deliberately broken backends the suite must catch (its own self-test);
- :mod:`.engines`: reference tokens for engines' integration tests (transformers' greedy ``generate()``);
  :func:`randomise_parameters` makes the tiny random models they load;
- :func:`no_host_sync` / :class:`HostSyncError` / :func:`host_sync_allowed` / :class:`GuardThreadError`: the
  host-sync guard
  (defined in :mod:`mla_backends.core.host_sync`), for engines' own tests of their hot path.

Importing this package (or ``reference``, ``cases``, ``checks``) does not import pytest;
``BackendConformance`` loads on first access.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["BackendConformance", "resolve_backend", "build_matrix", "reference_mqa", "no_host_sync",
           "HostSyncError", "host_sync_allowed", "GuardThreadError", "random_hf_state_dict", "randomise_parameters",
           "run_v4_cases", "V4_CASES"]

_LAZY = {
    "run_v4_cases": ".v4_cases",
    "V4_CASES": ".v4_cases",
    "no_host_sync": "..core.host_sync",
    "HostSyncError": "..core.host_sync",
    "host_sync_allowed": "..core.host_sync",
    "GuardThreadError": "..core.host_sync",
    "BackendConformance": ".suite",
    "resolve_backend": ".suite",
    "build_matrix": ".matrix",
    "reference_mqa": ".reference",
    "random_hf_state_dict": "..loading.hf",
    "randomise_parameters": "..loading.hf",
}


#: names kept importable for code written against earlier releases: old name -> current name
_DEPRECATED = {"build_plan": "build_matrix"}  # docs/conformance.md named it before the "plan" rename (issue 13)


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(f"mla_backends.testing.{name} is deprecated; use {new} (the same function)",
                      DeprecationWarning, stacklevel=2)
        return __getattr__(new)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mla_backends.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
