"""Where REF_TORCH's CPU decode time goes: one ``forward_mqa`` per shape under ``torch.profiler``, the ops'
self CPU time summed into matmul / gather / softmax (+ mask, LSE) / copies and conversions / other, and the
rest of the call's time (Python: validation, dispatch, the plan lookup) as ``python``.

Shapes: contexts short (64, 256), medium (1024, 2048) and long (4096, 16384), batch 1, 8 and 32, 16 and 128
heads, float32 and bfloat16 (a subset of the full grid, ``--quick`` smaller still). The step is planned once
(``plan_step``) outside the profile, as for every layer after the first.

Usage: ``python benchmarks/profile_ref_decode_cpu.py [--threads 1] [--quick] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

CATEGORIES = {
    "matmul": ("aten::bmm", "aten::mm", "aten::baddbmm", "aten::baddbmm_", "aten::matmul", "aten::addmm"),
    "gather": ("aten::index_select", "aten::index", "aten::gather"),
    "softmax": ("aten::amax", "aten::sub_", "aten::exp_", "aten::sum", "aten::div_", "aten::log_", "aten::add_",
                "aten::masked_fill_", "aten::exp", "aten::maximum", "aten::log", "aten::div", "aten::mul_",
                "aten::mul", "aten::sub", "aten::add", "aten::fill_", "aten::zero_"),
    "copy": ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::to", "aten::index_copy_", "aten::clone"),
}
GRID = [(64, 8, 16), (256, 8, 16), (1024, 8, 16), (2048, 8, 16), (4096, 8, 16), (16384, 1, 16),
        (256, 1, 16), (256, 32, 16), (1024, 32, 16), (256, 8, 128), (2048, 8, 128), (4096, 1, 128)]


def profile_one(ctx: int, batch: int, heads: int, dtype: torch.dtype, calls: int = 3) -> dict:
    import bench_ref_decode_cpu as bench

    import mla_backends
    from mla_backends.ref_torch.backend import RefTorchBackend

    bench.HEADS, bench.DTYPE = heads, dtype
    inp = bench.Inputs(mla_backends, ctx, batch)
    call = inp.call(RefTorchBackend())
    call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    wall = (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    sums = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    for ev in prof.key_averages():
        cat = next((c for c, names in CATEGORIES.items() if ev.key in names), "other")
        sums[cat] += ev.self_cpu_time_total / calls / 1e3
    ops = sum(sums.values())
    row = {"context": ctx, "batch": batch, "heads": heads, "dtype": str(dtype).split(".")[-1],
           "call_ms": round(wall * 1e3, 3), **{f"{k}_ms": round(v, 3) for k, v in sums.items()},
           "python_ms": round(max(0.0, wall * 1e3 - ops), 3)}
    print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = GRID[:3] if args.quick else GRID
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()}", flush=True)
    rows = [profile_one(c, b, h, dt) for c, b, h in grid
            for dt in ((torch.float32,) if args.quick else (torch.float32, torch.bfloat16))]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "load_end": os.getloadavg(), "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
