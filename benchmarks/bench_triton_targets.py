"""Issue 16's targets for TRITON_MLA on Hopper, measured in one run: the ``rows`` kernel against the portable
``heads`` kernel ("today's kernel") and against the roofline, 1- and 4-token queries.

    python benchmarks/bench_triton_targets.py --json out.json          # on a GPU (SM90 for the rows kernel)
    python benchmarks/bench_triton_targets.py --dry-run --gpu h200     # the points and the roofline, no GPU

Points: bf16 cache, page 64, batch 64 and 128, context 4k and 16k, heads 16 and 128, query length 1 and 4,
each timed with ``TritonMLABackend.variant(kernel="heads")`` and ``variant(kernel="rows")``. The times come
from ``bench_decode_gpu.time_backend`` (profiler kernel time, else CUDA events). Targets:

* ``rows_16h_memory``: 16 heads, 1-token queries, batch >= 64, context >= 4k: the worst roofline fraction
  of the rows kernel >= 0.70 (memory-bound);
* ``rows_128h_compute``: 128 heads, 1-token queries: the worst fraction of the compute bound >= 0.50;
* ``rows_vs_heads_128h``: 128 heads, 1-token queries: the smallest speed-up of rows over heads >= 2;
* ``rows_4tok_16h``: 16 heads: the largest time ratio of 4-token to 1-token queries <= 1.3;
* ``rows_4tok_128h``: the same ratio at 128 heads, reported only (4 tokens are 4x the FLOPs there).

The JSON holds the records and ``targets`` (value, target, met, or null with the reason when nothing was
measured). Without a CUDA device a timed run says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.dirname(HERE)) if p not in sys.path]

import bench_decode_gpu as bench  # noqa: E402  (the shared timing and roofline helpers)

BATCHES = (64, 128)
CONTEXTS = (4096, 16384)
HEADS = (16, 128)
QUERY_LENS = (1, 4)
KERNELS = ("heads", "rows")
PAGE = 64
#: (name, what, comparison, threshold)
TARGETS = (
    ("rows_16h_memory", "16 heads, 1 token: worst roofline fraction of the rows kernel", ">=", 0.70),
    ("rows_128h_compute", "128 heads, 1 token: worst fraction of the compute bound (rows)", ">=", 0.50),
    ("rows_vs_heads_128h", "128 heads, 1 token: smallest speed-up of rows over heads", ">=", 2.0),
    ("rows_4tok_16h", "16 heads: largest time ratio of 4-token to 1-token queries (rows)", "<=", 1.3),
    ("rows_4tok_128h", "128 heads: largest time ratio of 4-token to 1-token queries (rows; reported only)",
     None, None),
)


def points() -> list[dict[str, Any]]:
    return [dict(batch=b, context=c, heads=h, query_len=q, kv_cache_dtype="bfloat16")
            for h in HEADS for q in QUERY_LENS for c in CONTEXTS for b in BATCHES]


def _time(records: list[dict], kernel: str, **where: int) -> list[dict]:
    return [r for r in records if r["kernel"] == kernel and r.get("time_us")
            and all(r[k] == v for k, v in where.items())]


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets from timed records (each with ``kernel``, the point, ``time_us`` and ``roofline_us``)."""
    values: dict[str, float | None] = {}
    r16 = _time(records, "rows", heads=16, query_len=1)
    values["rows_16h_memory"] = min((r["roofline_us"] / r["time_us"] for r in r16), default=None)
    r128 = _time(records, "rows", heads=128, query_len=1)
    values["rows_128h_compute"] = min((r["compute_us"] / r["time_us"] for r in r128), default=None)
    speedups = []
    for r in r128:
        h = _time(records, "heads", heads=128, query_len=1, batch=r["batch"], context=r["context"])
        speedups += [x["time_us"] / r["time_us"] for x in h]
    values["rows_vs_heads_128h"] = min(speedups, default=None)
    for heads in HEADS:
        ratios = []
        for r in _time(records, "rows", heads=heads, query_len=4):
            one = _time(records, "rows", heads=heads, query_len=1, batch=r["batch"], context=r["context"])
            ratios += [r["time_us"] / x["time_us"] for x in one]
        values[f"rows_4tok_{heads}h"] = max(ratios, default=None)
    out = []
    for name, what, op, threshold in TARGETS:
        v = values[name]
        met = None if v is None or op is None else (v >= threshold if op == ">=" else v <= threshold)
        out.append({"name": name, "what": what, "value": v, "target": None if op is None else f"{op} {threshold}",
                    "met": met, **({"reason": "not measured"} if v is None else {})})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="output", default=None, help="write records and targets to this file")
    p.add_argument("--gpu", default=None, help="a GPU of the package's table, for the peaks (default: detected)")
    p.add_argument("--dry-run", action="store_true", help="list the points and their roofline; time nothing")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per point (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per point (default 10)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop starting points after this long")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        p.error(f"--warmup/--iters: got {args.warmup}/{args.iters}; supported >= 0 / >= 1")
    from mla_backends.gpus import gpu_spec

    try:
        gpu = gpu_spec(args.gpu) if args.gpu else None
    except ValueError as exc:
        p.error(f"--gpu: {exc}")
    import torch

    device = bench.simulated_device_for(gpu) if (args.dry_run and gpu) else bench.detect(torch)
    opts = SimpleNamespace(gpu=gpu, peak_gbps=None, peak_tflops=None, warmup=args.warmup, iters=args.iters,
                           no_profiler=False)
    spec, bw, fl = bench.peaks(opts, device.name)
    payload: dict[str, Any] = {"format": "mla-backends/bench-triton-targets/v1", "gpu": spec.key if spec else
                               device.name, "torch": torch.__version__, "records": [], "errors": [],
                               "not_run": []}
    if not args.dry_run and (not device.is_cuda or not torch.cuda.is_available()):
        print("bench_triton_targets: no CUDA device (torch.cuda.is_available() is False); nothing timed. "
              "--dry-run --gpu h200 lists the points.")
        return 0
    if not (bw and fl):
        print(f"bench_triton_targets: no peaks for {device.name!r} (not in docs/gpus.md): pass --gpu NAME")
        return 2
    from mla_backends.roofline import decode_roofline

    base = [dict(kernel=k, **pt) for pt in points() for k in KERNELS]
    for rec in base:
        rec.update(bench.judge(rec, "TRITON_MLA", spec, bw, fl, opts))
        r = decode_roofline(bench.point_dims(rec["heads"]), [rec["context"]] * rec["batch"], cache_bytes=2,
                            peak_bytes_per_s=bw, peak_flops_per_s=fl,
                            query_lens=[rec["query_len"]] * rec["batch"])
        rec["compute_us"] = r.compute_us
    if args.dry_run:
        print(f"device: {device.describe()}; {len(base)} records (point x kernel)")
        for rec in base:
            print(f"  {rec['kernel']:<5} H={rec['heads']:<3} q={rec['query_len']} batch={rec['batch']:<3} "
                  f"ctx={rec['context']:<5} roofline {rec['roofline_us']:8.1f} us ({rec['bound']})")
        payload["records"] = base
        payload["targets"] = evaluate([])
        if args.output:
            bench.write_json(args.output, payload)
        return 0
    from mla_backends.dims import MLADims
    from mla_backends.triton_mla import TritonMLABackend

    backends = {k: TritonMLABackend.variant(kernel=k)() for k in KERNELS}
    scale = MLADims().softmax_scale
    t0 = time.monotonic()
    for pt in points():
        recs = [r for r in base if all(r[k] == v for k, v in pt.items())]
        if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
            payload["not_run"] += [{**r, "reason": f"--max-seconds {args.max_seconds}"} for r in recs]
            continue
        inputs = bench.build_inputs(torch, pt, PAGE, "cuda")
        for rec in recs:
            try:
                t = bench.time_backend(torch, backends[rec["kernel"]], inputs, opts, scale)
            except Exception as exc:  # one kernel failing must not stop the other
                payload["errors"].append({**rec, "error": f"{type(exc).__name__}: {exc}"})
                continue
            ms = t["kernel_ms"] or t["call_ms"]
            rec.update(call_ms=t["call_ms"], kernel_ms=t["kernel_ms"], time_us=ms * 1e3,
                       roofline_fraction=rec["roofline_us"] / (ms * 1e3))
            payload["records"].append(rec)
            print(f"{rec['kernel']:<5} H={rec['heads']:<3} q={rec['query_len']} batch={rec['batch']:<3} "
                  f"ctx={rec['context']:<5} {rec['time_us']:9.1f} us  {100 * rec['roofline_fraction']:5.1f}% "
                  f"of the roofline ({rec['bound']})", flush=True)
        del inputs
        torch.cuda.empty_cache()
    payload["targets"] = evaluate(payload["records"])
    for t in payload["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target {t['name']:<20} {v:>6} {t['target'] or '(reported)':<8} "
              f"{'met' if t['met'] else ('missed' if t['met'] is False else '')}  {t['what']}")
    bench.write_json(args.output or "bench_triton_targets.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
