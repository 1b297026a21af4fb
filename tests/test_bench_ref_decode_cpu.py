"""``benchmarks/bench_ref_decode_cpu.py`` runs end to end at one tiny point (no timed assertions): every variant
is timed, the forced paths really are the paths they name, and ``--before`` loads a second copy of the package."""

from __future__ import annotations

import json

import pytest
from bench_scripts import ROOT, load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_point_writes_every_variant(tmp_path, monkeypatch):
    bench = load_benchmark("bench_ref_decode_cpu")
    from mla_backends.ref_torch import backend as ref

    paths = []
    inner = ref.RefTorchBackend._stream

    def spy(*args):
        paths.append("streamed")
        return inner(*args)

    monkeypatch.setattr(ref.RefTorchBackend, "_stream", staticmethod(spy))
    monkeypatch.setattr(bench, "MAX_CALLS", 1)  # one timed call a round: the count below is exact
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    assert bench.main(["--contexts", "20", "--rounds", "1", "--threads", "1", "--before", ROOT, "--paths",
                       "--json", str(out), "--png", str(png)]) == 0
    row = json.loads(out.read_text())["decode"][0]
    assert row["context"] == 20 and row["path"] == "padded"
    assert all(row[f"{k}_ms"] > 0 for k in ("ref", "padded", "streamed", "baseline", "before", "roofline"))
    assert row["ref_over_roofline"] == pytest.approx(row["ref_ms"] / row["roofline_ms"], rel=0.05)
    assert row["bound"] in ("compute", "memory")
    # the streamed variant only: its warm-up call, then the round's untimed call and its one timed call
    assert paths and len(paths) == 1 + 2
    assert json.loads(out.read_text())["clock"] == "thread"
    with pytest.raises(SystemExit):
        bench.main(["--before", str(tmp_path), "--json", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 0  # the picture, drawn from the same figures


def test_paired_rounds_time_each_function_beside_one_matmul():
    """Every round: one matmul timed, then each function called twice (once untimed, its data back in cache);
    the figures come back per round, in step."""
    bench = load_benchmark("bench_ref_decode_cpu")
    calls = {"a": 0, "b": 0}

    def make(name):
        def fn():
            calls[name] += 1
        return fn

    times, rates = bench.paired_rounds({"a": make("a"), "b": make("b")}, 5)
    assert calls == {"a": 10, "b": 10}
    assert len(rates) == 5 and all(r > 0 for r in rates)
    assert len(times["a"]) == len(times["b"]) == 5
    assert bench._quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and bench._quantile([1.0, 3.0], 0.25) == 1.5


def test_paired_figures_of_the_compiled_kernel(tmp_path):
    bench = load_benchmark("bench_ref_decode_cpu")
    if bench.fused_backend() is None:
        pytest.skip("CPU_FUSED is not built here (mla-backends build)")
    out = tmp_path / "p.json"
    assert bench.main(["--contexts", "16", "40", "--rounds", "1", "--threads", "1", "--pairs", "3",
                       "--skip", "cpu_mla", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    for row in got["decode"]:
        low, high = row["fused_over_roofline_paired_quartiles"]
        assert row["paired_rounds"] == 3 and 0 < low <= row["fused_over_roofline_paired"] <= high
        assert 0 < row["fused_ms_at_best_matmul"]
        slow, fast = row["paired_matmul_gflops"]
        assert 0 < slow <= fast
    assert got["fused_fixed_cost_ms_paired"] is not None  # two contexts under 256: a line through them


def test_layout_benchmark_times_every_alternative(tmp_path):
    """``benchmarks/bench_decode_layouts_cpu.py`` end to end at one call a round: every alternative timed, the
    pooled max checked equal to ``amax`` on the way."""
    bench = load_benchmark("bench_decode_layouts_cpu")
    out = tmp_path / "l.json"
    assert bench.main(["--rounds", "1", "--calls", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert len(got["layouts"]) == 7 and len(got["reductions"]) == 2 and len(got["bf16"]) == 2
    for row in got["layouts"]:
        assert all(row[f"{k}_us"] > 0 for k in ("q_at_kv_t", "kv_at_q_t_view", "kv_at_q_t_copy", "q_t_copy_only"))
    for row in got["reductions"]:
        assert all(row[f"{k}_us"] > 0 for k in ("amax_dim1", "pool_max", "exp", "exp_floored"))
    assert all(row["fp32_us"] > 0 and row["bf16_us"] > 0 for row in got["bf16"])


def test_compile_benchmark_compares_the_same_attention(tmp_path):
    """``benchmarks/bench_compile_cpu.py`` end to end at one short context: the eager and compiled functions
    and the backend all timed, and the compiled output equal to REF_TORCH's (the comparison is of one
    computation)."""
    bench = load_benchmark("bench_compile_cpu")
    out = tmp_path / "c.json"
    assert bench.main(["--contexts", "20", "--calls", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 20 and row["max_diff"] < 1e-4
    assert all(row[k] > 0 for k in ("first_compiled_call_s", "ref_torch_ms", "eager_ms", "compiled_ms"))
