"""vLLM's ``LLM.generate`` on tiny random DeepSeek-V2/V3 checkpoints: with the plugin, greedy tokens equal
vLLM's own CPU_MLA backend and transformers' fp32 ``generate()``, batched and single; decode provably ran on
mla-backends; TP=2 equals TP=1 with H/2 heads per rank; a refused backend fails at start-up; without
MLA_BACKENDS_VLLM vLLM's choice is unchanged. The runs are in driver.py (one process per checkpoint)."""

from __future__ import annotations

import pytest

KINDS = ["v2", "v3"]


@pytest.fixture(params=KINDS)
def report(request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(f"report_{request.param}")


def test_checkpoints_are_sharded(report: dict) -> None:
    assert report["shards"] > 1


def test_vllm_own_backend_equals_transformers(report: dict) -> None:
    """The anchor: vLLM's CPU_MLA (rotary custom op off, the reference page's workaround) matches fp32 HF."""
    assert report["own"]["batched"] == report["hf"]
    assert report["own"]["single"] == report["hf"]


def test_plugin_tokens_equal_vllm_and_transformers(report: dict) -> None:
    plugin = report["plugin"]
    assert plugin["batched"] == report["hf"]
    assert plugin["single"] == report["hf"]
    assert plugin["batched"] == report["own"]["batched"]


def test_decode_went_through_mla_backends(report: dict) -> None:
    plugin = report["plugin"]
    assert plugin["impls"] == ["MLABackendsCPUImpl"]
    assert plugin["overridden"] is True
    calls = [line.split() for line in plugin["spy"]]
    assert calls, "the spy backend given through MLA_BACKEND never ran"
    # batched steps carry several requests; every call saw the model's 4 heads
    assert {c[1] for c in calls} == {"4"} and max(int(c[2]) for c in calls) == 4
    # 2 MLA layers x (10 - 1) decode steps for the batched call and each of the 4 single calls
    assert len(calls) == 2 * 9 * 5
    assert "runs MLA decode on mla-backends. Chosen: SPY_REF, block_size 16" in report["log"]


def test_without_switch_vllm_choice_unchanged(report: dict) -> None:
    own = report["own"]
    assert own["impls"] == ["CPUMLAImpl"]
    assert own["overridden"] is False
    assert own["spy_calls"] == 0
    assert report["log"].split("=== phase plugin")[0].count("mla-backends:") == 0


def test_refused_backend_fails_at_startup_with_reasons(report_v2: dict) -> None:
    err = report_v2["refused"]["error"]
    assert err is not None and err.startswith("VLLMSelectionError")
    assert "TRITON_MLA" in err and "device: got CPU; supported a CUDA device" in err


def test_tensor_parallel_2_equals_1_with_half_heads_per_rank(report_v3: dict) -> None:
    tp2 = report_v3["tp2"]
    assert tp2["batched"] == report_v3["plugin"]["batched"]
    assert tp2["single"] == report_v3["plugin"]["single"]
    calls = [line.split() for line in tp2["spy"]]
    pids = {c[0] for c in calls}
    assert len(pids) == 2, f"expected two ranks, got processes {pids}"
    assert {c[1] for c in calls} == {"2"} and {c[3] for c in calls} == {"2"}  # H / 2 on each rank
