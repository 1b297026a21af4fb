"""The decode/prefill split: both dispatch policies, the threshold table, backend clamping, the runs dispatch
cuts a step into, and which path the layer actually runs for each request."""

from __future__ import annotations

import json

import pytest
import torch
from layer_cases import tiny_config

import mla_backends.layer.attention as layer_mod
from mla_backends.backends.contract import QueryLenSupport
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dispatch import (
    THRESHOLD_TABLE_ENV,
    ContextThresholds,
    PerBatchPolicy,
    PerRequestPolicy,
    ThresholdTable,
    clamp_to_backend,
    layer_policy,
    resolve_policy,
    step_runs,
)
from mla_backends.loading.hf import random_hf_state_dict
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import Run, StepPlanError, plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_per_request_policy_uses_backend_or_own_threshold():
    q, c = [1, 4, 1, 7, 2], [9, 9, 9, 0, 5]
    assert PerRequestPolicy().absorbed(q, c, backend_threshold=1) == [True, False, True, False, False]
    assert PerRequestPolicy().absorbed(q, c, backend_threshold=4) == [True, True, True, False, True]
    assert PerRequestPolicy(threshold=2).absorbed(q, c, backend_threshold=128) == \
        [True, False, True, False, True]


def test_per_batch_policy_follows_sglang_rule():
    pol = PerBatchPolicy()
    assert pol.prefix_threshold == 8192
    assert pol.absorbed([1, 1, 1], [0, 5000, 9000], backend_threshold=1) == [True] * 3  # decode batch
    assert pol.absorbed([5, 7], [0, 0], backend_threshold=1) == [False, False]  # cold prefill
    assert pol.absorbed([5, 1], [100, 3000], backend_threshold=1) == [True, True]  # short prefix: absorbed
    assert pol.absorbed([5, 1], [5000, 3192], backend_threshold=1) == [False, False]  # sum 8192: expanded
    # threshold 0 makes every extend batch expanded; it does not force absorption
    assert PerBatchPolicy(0).absorbed([5, 1], [100, 3000], backend_threshold=1) == [False, False]
    assert PerBatchPolicy(0).absorbed([1, 1], [100, 3000], backend_threshold=1) == [True, True]


def test_context_thresholds_and_policy():
    ctx = ContextThresholds(((512, 2), (4096, 16), (65536, 64)))
    assert [ctx.threshold(c) for c in (0, 512, 513, 4096, 10**6)] == [2, 2, 16, 16, 64]
    pol = PerRequestPolicy(thresholds=ctx)
    assert pol.absorbed([3, 3, 20, 1], [100, 1000, 1000, 0], backend_threshold=1) == \
        [False, True, False, True]
    # a 0 entry still lets single tokens decode
    assert PerRequestPolicy(thresholds=ContextThresholds(((10, 0),))).absorbed(
        [1, 2], [0, 0], backend_threshold=4) == [True, False]
    with pytest.raises(ValueError, match="increasing"):
        ContextThresholds(((10, 1), (5, 2)))
    with pytest.raises(ValueError, match="entries"):
        ContextThresholds.from_entries([])
    with pytest.raises(ValueError, match="threshold/thresholds"):
        PerRequestPolicy(threshold=3, thresholds=ctx)
    with pytest.raises(TypeError, match="thresholds: got dict"):
        PerRequestPolicy(thresholds={})


def _tune_file(tmp_path, backends=("REF_TORCH",)):
    """The file ``mla-backends tune --output`` writes (the only threshold-table format)."""
    from test_tune import TINY

    from mla_backends.planning import tuning

    table = tuning.tune(TINY, backends=list(backends), query_lens=[1, 2], contexts=[4], dtype="float32",
                        repeats=1, progress=False)
    path = tmp_path / "tuned.json"
    table.save(path)
    return table, path


