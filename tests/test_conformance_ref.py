"""REF_TORCH passes the full conformance suite (cases from its declared capabilities)."""

from __future__ import annotations

from mla_backends.testing import BackendConformance


class TestRefTorchConformance(BackendConformance):
    backend = "REF_TORCH"
    quick = False
    device = "cpu"
