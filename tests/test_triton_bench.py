"""``benchmarks/bench_decode_gpu.py`` without a GPU: arguments, rates, the peak table, the CPU exit."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "benchmarks", "bench_decode_gpu.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_gpu", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_table(bench):
    assert bench.peak_gbps_for("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.peak_gbps_for("NVIDIA H100 PCIe") == 2000.0
    assert bench.peak_gbps_for("NVIDIA H200") == 4800.0
    assert bench.peak_gbps_for("NVIDIA B200") == 8000.0
    assert bench.peak_gbps_for("NVIDIA GeForce RTX 3060") is None


def test_bytes_and_flops(bench):
    # one request, 4096 positions, bf16: 4096 rows of 576 * 2 bytes; QK (576) + PV (512) MACs per head and row
    assert bench.cache_bytes_read([4096], bench.point_dims(128), 2) == 4096 * 1152
    assert bench.absorbed_flops([4096], bench.point_dims(128)) == 2 * 128 * 4096 * (576 + 512)
    r = bench.rates(dict(batch=2, context=1000, heads=16, kv_cache_dtype="fp8_e4m3"), 1.0, 1, 1000.0)
    assert r["bytes"] == 2 * 1000 * 576 and r["gbps"] == pytest.approx(1.152)
    assert r["fraction_of_peak"] == pytest.approx(1.152e-3)


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
    assert "TRITON_MLA" in text and "4 grid points" in text


def test_json_writer(bench, tmp_path):
    path = tmp_path / "sub" / "r.json"
    bench.write_json(str(path), {"results": [{"gbps": 1.5, "device": ("cuda", (9, 0))}]})
    assert json.loads(path.read_text())["results"][0]["gbps"] == 1.5


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_inputs_it_builds_are_valid(bench, kv):
    from mla_backends.ref_torch import RefTorchBackend

    point = dict(batch=3, context=100, heads=16, kv_cache_dtype=kv)
    cache, meta, ql, qr = bench.build_inputs(torch, point, 64, "cpu")
    assert meta.seq_lens_list == (100, 100, 100) and cache.kv_cache_dtype == kv
    assert sorted(meta.block_table.flatten().tolist()) == list(range(cache.num_blocks))  # scattered, all used
    out, lse = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=0.1)
    assert bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(lse).all())
