"""The FlashInfer backends (GPU-only) under the conformance suite.

On a machine without CUDA every kernel check is collected and skipped with the backend's own reason
(``device: got CPU; supported a CUDA device ...``); the declaration checks (honest ``not_supported_reasons``)
need no device and run everywhere. With a fitting GPU the full matrix runs.
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.backends.reasons import ReasonKind
from mla_backends.plugins.loading import registered_backends
from mla_backends.testing import BackendConformance, build_matrix
from mla_backends.testing.checks import pick_device, run_reasons

FLASHINFER_NAMES = sorted(n for n in registered_backends() if n.startswith("FLASHINFER"))

for _name in FLASHINFER_NAMES:
    _cls_name = "TestConformance" + "".join(p.capitalize() for p in _name.split("_"))
    globals()[_cls_name] = type(_cls_name, (BackendConformance,), {"backend": _name, "__module__": __name__})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour (this machine has CUDA)")
@pytest.mark.parametrize("name", FLASHINFER_NAMES)
def test_gpu_only_backend_skips_with_its_reason_on_cpu(name: str) -> None:
    cls = registered_backends()[name]
    matrix = build_matrix(cls, False)
    device = pick_device(cls, "auto")
    assert device.type == "cpu"
    for case in matrix.output:
        reasons = run_reasons(cls, case, device)
        assert reasons, f"{name} would run {case.id} on the CPU"
        assert any(r.kind in (ReasonKind.DEVICE, ReasonKind.PACKAGE) for r in reasons), reasons


def test_flashinfer_backends_are_registered() -> None:
    assert "FLASHINFER_MLA" in FLASHINFER_NAMES
