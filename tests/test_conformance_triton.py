"""TRITON_MLA passes the quick conformance matrix (under TRITON_INTERPRET=1 on a CPU, set by conftest.py).

On a GPU the same class runs on CUDA. Skipped only while ``mla_backends.triton_mla`` does not exist yet.
"""

from __future__ import annotations

import importlib

import pytest

from mla_backends.testing import BackendConformance

try:
    _triton_mla = importlib.import_module("mla_backends.triton_mla")
except ModuleNotFoundError as exc:  # the backend package itself is missing; any other import error fails
    if exc.name != "mla_backends.triton_mla":
        raise
    _triton_mla = None
if _triton_mla is None or getattr(_triton_mla, "__file__", None) is None:  # absent, or an empty namespace dir
    pytest.skip("mla_backends.triton_mla is not built yet", allow_module_level=True)


class TestTritonMLAQuickConformance(BackendConformance):
    backend = _triton_mla.TritonMLABackend
    quick = True
