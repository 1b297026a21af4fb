"""``benchmarks/bench_triton_targets.py`` without a GPU: the dry run, the CPU exit, the target arithmetic, and
the multi-token inputs it shares with ``bench_decode_gpu.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from bench_scripts import ROOT, benchmark_path, fake_h200, load_benchmark

PATH = benchmark_path("bench_triton_targets")


@pytest.fixture(scope="module")
def targets():
    return load_benchmark("bench_triton_targets")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, PATH, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_dry_run_lists_every_point_with_its_roofline(tmp_path):
    res = _run("--dry-run", "--gpu", "h200", "--json", str(tmp_path / "t.json"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    recs = doc["records"]
    assert len(recs) == 2 * 2 * 2 * 2 * 2  # kernels x heads x query lengths x contexts x batches
    by = {(r["kernel"], r["heads"], r["query_len"], r["batch"], r["context"]): r for r in recs}
    # 16 heads are memory-bound; 4-token queries read the cache once (same bytes but the queries/outputs)
    one, four = by[("rows", 16, 1, 64, 4096)], by[("rows", 16, 4, 64, 4096)]
    assert one["bound"] == "memory" and four["flops"] == pytest.approx(4 * one["flops"])
    assert four["bytes"] - one["bytes"] == 64 * 3 * 16 * (576 + 512) * 2
    assert by[("rows", 128, 1, 64, 4096)]["bound"] == "compute"
    assert all(t["value"] is None and t["reason"] == "not measured" for t in doc["targets"])


def test_without_cuda_nothing_is_timed_and_it_says_why():
    res = _run()
    assert res.returncode == 0 and "no CUDA device" in res.stdout
    assert _run("--dry-run").returncode == 2  # the CPU has no peaks: it asks for --gpu


def test_targets_from_records(targets):
    def rec(kernel, heads, q, t, roofline=100.0, compute=80.0, batch=64, context=4096):
        return dict(kernel=kernel, heads=heads, query_len=q, batch=batch, context=context, time_us=t,
                    roofline_us=roofline, compute_us=compute)

    records = [
        rec("rows", 16, 1, 125.0), rec("rows", 16, 4, 150.0), rec("heads", 16, 1, 150.0),
        rec("rows", 128, 1, 200.0), rec("heads", 128, 1, 500.0), rec("rows", 128, 4, 700.0),
        rec("rows", 16, 1, 200.0, batch=128),  # the worst 16-head point decides: 0.5
    ]
    got = {t["name"]: t for t in targets.evaluate(records)}
    assert got["rows_16h_memory"]["value"] == pytest.approx(0.5) and got["rows_16h_memory"]["met"] is False
    assert got["rows_128h_compute"]["value"] == pytest.approx(0.4) and got["rows_128h_compute"]["met"] is False
    assert got["rows_vs_heads_128h"]["value"] == pytest.approx(2.5) and got["rows_vs_heads_128h"]["met"]
    assert got["rows_4tok_16h"]["value"] == pytest.approx(1.2) and got["rows_4tok_16h"]["met"]
    assert got["rows_4tok_128h"]["value"] == pytest.approx(3.5) and got["rows_4tok_128h"]["met"] is None


def test_multi_token_inputs(targets):
    pt = dict(batch=3, context=70, heads=4, query_len=4, kv_cache_dtype="bfloat16")
    cache, meta, ql, qr = targets.bench.build_inputs(torch, pt, 16, "cpu")
    assert ql.shape == (12, 4, 512) and qr.shape == (12, 4, 64)
    assert list(meta.query_lens) == [4, 4, 4] and list(meta.seq_lens) == [70, 70, 70]


def test_timed_run_end_to_end_with_the_gpu_faked(targets, tmp_path, monkeypatch):
    """The timed path as it runs on a GPU, with the GPU parts replaced: small CPU inputs, a fake timer whose
    times make the rows kernel 2.5x faster at 128 heads. Catches wiring errors the dry run cannot."""
    bench = targets.bench
    fake_h200(monkeypatch, bench)

    def fake_time(_torch, backend, inputs, _opts, scale):
        assert scale == pytest.approx(bench.point_dims(128).softmax_scale)
        heads, tokens = inputs[2].shape[1], inputs[2].shape[0]
        us = (400.0 if backend.kernel == "heads" else 160.0) * (heads / 128 + 0.1) * (1 + 0.05 * (tokens > 2))
        return {"call_ms": us / 1e3, "kernel_ms": us / 1e3}

    monkeypatch.setattr(bench, "time_backend", fake_time)
    out = tmp_path / "targets.json"
    assert targets.main(["--json", str(out), "--iters", "1", "--warmup", "0"]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["records"]) == 32 and not doc["errors"] and not doc["not_run"]
    assert all(r["time_us"] > 0 and r["roofline_fraction"] > 0 for r in doc["records"])
    assert {r["runs"] for r in doc["records"] if r["kernel"] == "rows"} == {"rows"}
    got = {t["name"]: t for t in doc["targets"]}
    assert got["rows_vs_heads_128h"]["value"] == pytest.approx(2.5) and got["rows_vs_heads_128h"]["met"]
    assert got["rows_4tok_16h"]["value"] == pytest.approx(1.05) and got["rows_4tok_16h"]["met"]
    assert all(t["value"] is not None for t in doc["targets"])


def test_rows_targets_say_when_the_rows_kernel_did_not_run(targets):
    recs = [dict(kernel=k, heads=128, query_len=1, batch=64, context=4096, time_us=100.0, roofline_us=50.0,
                 compute_us=40.0, runs="heads") for k in ("heads", "rows")]
    got = {t["name"]: t for t in targets.evaluate(recs)}
    assert got["rows_vs_heads_128h"]["value"] is None
    assert got["rows_vs_heads_128h"]["reason"] == "the rows kernel is not chosen on this device"
