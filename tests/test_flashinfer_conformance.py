"""The shared conformance suite on the four FlashInfer backends.

On a CPU-only machine the numerical tests skip with the backend's reason (each backend needs its GPU
architecture) and the declaration tests run: every declared dtype, cache dtype, page size, head count and
query-length mode is accepted by ``not_supported_reasons`` in some combination, and undeclared ones are
rejected. On a GPU of the right architecture the whole suite runs against the float64 reference.
"""

from __future__ import annotations

from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
)
from mla_backends.testing import BackendConformance


class TestFlashInferMLAConformance(BackendConformance):
    backend = FlashInferMLABackend
    quick = True


class TestFlashInferCutlassConformance(BackendConformance):
    backend = FlashInferCutlassMLABackend
    quick = True


class TestFlashInferTrtllmConformance(BackendConformance):
    backend = FlashInferTrtllmMLABackend
    quick = True


class TestFlashInferXqaConformance(BackendConformance):
    backend = FlashInferXqaMLABackend
    quick = True
