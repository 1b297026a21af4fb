"""The honest side of issue 43: correct kernels pass the suite over many random cases, far from its edges, with
no hint.

REF_TORCH and CPU_FUSED (where built) run their quick matrix and 16 random cases, TRITON_MLA (under Triton's
interpreter: float32 and float16, bf16 withheld there) 3 random cases beyond its quick matrix
(tests/test_conformance_triton.py); vLLM's and SGLang's kernels run in tests/vllm_engine/test_vllm_peers.py and
tests/sglang_engine/test_sglang_peers.py. Every case poisons the slots no request owns.
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import build_matrix, calibration, checks
from mla_backends.testing.matrix import PROPERTY_SEED

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
#: an honest float32-accumulating kernel uses at most this fraction of any allowance on the suite's cases (the
#: multiples are 4: REF_TORCH measures 0.26 at most, the allowance's own noise included)
ROOM = 0.5


def test_ref_torch_passes_every_case_over_many_seeds_with_room() -> None:
    rows = calibration.honest_rows(RefTorchBackend, seeds=16)
    assert {r.column for r in rows} >= {"bfloat16", "float16", "float32", "float64", "bfloat16/fp8"}
    assert sum(r.cases for r in rows) >= 30
    assert not [r.failures for r in rows if r.failures]
    worst = {(r.column, k): v for r in rows for k, v in r.worst.items() if v > ROOM}
    assert not worst, worst


def test_cpu_fused_passes_every_case_over_many_seeds_with_room() -> None:
    from mla_backends.cpu_fused import CpuFusedBackend, build

    if not build.is_built():
        pytest.skip("CPU_FUSED is not built for this machine (mla-backends build)")
    rows = calibration.honest_rows(CpuFusedBackend, seeds=16)
    assert {r.column for r in rows} >= {"bfloat16", "float16", "float32", "bfloat16/fp8"}
    assert not [r.failures for r in rows if r.failures]
    worst = {(r.column, k): v for r in rows for k, v in r.worst.items() if v > ROOM}
    assert not worst, worst


def test_triton_mla_interpreted_passes_random_cases() -> None:
    pytest.importorskip("triton")
    from mla_backends.triton_mla import TritonMLABackend

    cls = TritonMLABackend.interpreted()
    assert torch.bfloat16 not in cls.capabilities.dtypes  # the interpreter's bf16 conversions truncate
    drawn = [c for c in build_matrix(cls, False, seeds=3, seed=PROPERTY_SEED + 50).output if c.draw is not None]
    assert len(drawn) == 3
    for case in drawn:
        measures = checks.measure_output(cls, case, CPU)
        assert max(measures.values()) <= ROOM, (case.id, measures)
