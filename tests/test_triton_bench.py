"""``benchmarks/bench_decode_gpu.py`` without a GPU: arguments, peaks, the roofline records, the CPU exit."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import benchmark_path, fake_h200, load_benchmark

PATH = benchmark_path("bench_decode_gpu")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_decode_gpu")


def test_peaks_come_from_the_gpu_table_and_flags_override(bench):
    args = bench.parse_args([])
    spec, bw, fl = bench.peaks(args, "NVIDIA H100 80GB HBM3")
    assert spec.key == "h100" and bw == 3.35e12 and fl == pytest.approx(989.4e12)
    assert bench.peaks(args, "NVIDIA H100 PCIe")[1] == 2.0e12
    assert bench.peaks(args, "NVIDIA GeForce RTX 3060") == (None, None, None)
    spec, bw, fl = bench.peaks(bench.parse_args(["--gpu", "H200", "--peak-gbps", "4300"]), "whatever")
    assert spec.key == "h200" and bw == 4.3e12 and fl == pytest.approx(989.4e12)
    assert bench.peaks(bench.parse_args(["--peak-tflops", "790", "--peak-gbps", "1"]), "x")[1:] == (1e9, 790e12)
    with pytest.raises(SystemExit):
        bench.parse_args(["--gpu", "v100"])


def test_judge_bytes_flops_and_bound(bench):
    from mla_backends.core.gpus import gpu_spec

    h200 = gpu_spec("h200")
    args = bench.parse_args([])
    point = dict(batch=64, context=16384, heads=128, kv_cache_dtype="bfloat16")
    r = bench.judge(point, "TRITON_MLA", h200, h200.bandwidth_bytes_per_s, h200.tensor_flops_per_s(), args)
    assert r["flops"] == 64 * 16384 * 2 * 128 * 1088 and r["bound"] == "compute"
    assert r["bytes"] == 64 * 16384 * 1152 + 64 * 128 * 1088 * 2
    # fp8: half the cache bytes; judged at the bf16 peak, except for a backend that multiplies in fp8
    fp8 = dict(point, kv_cache_dtype="fp8_e4m3")
    tri = bench.judge(fp8, "TRITON_MLA", h200, 4.8e12, 989.4e12, args)
    trt = bench.judge(fp8, "FLASHINFER_MLA_TRTLLM", h200, 4.8e12, 989.4e12, args)
    assert tri["bytes"] == 64 * 16384 * 576 + 64 * 128 * 1088 * 2 and tri["peak_flops_from"] == "bf16"
    assert trt["peak_flops_from"] == "fp8" and trt["roofline_us"] < tri["roofline_us"]
    r16 = bench.judge(dict(point, heads=16), "TRITON_MLA", h200, 4.8e12, 989.4e12, args)
    assert r16["bound"] == "memory"


def test_dry_run_json_for_h200(bench, tmp_path, capsys):
    out = tmp_path / "grid.json"
    assert bench.main(["--dry-run", "--gpu", "h200", "--backends", "TRITON_MLA,REF_TORCH",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["gpu"] == "h200" and data["device"]["simulated"] is True
    recs = data["records"]
    assert {r["backend"] for r in recs} == {"TRITON_MLA", "REF_TORCH"} and len(recs) == 2 * 48
    fields = {"backend", "gpu", "batch", "context", "heads", "kv_cache_dtype", "bytes", "flops", "roofline_us",
              "bound"}
    assert all(fields <= set(r) and "time_us" not in r for r in recs)
    big = [r for r in recs if r["heads"] == 128 and r["context"] == 16384 and r["kv_cache_dtype"] == "bfloat16"]
    assert big and all(r["bound"] == "compute" for r in big)
    assert all(r["bound"] == "memory" for r in recs if r["heads"] == 16)
    assert data["estimate_s"] > 0 and "about" in capsys.readouterr().out


def test_dry_run_skips_what_the_declarations_refuse(bench, tmp_path):
    out = tmp_path / "grid.json"
    assert bench.main(["--dry-run", "--gpu", "a100", "--quick", "--backends", "TRITON_MLA",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # TRITON_MLA declares fp8 caches from SM89: on an A100 only the bf16 points are records
    assert {r["kv_cache_dtype"] for r in data["records"]} == {"bfloat16"}
    assert {s["kv_cache_dtype"] for s in data["skipped"]} == {"fp8_e4m3"}


def test_arguments(bench):
    args = bench.parse_args(["--batch", "2,4", "--context", "1k,300", "--quick"])
    assert args.batch == (1, 64) and args.context == (4096,) and args.heads == (128,)
    args = bench.parse_args(["--context", "1k,300", "--heads", "16"])
    assert args.context == (1024, 300) and len(bench.grid(args)) == 4 * 2 * 1 * 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit; this machine has CUDA")
def test_exits_cleanly_without_a_gpu(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--quick", "--output", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not out.exists()
    assert bench.main(["--dry-run", "--quick", "--backends", "TRITON_MLA"]) == 0
    text = capsys.readouterr().out
    assert "4 grid points" in text and "peaks unknown" in text


def test_json_writer(bench, tmp_path):
    path = tmp_path / "sub" / "r.json"
    bench.write_json(str(path), {"records": [{"time_us": 1.5, "device": ("cuda", (9, 0))}]})
    assert json.loads(path.read_text())["records"][0]["time_us"] == 1.5


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_inputs_it_builds_are_valid(bench, kv):
    from mla_backends.ref_torch import RefTorchBackend

    point = dict(batch=3, context=100, heads=16, kv_cache_dtype=kv)
    cache, meta, ql, qr = bench.build_inputs(torch, point, 64, "cpu")
    assert meta.seq_lens_list == (100, 100, 100) and cache.kv_cache_dtype == kv
    assert sorted(meta.block_table.flatten().tolist()) == list(range(cache.num_blocks))  # scattered, all used
    out, lse = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=0.1)
    assert bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(lse).all())


def test_timed_run_end_to_end_with_the_gpu_faked(bench, tmp_path, monkeypatch):
    """The timed path of a GPU run with the GPU parts replaced (small CPU inputs, a fake timer): every
    record gets a time and a roofline fraction, and nothing in the wiring raises."""
    fake_h200(monkeypatch, bench)
    seen = []

    def fake_time(_torch, backend, inputs, _opts, scale):
        seen.append((type(backend).__name__, scale))
        return {"call_ms": 0.2, "kernel_ms": 0.1}

    monkeypatch.setattr(bench, "time_backend", fake_time)
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--backends", "TRITON_MLA,REF_TORCH", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["records"] and not doc["errors"], doc["errors"]
    assert all(r["time_us"] == pytest.approx(100.0) and r["roofline_fraction"] > 0 for r in doc["records"])
    assert seen and all(s == pytest.approx(bench.softmax_scale()) for _, s in seen)
