"""SGLang's own MLA decode kernel judged by the conformance suite (mla_backends.testing.peers), in .venv-sglang.

``decode_attention.decode_attention_fwd`` as ``TritonAttnBackend.forward_decode`` launches it, under Triton's
interpreter: a minimal set of checks that covers its grouped kernel (16 heads, a ragged decode batch with two
equal lengths), its one-head kernel, float32, the cache guard checks and a random case. Every unowned cache slot holds
NaN, infinities or junk (the suite's poison). The verdicts are asserted case by case.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

from mla_backends.testing import build_matrix, checks
from mla_backends.testing.peers import engine_peers
from mla_backends.testing.peers.runner import EngineReport, format_table, run_peer
from mla_backends.testing.peers.sglang_peers import SglangTritonMLADecode

_SPEC = importlib.util.find_spec("sglang")
pytestmark = [pytest.mark.skipif(_SPEC is None or _SPEC.origin is None, reason="SGLang is not installed here"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="judges the interpreted kernel (a CPU run); on a "
                                 "GPU `mla-backends conformance --engine sglang` runs it compiled")]
CPU = torch.device("cpu")
INTERPRETED = SglangTritonMLADecode.interpreted()

#: the checks run here -> expected verdict (every one passes)
VERDICTS = {
    ("output_matches_reference", "ctx-sweep-float16-kv-float16-page16-h16-r512x64"): "passed",
    ("output_matches_reference", "heads-float16-kv-float16-page16-h1-r512x64"): "passed",
    ("output_matches_reference", "dtype-float32-kv-float32-page16-h16-r512x64"): "passed",
    ("inputs_not_written", "guard-float16-kv-float16-page16-h16-r512x64"): "passed",
    ("declared_values_accepted", "num_heads=1"): "passed",
    ("undeclared_combinations_rejected", "query-len-2"): "passed",
}
SEED = 7


@pytest.fixture(scope="module")
def report():
    (peer,) = engine_peers("sglang")
    select = lambda test, case: (test, case) in VERDICTS or (  # noqa: E731
        test == "output_matches_reference" and case.startswith("prop-s"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small kernels on a loaded 2-core machine: thread hand-offs cost more than they win
    try:
        return run_peer(peer, quick=True, device=CPU, select=select, seeds=1, seed=SEED)
    finally:
        torch.set_num_threads(n)


def test_the_kernel_runs_here_and_the_table_says_so(report) -> None:
    assert report.runnable and report.backend == "SGLANG_TRITON_MLA_DECODE", report.reason
    assert report.engine_version == "sglang 0.5.23"
    table = format_table(EngineReport("sglang", "quick", "cpu", [report]))
    assert "not installed" not in table and "verdict: every runnable kernel passed" in table


def test_the_verdicts(report) -> None:
    got = {(r.test, r.case): r.status for r in report.results if not r.case.startswith("prop-s")}
    assert got == VERDICTS, [(r.test, r.case, r.status, r.worst, r.diagnosis) for r in report.results]
    drawn = [r for r in report.results if r.case.startswith("prop-s")]
    assert len(drawn) == 1 and drawn[0].status == "passed", [(r.case, r.worst) for r in drawn]


def test_the_interpreter_withholds_bf16_and_the_fp8_cache_with_the_reason() -> None:
    assert INTERPRETED.capabilities.dtypes == frozenset({torch.float16, torch.float32})
    case = build_matrix(SglangTritonMLADecode, True).output[0]
    assert case.dtype == torch.bfloat16
    reasons = "; ".join(map(str, checks.run_reasons(SglangTritonMLADecode, case, CPU)))
    assert "bfloat16 under Triton's interpreter" in reasons
    assert "fp8_e4m3" not in INTERPRETED.capabilities.kv_cache_dtypes
    assert "fp8_e4m3" in SglangTritonMLADecode.capabilities.kv_cache_dtypes  # compiled: declared, with its band


class _Log2eSglang(INTERPRETED):
    """SGLang's kernel handed ``scale * log2(e)``: the suite must name the mistake."""

    name = "SGLANG_TRITON_MLA_DECODE_LOG2E"

    def forward_mqa_kernel(self, *args, scale: float, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(*args, scale=scale * math.log2(math.e), **kw)


def test_a_wrong_scale_around_sglangs_kernel_is_diagnosed() -> None:
    base = build_matrix(INTERPRETED, True).guard[0]
    case = dataclasses.replace(base, seq_lens=(1, 17), query_lens=(1, 1))
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(_Log2eSglang, case, CPU)
    assert "off by a constant factor 1.443 = log2(e)" in info.value.hint
