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
HEADS = (128, 16)  # 128 first: a run cut short by its time cap keeps the two 128-head targets
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
    """Timed records of ``kernel`` matching ``where``; a ``rows`` record counts only when the rows kernel is
    what ran (``runs``; off SM90 the variant falls back to the portable kernel)."""
    return [r for r in records if r["kernel"] == kernel and r.get("time_us")
            and r.get("runs", kernel) == kernel and all(r[k] == v for k, v in where.items())]


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets from timed records (each with ``kernel``, the point and ``time_us``; ``roofline_us`` and
    ``compute_us`` when the peaks were known)."""
    values: dict[str, float | None] = {}
    r16 = [r for r in _time(records, "rows", heads=16, query_len=1) if r.get("roofline_us")]
    values["rows_16h_memory"] = min((r["roofline_us"] / r["time_us"] for r in r16), default=None)
    r128 = _time(records, "rows", heads=128, query_len=1)
    values["rows_128h_compute"] = min((r["compute_us"] / r["time_us"] for r in r128 if r.get("compute_us")),
                                      default=None)
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
    fell_back = any(r["kernel"] == "rows" and r.get("runs") not in (None, "rows") for r in records)
    out = []
    for name, what, op, threshold in TARGETS:
        v = values[name]
        met = None if v is None or op is None else (v >= threshold if op == ">=" else v <= threshold)
        entry = {"name": name, "what": what, "value": v, "target": None if op is None else f"{op} {threshold}",
                 "met": met}
        if v is None:
            entry["reason"] = ("the rows kernel is not chosen on this device" if fell_back else "not measured")
        out.append(entry)
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
    from mla_backends.core.gpus import gpu_spec

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
        if args.dry_run:
            print(f"bench_triton_targets: no peaks for {device.name!r} (not in docs/gpus.md): pass --gpu NAME")
            return 2
        print(f"bench_triton_targets: {device.name!r} is not in the GPU table (docs/gpus.md): timing without "
              "the roofline (the ratio targets still count); --gpu NAME gives the peaks")
    base = [dict(kernel=k, **pt) for pt in points() for k in KERNELS]
    if bw and fl:
        for rec in base:
            rec.update(roofline_fields(rec, spec, bw, fl, opts))
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
    run_points(torch, base, opts, args.max_seconds, payload, args.output or "bench_triton_targets.json")
    for t in payload["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target {t['name']:<20} {v:>6} {t['target'] or '(reported)':<8} "
              f"{'met' if t['met'] else ('missed' if t['met'] is False else '')}  {t['what']}"
              f"{'  (' + t['reason'] + ')' if t.get('reason') else ''}")
    return 0


def roofline_fields(rec: dict[str, Any], spec: Any, bw: float, fl: float, opts: Any) -> dict[str, Any]:
    """``bench_decode_gpu.judge``'s fields for a record, plus ``compute_us`` (the FLOP term alone)."""
    from mla_backends.planning.roofline import decode_roofline

    fields = bench.judge(rec, "TRITON_MLA", spec, bw, fl, opts)
    r = decode_roofline(bench.point_dims(rec["heads"]), [rec["context"]] * rec["batch"], cache_bytes=2,
                        peak_bytes_per_s=bw, peak_flops_per_s=fl, query_lens=[rec["query_len"]] * rec["batch"])
    return {**fields, "compute_us": r.compute_us}


def run_points(torch: Any, base: list[dict[str, Any]], opts: Any, max_seconds: float | None,
               payload: dict[str, Any], path: str) -> None:
    """Time every record of ``base`` on the GPU, point by point, rewriting ``path`` (records and targets so
    far) after each point, so a run cut short by its time cap keeps what it measured."""
    from mla_backends.triton_mla import TritonMLABackend

    backends = {k: TritonMLABackend.variant(kernel=k)() for k in KERNELS}
    scale = bench.softmax_scale()
    t0 = time.monotonic()
    for pt in points():
        recs = [r for r in base if all(r[k] == v for k, v in pt.items())]
        if max_seconds and time.monotonic() - t0 > max_seconds:
            payload["not_run"] += [{**r, "reason": f"--max-seconds {max_seconds}"} for r in recs]
            continue
        try:
            inputs = bench.build_inputs(torch, pt, PAGE, "cuda")
        except torch.cuda.OutOfMemoryError as exc:
            payload["errors"].append({**pt, "error": f"out of memory building inputs: {exc}"})
            torch.cuda.empty_cache()
            continue
        cache, _, q_latent, _ = inputs
        for rec in recs:
            backend = backends[rec["kernel"]]
            # what the variant runs on this device (off SM90 "rows" falls back to the portable kernel)
            cfg = backend.launch_config(q_latent.dtype, cache.data.dtype, cache.kv_lora_rank,
                                        cache.qk_rope_head_dim, rec["heads"], cache.device)
            rec.update(config=cfg.name, runs=cfg.kernel)
            try:
                t = bench.time_backend(torch, backend, inputs, opts, scale)
            except Exception as exc:  # one kernel failing must not stop the other
                payload["errors"].append({**rec, "error": f"{type(exc).__name__}: {exc}"})
                continue
            ms = t["kernel_ms"] or t["call_ms"]
            rec.update(call_ms=t["call_ms"], kernel_ms=t["kernel_ms"], time_us=ms * 1e3)
            if "warning" in t:
                rec["warning"] = t["warning"]
            if rec.get("roofline_us"):
                rec["roofline_fraction"] = rec["roofline_us"] / rec["time_us"]
            payload["records"].append(rec)
            frac = rec.get("roofline_fraction")
            print(f"{rec['kernel']:<5} ({rec['config']}) H={rec['heads']:<3} q={rec['query_len']} "
                  f"batch={rec['batch']:<3} ctx={rec['context']:<5} {rec['time_us']:9.1f} us"
                  + (f"  {100 * frac:5.1f}% of the roofline ({rec['bound']})" if frac else ""), flush=True)
        del inputs, cache, q_latent
        torch.cuda.empty_cache()
        payload["targets"] = evaluate(payload["records"])
        bench.write_json(path, payload)
    payload["targets"] = evaluate(payload["records"])
    bench.write_json(path, payload)


if __name__ == "__main__":
    sys.exit(main())