def test_per_request_policy_reads_the_file_tune_writes(tmp_path):
    table, path = _tune_file(tmp_path)
    pol = PerRequestPolicy.from_table(path)  # one backend measured: no name needed
    assert pol.thresholds == table.for_backend("REF_TORCH")
    assert PerRequestPolicy.from_table(path, "ref_torch") == pol == PerRequestPolicy.from_table(table)
    assert ThresholdTable.load(path).to_dict() == json.loads(path.read_text())
    with pytest.raises(ValueError, match="no measurement for backend 'TRITON_MLA'"):
        PerRequestPolicy.from_table(path, "TRITON_MLA")
    two = ThresholdTable({"A": pol.thresholds, "B": pol.thresholds})
    with pytest.raises(ValueError, match="backend_name: got None for a table measuring A, B"):
        PerRequestPolicy.from_table(two)
    # the old entries-only file is not a threshold table: the error names the format it wants
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"entries": [{"max_context": 10, "threshold": 2}]}))
    with pytest.raises(ValueError, match="table: got .*old.json.*format: got None; supported 'mla-backends/"):
        PerRequestPolicy.from_table(old)


def test_env_table_errors_name_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(THRESHOLD_TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="^MLA_BACKENDS_THRESHOLD_TABLE: got .*missing.json.*not a file"):
        layer_policy(None, None, "REF_TORCH")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    monkeypatch.setenv(THRESHOLD_TABLE_ENV, str(bad))
    with pytest.raises(ValueError, match="^MLA_BACKENDS_THRESHOLD_TABLE: got .*table.format: got 'other'"):
        layer_policy(None, None, "REF_TORCH")
    with pytest.raises(ValueError, match="^MLA_BACKENDS_THRESHOLD_TABLE"):
        MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64)
    assert isinstance(layer_policy("per-batch", None, "REF_TORCH"), PerBatchPolicy)  # dispatch= wins
    _, good = _tune_file(tmp_path)
    monkeypatch.setenv(THRESHOLD_TABLE_ENV, str(good))
    assert layer_policy(None, None, "REF_TORCH") == PerRequestPolicy.from_table(good)
    assert layer_policy(None, None, "TRITON_MLA") == PerRequestPolicy()  # not measured: warning, constant


def test_step_runs_are_cut_once_per_step_by_the_plan():
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64, dispatch=PerRequestPolicy(threshold=4))
    twin = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64, dispatch=PerRequestPolicy(threshold=4),
                                       layer_idx=1)
    other = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64, dispatch="per-batch", layer_idx=2)
    caps = layer.backend_cls.capabilities
    bt = torch.arange(64, dtype=torch.int32).view(4, 16)
    meta = BatchMetadata.build([6, 1, 3, 0], [4, 9, 2, 0], bt, 4)
    runs = step_runs(meta, PerRequestPolicy(threshold=4), caps)
    assert runs == (Run(True, 0, 1), Run(False, 1, 2), Run(True, 2, 4))
    assert step_runs(meta, PerRequestPolicy(threshold=4), caps, sparse=True) == (Run(True, 0, 4),)
    plan = plan_step(meta, [layer, twin])
    assert dict(plan.runs) == {layer.runs_key(): runs} and twin.runs_key() == layer.runs_key()  # one entry
    with pytest.raises(TypeError):
        plan.runs[layer.runs_key()] = ()  # the plan is read-only once made
    with pytest.raises(StepPlanError, match="made without layer 2"):
        plan.runs_for(other.runs_key(), "layer 2")
    with pytest.raises(TypeError, match="policy: got str"):
        step_runs(meta, "per-request", caps)


def test_resolve_and_clamp():
    assert isinstance(resolve_policy("sglang"), PerBatchPolicy)
    assert isinstance(resolve_policy("per-request"), PerRequestPolicy)
    with pytest.raises(TypeError, match="dispatch: got int"):
        resolve_policy(3)
    flags = [True, True, False, True]
    assert clamp_to_backend(flags, [1, 5, 0, 2], QueryLenSupport.SINGLE) == [True, False, False, False]
    assert clamp_to_backend(flags, [1, 5, 0, 2], QueryLenSupport.VARLEN) == [True, True, True, True]


