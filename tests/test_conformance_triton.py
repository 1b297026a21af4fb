"""TRITON_MLA passes the quick conformance matrix (under TRITON_INTERPRET=1 on a CPU, set by conftest.py).

On a GPU the same class runs on CUDA.
"""

from __future__ import annotations

from mla_backends.testing import BackendConformance
from mla_backends.triton_mla import TritonMLABackend


class TestTritonMLAQuickConformance(BackendConformance):
    backend = TritonMLABackend
    quick = True
