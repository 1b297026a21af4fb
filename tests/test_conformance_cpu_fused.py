"""CPU_FUSED passes the full conformance suite in every dtype it declares (cases from its declared
capabilities; built first: skipped, with the reason, on a machine without a C++ compiler)."""

from __future__ import annotations

import pytest

from mla_backends.cpu_fused import build
from mla_backends.testing import BackendConformance


@pytest.fixture(scope="module", autouse=True)
def _built():
    try:
        build.load()
    except build.BuildError as exc:
        pytest.skip(f"CPU_FUSED cannot be built on this machine: {exc}")


class TestCpuFusedConformance(BackendConformance):
    backend = "CPU_FUSED"
    quick = False
    device = "cpu"