class _Recorder:
    """Counts the query rows each path receives."""

    def __init__(self, monkeypatch, layer):
        self.mqa_rows: list[int] = []
        self.mha_rows: list[int] = []
        real_mqa, real_mha = layer.backend.forward_mqa, layer_mod.forward_mha

        def mqa(q_latent, *a, **k):
            self.mqa_rows.append(q_latent.shape[0])
            return real_mqa(q_latent, *a, **k)

        def mha(q, *a, **k):
            self.mha_rows.append(q.shape[0])
            return real_mha(q, *a, **k)

        monkeypatch.setattr(layer.backend, "forward_mqa", mqa)
        monkeypatch.setattr(layer_mod, "forward_mha", mha)


def _step(layer, qlens, ctx, decode_threshold=1, cache=None):
    cache = layer.allocate_cache(64, 4) if cache is None else cache
    bt = torch.arange(64, dtype=torch.int32).view(4, 16)[: len(qlens)]
    meta = BatchMetadata.build(qlens, ctx, bt, 4, decode_threshold=decode_threshold)
    x = torch.randn(sum(qlens), 32, dtype=torch.float64)
    return layer(x, None, cache, plan_step(meta, [layer]))


@pytest.mark.parametrize("dispatch, qlens, ctx, mqa, mha", [
    (None, [3, 1, 6, 1], [4, 9, 0, 2], [2], [9]),  # REF_TORCH threshold 1: decodes absorbed, one cut
    (PerRequestPolicy(threshold=4), [3, 1, 6, 1], [4, 9, 0, 2], [5], [6]),
    # metadata ordered with threshold 1 puts [1, 6, 3]: the layer runs absorbed, expanded, absorbed
    (PerRequestPolicy(threshold=4), [6, 1, 3], [4, 9, 2], [1, 3], [6]),
    ("per-batch", [3, 1, 6, 1], [4, 9, 0, 2], [11], []),  # summed prefix 15 < 8192: all absorbed
    ("per-batch", [3, 1, 6], [0, 0, 0], [], [10]),  # cold prefill: all expanded
    (PerBatchPolicy(10), [3, 1, 6, 1], [4, 9, 0, 2], [], [11]),  # prefix 15 >= 10: all expanded
    ("per-batch", [1, 1], [7, 3], [2], []),  # decode batch
])
def test_layer_routes_requests(monkeypatch, dispatch, qlens, ctx, mqa, mha):
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64, dispatch=dispatch)
    layer.load_hf_state_dict(random_hf_state_dict(layer.dims, dtype=torch.float64))
    cache = layer.allocate_cache(64, 4)  # (configures the layer's backend with the page size: spied after)
    rec = _Recorder(monkeypatch, layer)
    out = _step(layer, qlens, ctx, cache=cache)
    assert out.shape == (sum(qlens), 32) and torch.isfinite(out).all()
    assert rec.mqa_rows == mqa and rec.mha_rows == mha


def test_layer_threshold_follows_policy():
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64)
    assert layer.decode_threshold == 1  # REF_TORCH declares 1
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64,
                                        dispatch=PerRequestPolicy(threshold=8))
    assert layer.decode_threshold == 8


@pytest.mark.parametrize("threshold", [0, 1, 3])
def test_layer_threshold_is_the_largest_absorbed_query_length(threshold):
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64,
                                        dispatch=PerRequestPolicy(threshold=threshold))
    th = layer.decode_threshold
    assert th == threshold
    lens = [th, th + 1] if th else [th + 1]
    flags = layer.dispatch.absorbed(lens, [5] * len(lens), backend_threshold=1)
    assert flags == ([True, False] if th else [False])


def test_per_batch_prefix_counts_only_requests_with_new_tokens():
    # a zero-length request produces no rows: its cached context neither reaches the threshold nor
    # turns a cold prefill warm
    pol = PerBatchPolicy(100)
    assert pol.absorbed([4, 0], [10, 500], backend_threshold=1) == [True, True]
    assert pol.absorbed([4, 0], [0, 50], backend_threshold=1) == [False, False]
