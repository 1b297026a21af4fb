"""vLLM's ``LLM.generate`` on tiny random DeepSeek-V2/V3 checkpoints: with the plugin, greedy tokens equal
vLLM's own CPU_MLA backend and transformers' fp32 ``generate()``, batched and single; decode provably ran on
mla-backends; TP=2 equals TP=1 with H/2 heads per rank; a refused backend, and a model whose rows vLLM's MLA
path cannot take, fail at start-up; fp8 caches give the tokens of a run that reads the same rounded values from
an fp32 cache; without MLA_BACKENDS_VLLM vLLM's choice is unchanged. The runs are in driver.py (one process
per checkpoint)."""

from __future__ import annotations

import re

import pytest
from engine_harness import cpu_choice

KINDS = ["v2", "v3"]
#: forward_mqa calls of one phase: 2 layers x 9 decode steps x (1 batched + 4 single generates), + 2 layers x
#: 1 step of the batched log-probability call
DECODE_CALLS = 2 * 9 * 5 + 2 * 1


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
    # 2 MLA layers x (10 - 1) decode steps for the batched call and each of the 4 single calls, + 2 layers x 1
    # step of the batched log-probability call
    assert len(calls) == DECODE_CALLS
    ckpt = report["log"].split("=== phase plugin")[1]
    assert re.search(r"runs MLA decode on mla-backends \(model \S+/(v2|v3), 4 heads on this rank\)\. "
                     r"Chosen: SPY_REF, block_size 16", ckpt), "no start-up line naming the model and heads"


def test_selected_backend_tokens_equal_vllm_and_transformers(report_v2: dict) -> None:
    """With no backend forced the plugin runs the selector's choice: CPU_FUSED where its kernel is built for
    this machine (``mla-backends build``; the environment's build step runs it), REF_TORCH otherwise."""
    selected = report_v2["selected"]
    assert selected["batched"] == report_v2["hf"] and selected["single"] == report_v2["hf"]
    assert selected["batched"] == report_v2["own"]["batched"]
    log = report_v2["log"].split("=== phase selected\n")[1].split("=== phase selected done")[0]
    chosen = set(re.findall(r"runs MLA decode on mla-backends \(model \S+, 4 heads on this rank\)\. Chosen: (\w+),",
                            log))
    assert chosen == {cpu_choice()}, log[-3000:]


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
    log = report_v3["log"].split("=== phase tp2")[1]
    for rank in ("Worker_TP0", "Worker_TP1"):  # each rank's start-up line names the model and its head count
        assert re.search(rf"\({rank} pid=\d+\).*runs MLA decode on mla-backends \(model \S+/v3, 2 heads on this "
                         r"rank\)\. Chosen: SPY_REF", log), rank


FP8_RUNS = [("fp8", "fake_fp8_e4m3"), ("fp8_e5m2", "fake_fp8_e5m2")]


@pytest.mark.parametrize("name,fake", FP8_RUNS)
def test_fp8_cache_tokens_are_the_fp8_rounded_run(report_v2: dict, name: str, fake: str) -> None:
    """An fp8 cache (written by the plugin on vLLM's CPU, read as the format it was written in) gives exactly
    the tokens of a run on an fp32 cache whose rows are rounded to that fp8 format before each decode: every
    difference from the fp32 run is fp8 rounding, nothing else (vLLM's own CPU write left every token after
    the first at 0)."""
    fp8, rounded, fp32 = report_v2[name], report_v2[fake], report_v2["plugin"]
    assert fp8["impls"] == ["MLABackendsCPUImpl"] and fp8["spy_calls"] == DECODE_CALLS  # decode on mla-backends
    assert fp8["batched"] == rounded["batched"] and fp8["single"] == rounded["single"]
    assert fp8["batched"] == fp8["single"]
    assert [t[0] for t in fp8["batched"]] == [t[0] for t in fp32["batched"]]  # prefill reads no cache
    for got, want in zip(fp8["step1"], rounded["step1"], strict=True):
        assert got["prefix"] == want["prefix"] and got["top"].keys() == want["top"].keys()
        for tok, lp in got["top"].items():
            assert abs(lp - want["top"][tok]) <= 1e-4, (name, tok, lp, want["top"][tok])


@pytest.mark.parametrize("name,fake", FP8_RUNS)
def test_fp8_drift_from_fp32_is_bounded(report_v2: dict, name: str, fake: str) -> None:
    """The first step that reads the cache, from the same prefix as the fp32 run: the fp32 run's top
    candidates keep log-probabilities within 1 nat (measured: at most 0.48 for e4m3, 0.33 for e5m2 on this
    model); garbage rows (the unquantised write) are far outside that."""
    for got, want in zip(report_v2[name]["step1"], report_v2["plugin"]["step1"], strict=True):
        assert got["prefix"] == want["prefix"]
        common = got["top"].keys() & want["top"].keys()
        assert len(common) >= 3, (got, want)
        assert max(abs(got["top"][t] - want["top"][t]) for t in common) < 1.0


def test_rows_vllm_cannot_take_are_refused_at_startup(report_v2: dict) -> None:
    err = report_v2["refused_288"]["error"]
    assert err is not None and err.startswith("VLLMSelectionError: mla-backends cannot run this vLLM MLA model")
    assert "kv_lora_rank 256, rope 32" in err
    chosen = cpu_choice()  # the selector's choice takes 288-wide rows
    assert ("head size: got 288 (kv_lora_rank 256 + rope 32); supported 320, 512, 576 by vLLM's MLA path on CPU "
            f"(vLLM's MLACommonMetadata), any by {chosen}") in err
    assert "Head dimension 288 is not supported" not in err  # vLLM's own mid-generation failure
