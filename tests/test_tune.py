"""``mla-backends tune``: crossover detection, the threshold table, the timer's two paths, the CLI, and a
layer that dispatches by a loaded table. No timing assertions: only structure and behaviour."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from mla_backends.cli import main
from mla_backends.core.dims import MLADims
from mla_backends.layer import dispatch
from mla_backends.layer.thresholds import TABLE_FORMAT, ContextThresholds, ThresholdTable, TunedThresholds
from mla_backends.planning import costs, tuning
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = MLADims(
    num_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    q_lora_rank=None,
    hidden_size=32,
    num_layers=1,
    name="tiny",
)


# ---- crossover detection ---------------------------------------------------------------------------------
def test_measured_crossover_interpolates_in_log_space():
    cross, bound, th = tuning.measured_crossover([1, 4, 16, 64], [0.1, 0.5, 2.0, 3.0])
    # log-linear between Q=4 (ratio 0.5) and Q=16 (ratio 2): the midpoint in log Q is 8
    assert cross == pytest.approx(8.0)
    assert bound == "" and th == 8


def test_measured_crossover_bounds():
    assert tuning.measured_crossover([1, 4, 16], [0.2, 0.3, 0.9]) == (None, "above", 16)
    assert tuning.measured_crossover([1, 4, 16], [1.2, 2.0, 3.0]) == (None, "below", 0)
    assert tuning.measured_crossover([8, 16], [1.5, 2.0]) == (None, "below", 7)
    # the first crossing counts even if a later (noisy) point dips again
    cross, _, th = tuning.measured_crossover([1, 2, 4, 8], [0.5, 1.0, 0.9, 2.0])
    assert cross == pytest.approx(2.0) and th == 2


@pytest.mark.parametrize(
    "qs, ratios, match",
    [
        ([1, 2], [0.5], "query_lens/ratios"),
        ([2, 1], [0.5, 2.0], "query_lens: got"),
        ([1, 2], [0.5, -1.0], "ratios: got"),
    ],
)
def test_measured_crossover_validation(qs, ratios, match):
    with pytest.raises(ValueError, match=match):
        tuning.measured_crossover(qs, ratios)


def test_context_buckets():
    t = tuning.context_buckets([256, 1024, 4096], [40, 90, 150])
    assert t.entries == ((512, 40), (2048, 90), (4096, 150))
    assert [t.threshold(c) for c in (0, 512, 513, 2048, 2049, 10**6)] == [40, 40, 90, 90, 150, 150]


# ---- the table -------------------------------------------------------------------------------------------
def _table(threshold: int = 8, backend: str = "REF_TORCH") -> ThresholdTable:
    ctx = ContextThresholds(((12, threshold), (100_000, 2)))
    return ThresholdTable(
        {backend: ctx}, {"date": "2026-01-01T00:00:00+00:00", "device": {"name": "cpu"}}
    )


def test_table_round_trip(tmp_path):
    path = tmp_path / "t.json"
    _table().save(path)
    data = json.loads(path.read_text())
    assert data["format"] == TABLE_FORMAT and data["device"] == {"name": "cpu"}
    loaded = ThresholdTable.load(path)
    assert loaded.backend_names == ("REF_TORCH",)
    assert loaded.threshold_for("ref_torch", 10) == 8
    assert loaded.threshold_for("REF_TORCH", 5000) == 2
    assert loaded.threshold_for("REF_TORCH", 10**7) == 2  # beyond the last bucket: the last threshold
    assert loaded.to_dict() == data
    assert TunedThresholds is ThresholdTable  # the name tuning used, kept


def test_table_errors(tmp_path):
    t = _table()
    with pytest.raises(ValueError, match="backend_name: got 'TRITON_MLA'; supported REF_TORCH"):
        t.threshold_for("TRITON_MLA", 10)
    with pytest.raises(ValueError, match="context_len: got -1"):
        t.threshold_for("REF_TORCH", -1)
    with pytest.raises(ValueError, match="which is not a file"):
        ThresholdTable.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ThresholdTable.load(bad)
    bad.write_text(json.dumps({"format": "other", "backends": {}}))
    with pytest.raises(ValueError, match="table.format: got 'other'"):
        ThresholdTable.load(bad)
    with pytest.raises(ValueError, match="backends: got none"):
        ThresholdTable({}, {})
    with pytest.raises(TypeError, match="backends: got tuple; supported a mapping"):
        ThresholdTable(((10, 2),))  # per-context pairs are ContextThresholds, not a table
    assert dispatch.policy_from_table(t, "TRITON_MLA", strict=False) is None
    with pytest.raises(ValueError, match="no measurement for backend 'TRITON_MLA'"):
        dispatch.policy_from_table(t, "TRITON_MLA")
    with pytest.raises(TypeError, match="threshold_table: got int"):
        dispatch.policy_from_table(3, "REF_TORCH")


# ---- the timer runs the layer's two paths, and they compute the same attention --------------------------
def _naive_reference(timer: tuning.PathTimer, context_len: int, q: int) -> torch.Tensor:
    """Expanded MLA written plainly in float64: up-project every visible latent per head, causal softmax."""
    d, layer = TINY, timer.layer
    P, V, r = d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    kv_b = layer.kv_b_proj.weight.detach().double().view(d.num_heads, P + V, r)
    rows = timer.rows.double()
    out = torch.zeros(q, d.num_heads, V, dtype=torch.float64)
    for i in range(q):
        visible = context_len + i + 1
        c, k_pe = rows[:visible, :r], rows[:visible, r:]
        for h in range(d.num_heads):
            k_nope = c @ kv_b[h, :P].T  # [visible, P]
            v = c @ kv_b[h, P:].T  # [visible, V]
            qn, qp = timer.q[i, h, :P].double(), timer.q[i, h, P:].double()
            scores = (k_nope @ qn + k_pe @ qp) * layer.scale
            out[i, h] = torch.softmax(scores, dim=0) @ v
    return out


def test_path_timer_paths_match_reference():
    timer = tuning.PathTimer(
        TINY, "REF_TORCH", dtype=torch.float64, device="cpu", max_tokens=40, block_size=4, repeats=1
    )
    s, q = 21, 5
    meta = BatchMetadata.build([q], [s], timer.block_table, timer.block_size, decode_threshold=q)
    ref = _naive_reference(timer, s, q)
    with torch.inference_mode():
        plan = plan_step(meta, [timer.layer.backend])
        torch.testing.assert_close(timer.absorbed(plan, q).double(), ref, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(timer.expanded(plan, q).double(), ref, atol=1e-9, rtol=1e-9)
    t = timer.time(s, q)
    assert (t.context_len, t.query_len) == (s, q) and t.absorbed_s > 0 and t.expanded_s > 0
    with pytest.raises(ValueError, match="context_len \\+ query_len: got 41"):
        timer.time(40, 1)


def test_tune_builds_a_table_with_provenance():
    seen = []
    table = tuning.tune(
        TINY,
        backends=["REF_TORCH"],
        query_lens=[1, 2, 4],
        contexts=[8, 32],
        dtype="float32",
        repeats=1,
        progress=False,
        on_timing=lambda name, t: seen.append((name, t.context_len, t.query_len)),
    )
    assert seen == [("REF_TORCH", s, q) for s in (8, 32) for q in (1, 2, 4)]
    data = table.to_dict()
    assert data["device"]["kind"] == "cpu" and "torch" in data["versions"] and data["date"].startswith("20")
    assert data["model"]["dtype"] == "float32" and data["grid"]["query_lens"] == [1, 2, 4]
    res = data["backends"]["REF_TORCH"]
    assert len(res["timings"]) == 6 and len(res["crossovers"]) == 2
    first = res["timings"][0]
    assert (first["context_len"], first["query_len"]) == (8, 1)
    assert first["absorbed_flops"] == costs.absorbed_path_flops(TINY, 1, 8, causal=True)
    assert first["expanded_flops"] == costs.expanded_path_flops(TINY, 1, 8, causal=True)
    for c in res["crossovers"]:
        assert 0 <= c["threshold"] <= 4
        assert c["modelled"] == pytest.approx(costs.crossover_query_len(TINY, c["context_len"], causal=True))
        # the table's bucket for this context holds exactly the measured threshold
        assert table.threshold_for("REF_TORCH", c["context_len"]) == c["threshold"]
    assert data["modelled_asymptotic_query_threshold"] == pytest.approx(16 * 16 / (2 * 16 + 4 - 8 - 4 - 8))


def test_progress_bar_draws_and_finishes():
    buf = io.StringIO()
    bar = tuning.ProgressBar(2, stream=buf, width=10)
    bar.update("a")
    assert "[#####.....] 1/2" in buf.getvalue() and not buf.getvalue().endswith("\n")
    bar.update("b")
    assert "[##########] 2/2" in buf.getvalue() and buf.getvalue().endswith("\n")
    quiet = io.StringIO()
    silent = tuning.ProgressBar(3, stream=quiet, enabled=False)
    silent.update()
    assert quiet.getvalue() == ""


# ---- the CLI ---------------------------------------------------------------------------------------------
def _quick_tune_args(backend: str, *, query_lens: str, contexts: str) -> list[str]:
    """``tune --quick`` of one backend on DeepSeek-V2-Lite at TP 8 (2 heads) over a tiny grid."""
    return ["tune", "--model", "deepseek-v2-lite", "--tp", "8", "--backend", backend, "--quick",
            "--query-lens", query_lens, "--context", contexts]


def test_tune_cli_writes_a_loadable_table(tmp_path, capsys):
    out = tmp_path / "thresholds.json"
    rc = main(_quick_tune_args("REF_TORCH", query_lens="1,2", contexts="16") + ["--output", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "measured crossover" in captured.out and "REF_TORCH" in captured.out
    assert "1/6" in captured.err and "6/6" in captured.err  # the progress bar: 2 points x 3 repeats
    assert "not for use" in captured.out
    table = ThresholdTable.load(out)
    assert table.backend_names == ("REF_TORCH",)
    assert table.info["model"]["num_heads"] == 2 and table.info["model"]["tp"] == 8
    assert table.info["quick"] is True and "not for use" in table.info["note"]
    assert table.info["grid"]["repeats"] == 3
    rank = MLADims.deepseek_v2_lite().tensor_parallel(8)
    for t in table.info["backends"]["REF_TORCH"]["timings"]:  # FLOPs of the rank's 2 heads, not all 16
        q, c = t["query_len"], t["context_len"]
        assert t["absorbed_flops"] == costs.absorbed_path_flops(rank, q, c, causal=True)
        assert t["expanded_flops"] * 8 == costs.expanded_path_flops(MLADims.deepseek_v2_lite(), q, c, causal=True)

    rc = main(_quick_tune_args("ref_torch", query_lens="1", contexts="8") + ["--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["format"] == TABLE_FORMAT
    assert math.isclose(data["modelled_asymptotic_query_threshold"], 512 * 256 / 768)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tune", "--tp", "3"], "--tp: got 3"),
        (["tune", "--backend", "NOPE_MLA", "--quick"], "backend: got 'NOPE_MLA'"),
        (["tune", "--repeats", "0"], "--repeats: got 0"),
        (["tune", "--device", "tpu"], "--device: got 'tpu'"),
        (["tune", "--dtype", "int8"], "dtype: got 'int8'"),
    ],
)
def test_tune_cli_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"repeats": 0}, ValueError, "repeats: got 0; supported >= 1"),
        ({"repeats": 1.0}, TypeError, "repeats: got float"),
        ({"block_size": 0}, ValueError, "block_size: got 0; supported >= 1"),
        ({"query_lens": [1, 0]}, ValueError, "query_lens\\[1\\]: got 0; supported >= 1"),
        ({"contexts": [8, 2.5]}, TypeError, "contexts\\[1\\]: got float"),
        ({"contexts": []}, ValueError, "supported non-empty lists"),
    ],
)
def test_tune_rejects_bad_arguments_before_timing(monkeypatch, kwargs, error, message):
    def no_timer(*args, **kw):
        raise AssertionError("a PathTimer was built before the arguments were checked")

    monkeypatch.setattr(tuning, "PathTimer", no_timer)
    args = {"backends": ["REF_TORCH"], "query_lens": [1], "contexts": [8], "progress": False, **kwargs}
    with pytest.raises(error, match=message):
        tuning.tune(TINY, **args)


def test_tune_help_shows_the_default_grid(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"query lengths (default {','.join(map(str, tuning.DEFAULT_QUERY_LENS))})" in out
    assert f"list of context lengths (default {','.join(map(str, tuning.DEFAULT_CONTEXTS))})" in out
    assert f"(default {tuning.DEFAULT_REPEATS})" in out and "--tp N" in out and "(default 8)" in out


# ---- a layer dispatches by a loaded table ----------------------------------------------------------------
def _layer(monkeypatch, **kwargs):
    from mla_backends.layer.attention import MLAAttention
    from mla_backends.loading.hf import random_hf_state_dict

    layer = MLAAttention(TINY, backend="REF_TORCH", dtype=torch.float32, **kwargs)
    layer.load_hf_state_dict(random_hf_state_dict(TINY, dtype=torch.float32))
    return layer


def _mha_calls(monkeypatch, layer, query_len: int, context_len: int) -> int:
    """Run the layer on one request and count forward_mha calls (the expanded path)."""
    import mla_backends.layer.attention as layer_mod

    calls = []
    real = layer_mod.forward_mha

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_mod, "forward_mha", counting)
    cache = layer.allocate_cache(16, 4)
    meta = BatchMetadata.build([query_len], [context_len], torch.arange(16, dtype=torch.int32).view(1, 16), 4)
    out = layer(torch.randn(query_len, TINY.hidden_size), None, cache, plan_step(meta, [layer]))
    assert out.shape == (query_len, TINY.hidden_size) and torch.isfinite(out).all()
    monkeypatch.setattr(layer_mod, "forward_mha", real)
    return len(calls)


def test_layer_uses_the_table_threshold(tmp_path, monkeypatch):
    monkeypatch.delenv(dispatch.THRESHOLD_TABLE_ENV, raising=False)
    path = tmp_path / "t.json"
    _table(threshold=8).save(path)
    plain = _layer(monkeypatch)
    assert _mha_calls(monkeypatch, plain, 4, 10) == 1  # REF_TORCH's constant threshold is 1: Q=4 expands
    tuned = _layer(monkeypatch, threshold_table=str(path))
    assert _mha_calls(monkeypatch, tuned, 4, 10) == 0  # the table says Q <= 8 runs absorbed at context 10
    assert _mha_calls(monkeypatch, tuned, 9, 10) == 1  # above the measured threshold: expanded
    assert _mha_calls(monkeypatch, tuned, 4, 20) == 1  # a longer context's bucket: threshold 2


def test_layer_reads_the_table_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    _table(threshold=8).save(path)
    monkeypatch.setenv(dispatch.THRESHOLD_TABLE_ENV, str(path))
    layer = _layer(monkeypatch)
    assert _mha_calls(monkeypatch, layer, 4, 10) == 0
    # an explicit dispatch policy wins over the environment
    explicit = _layer(monkeypatch, dispatch="per-request")
    assert _mha_calls(monkeypatch, explicit, 4, 10) == 1
    # a table without this backend's measurement leaves the backend's constant in place
    _table(threshold=8, backend="TRITON_MLA").save(path)
    other = _layer(monkeypatch)
    assert _mha_calls(monkeypatch, other, 4, 10) == 1


def test_layer_table_argument_errors(tmp_path, monkeypatch):
    from mla_backends.layer.attention import MLAAttention

    monkeypatch.delenv(dispatch.THRESHOLD_TABLE_ENV, raising=False)
    path = tmp_path / "t.json"
    _table(threshold=8, backend="TRITON_MLA").save(path)
    with pytest.raises(ValueError, match="no measurement for backend 'REF_TORCH'"):
        MLAAttention(TINY, backend="REF_TORCH", dtype=torch.float32, threshold_table=str(path))
    with pytest.raises(ValueError, match="threshold_table/dispatch: got both"):
        MLAAttention(
            TINY, backend="REF_TORCH", dtype=torch.float32, threshold_table=str(path), dispatch="per-batch"
        )
    with pytest.raises(ValueError, match="which is not a file"):
        MLAAttention(
            TINY, backend="REF_TORCH", dtype=torch.float32, threshold_table=str(tmp_path / "no.json")
        )


def test_layer_does_not_import_the_measurement_tool():
    """The tool sits above the layer: layer.py (and dispatch, which owns the table) never import tuning, and
    tuning reaches the layer through public methods only."""
    import ast
    import inspect

    import mla_backends.layer.attention
    import mla_backends.layer.dispatch
    import mla_backends.layer.thresholds

    for mod in (mla_backends.layer.attention, mla_backends.layer.dispatch, mla_backends.layer.thresholds):
        tree = ast.parse(inspect.getsource(mod))
        names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any("tuning" in n for n in names), (mod.__name__, names)
    src = inspect.getsource(tuning)
    assert "layer._" not in src and "._absorbed" not in src
