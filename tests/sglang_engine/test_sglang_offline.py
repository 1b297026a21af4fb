"""SGLang's ``Engine.generate`` on tiny random DeepSeek-V2/V3 checkpoints with ``--attention-backend mla_backends``:
greedy tokens equal transformers' fp32 ``generate()``, batched and single, at page size 1 and 16; the absorbed
attention provably ran on mla-backends (the spy backend given through ``MLA_BACKEND``); a refused backend fails
at start-up with the selection's reasons; tensor parallelism (``tp_size`` 2) on SGLang's CPU engine. The runs are
in sglang_driver.py (one process per checkpoint). SGLang's own CPU path cannot run these models (its ``torch_native``
backend fails on MLA prefill, docs/integrations.md), so transformers is the reference."""

from __future__ import annotations

import re

import pytest

KINDS = ["v2", "v3"]
#: forward_mqa calls of one phase: 2 layers x (9 decode steps of the batched generate + 4 single generates x (1
#: absorbed extend of the one uncached prompt token + 9 decode steps))
ABSORBED_CALLS = 2 * (9 + 4 * 10)


@pytest.fixture(params=KINDS)
def report(request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(f"report_{request.param}")


def test_checkpoints_are_sharded(report: dict) -> None:
    assert report["shards"] > 1


def test_plugin_tokens_equal_transformers(report: dict) -> None:
    plugin = report["plugin"]
    assert plugin["batched"] == report["hf"]
    assert plugin["single"] == report["hf"]
    assert len({len(p) for p in plugin["batched"]}) == 1  # prompts of 3 to 37 tokens, 10 new tokens each


def test_absorbed_attention_went_through_mla_backends(report: dict) -> None:
    calls = [line.split() for line in report["plugin"]["spy"]]
    assert calls, "the spy backend given through MLA_BACKEND never ran"
    assert {c[1] for c in calls} == {"4"}  # every call saw the model's 4 heads
    assert max(int(c[2]) for c in calls) == 4  # batched decode steps carry the 4 requests together
    assert len(calls) == ABSORBED_CALLS
    assert len({c[0] for c in calls}) == 1  # one scheduler process: the engine's, not the driver's


def test_page_size_16(report_v2: dict) -> None:
    page = report_v2["page16"]
    assert page["batched"] == report_v2["hf"]
    assert page["single"] == report_v2["hf"]
    assert len(page["spy"]) > 0


def test_selected_backend_tokens_equal_transformers(report_v2: dict) -> None:
    """With no backend forced the plugin runs the selector's choice (CPU_FUSED where its kernel is built for this
    machine, REF_TORCH otherwise) for decodes and absorbed extends alike."""
    from mla_backends.cpu_fused import build

    selected = report_v2["selected"]
    assert selected["batched"] == report_v2["hf"] and selected["single"] == report_v2["hf"]
    assert selected["spy"] == []  # the spy was not chosen
    log = report_v2["log"].split("=== phase selected\n")[1].split("=== phase selected done")[0]
    chosen = set(re.findall(r"runs absorbed MLA on mla-backends \(model \S+, 4 heads on this rank\)\. Chosen: (\w+),",
                            log))
    assert chosen == {"CPU_FUSED" if build.is_built() else "REF_TORCH"}, log[-3000:]


def test_refused_backend_fails_at_start_up_with_reasons(report_v2: dict) -> None:
    refused = report_v2["refused"]
    assert refused.get("error"), "MLA_BACKEND=TRITON_MLA started an engine on the CPU"
    log = refused["log"]
    assert "SGLangSelectionError: mla-backends cannot run this SGLang MLA model (4 heads on this rank" in log
    assert "TRITON_MLA" in log and "device: got CPU" in log


def test_tensor_parallel_2(report_v3: dict) -> None:
    tp2 = report_v3["tp2"]
    if tp2.get("error"):
        tail = [ln for ln in tp2["log"].splitlines() if "Error" in ln][-1:]
        pytest.skip(f"SGLang's CPU engine does not run tp_size 2 here (docs/integrations.md): {tail}")
    assert tp2["batched"] == report_v3["hf"]
    assert tp2["single"] == report_v3["hf"]
    calls = [line.split() for line in tp2["spy"]]
    assert {c[1] for c in calls} == {"2"}  # each rank selected for H / 2 heads
    assert len({c[0] for c in calls}) == 2  # two rank processes
