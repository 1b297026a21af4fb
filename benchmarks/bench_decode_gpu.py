#!/usr/bin/env python
"""GPU decode benchmark: every backend's ``forward_mqa`` over batch x context x heads, judged by its roofline.

Usage::

    python benchmarks/bench_decode_gpu.py                          # detected GPU, full grid
    python benchmarks/bench_decode_gpu.py --quick --json out.json  # batch 1/64, context 4k, 128 heads
    python benchmarks/bench_decode_gpu.py --dry-run --gpu h200 --json grid.json   # no GPU needed
    python benchmarks/bench_decode_gpu.py --peak-gbps 4300 --peak-tflops 790      # measured peaks instead

Grid (defaults): batch 1, 8, 64, 128; context 1k, 4k, 16k; heads 16, 128; kv caches bfloat16 and fp8_e4m3;
bf16 queries; DeepSeek-V3 latent (512 + 64); page size 64; one new token per request; scattered pages.

Each (point, backend) is judged against ``max(bytes / peak bandwidth, FLOPs / peak tensor rate)``
(``mla_backends.planning.roofline``): bytes are the cache rows read plus the queries and outputs, FLOPs the absorbed
core (``2 * H * (576 + 512)`` per row and query token). The peaks are the vendor's figures from the package's
GPU table (``mla_backends.core.gpus``; the detected device's name, or ``--gpu``); ``--peak-gbps`` and
``--peak-tflops`` override them. An fp8 cache is judged against the bf16 tensor peak unless the backend runs
fp8 MMA (:data:`FP8_MMA_BACKENDS`). Each record: ``backend, gpu, batch, context, heads, kv_cache_dtype, bytes,
flops, roofline_us, bound`` (``"memory"`` or ``"compute"``); a timed run adds ``time_us`` (the kernel time
from the profiler when it works, else the whole call from CUDA events) and ``roofline_fraction``
(roofline_us / time_us). A timed run rewrites its JSON after every point (and once before the first), so a
run killed by its time cap keeps the points it measured. ``--dry-run`` lists (and with ``--json`` writes) the
records a run would make on the GPU named, with each backend's verdict from its declarations on that
(simulated) device, and a time estimate. Without a CUDA device a timed run prints why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

DEFAULT_BATCHES = (1, 8, 64, 128)
DEFAULT_CONTEXTS = (1024, 4096, 16384)
DEFAULT_HEADS = (16, 128)
DEFAULT_KV_DTYPES = ("bfloat16", "fp8_e4m3")
#: backends whose fp8-cache path multiplies in fp8 (query quantised to fp8): judged against the fp8 peak.
#: The others (TRITON_MLA, FLASHINFER_MLA's fa3, REF_TORCH) dequantise fp8 rows and multiply in bf16/fp32.
FP8_MMA_BACKENDS = frozenset({"FLASHINFER_MLA_TRTLLM", "FLASHINFER_MLA_XQA"})
#: target from issue 6: Triton at batch >= 64, context >= 4k, 128 heads reaches this fraction of its roofline
TRITON_TARGET_FRACTION = 0.70
#: seconds a timed point is assumed to cost beyond its kernels (inputs, warm-up, profiler), for estimates
POINT_OVERHEAD_S = 0.6
#: seconds for a backend's first compile of one kernel configuration (Triton), for estimates
COMPILE_S = 4.0


def point_dims(heads: int) -> Any:
    """The benchmarked shapes: DeepSeek-V3's latent (512 + 64) with ``heads`` query heads."""
    from mla_backends.core.dims import MLADims

    return MLADims(num_heads=heads)


def softmax_scale() -> float:
    """The softmax scale of the benchmarked shapes (DeepSeek-V3's; it does not depend on the head count)."""
    return float(point_dims(128).softmax_scale)


def _kv_bytes(kv_cache_dtype: str) -> int:
    """Bytes per cache element of a canonical kv-cache dtype name (2 for bfloat16, 1 for fp8)."""
    import torch

    from mla_backends.core.dtypes import kv_cache_torch_dtype

    return kv_cache_torch_dtype(kv_cache_dtype, torch.bfloat16).itemsize


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(
            int(v.lower().replace("k", "")) * (1024 if v.lower().endswith("k") else 1)
            for v in text.split(",")
            if v.strip()
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; supported a comma-separated list of ints (4k ok)"
        ) from exc
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"got {text!r}; supported positive ints")
    return vals


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from mla_backends.core.gpus import gpu_spec

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=_int_list, default=DEFAULT_BATCHES, help="batch sizes (default 1,8,64,128)")
    p.add_argument("--context", type=_int_list, default=DEFAULT_CONTEXTS, help="context lengths (default 1k,4k,16k)")
    p.add_argument("--heads", type=_int_list, default=DEFAULT_HEADS, help="query heads (default 16,128)")
    p.add_argument("--kv-dtypes", type=_str_list, default=DEFAULT_KV_DTYPES,
                   help="kv cache dtypes (default bfloat16,fp8_e4m3)")
    p.add_argument("--page-size", type=int, default=64, help="cache page size (default 64)")
    p.add_argument("--backends", type=_str_list, default=None, help="only these backend names")
    p.add_argument("--gpu", default=None,
                   help="a GPU of the package's table (h200, b200, ...): its peaks, and for --dry-run the "
                        "simulated device (default: the detected one)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per point (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (default 20)")
    p.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth, GB/s (10**9 B/s)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense tensor rate, TFLOP/s")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop timing after this many seconds; the points left are recorded as not run")
    p.add_argument("--no-profiler", action="store_true", help="skip the kernel-time measurement")
    p.add_argument("--quick", action="store_true", help="batch 1,64; context 4k; heads 128")
    p.add_argument("--dry-run", action="store_true", help="list the records and verdicts, time nothing")
    p.add_argument("--json", "--output", dest="output", default=None,
                   help="write the records to this JSON file (a timed run defaults to bench_decode_gpu.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.heads = (1, 64), (4096,), (128,)
    from mla_backends.core.dtypes import canonical_kv_cache_dtype

    try:
        args.kv_dtypes = tuple(canonical_kv_cache_dtype(k) for k in args.kv_dtypes)
    except (ValueError, TypeError) as exc:
        p.error(f"--kv-dtypes: {exc}")
    if args.gpu is not None:
        try:
            args.gpu = gpu_spec(args.gpu)
        except ValueError as exc:
            p.error(f"--gpu: {exc}")
    if args.page_size < 1:
        p.error(f"--page-size: got {args.page_size}; supported >= 1")
    if args.warmup < 0 or args.iters < 1:
        p.error(f"--warmup/--iters: got {args.warmup}/{args.iters}; supported >= 0 / >= 1")
    for flag, v in (("--peak-gbps", args.peak_gbps), ("--peak-tflops", args.peak_tflops),
                    ("--max-seconds", args.max_seconds)):
        if v is not None and not v > 0:
            p.error(f"{flag}: got {v}; supported a positive number")
    return args


def simulated_device_for(spec: Any) -> Any:
    """A simulated selector device for a GPU-table row (compute capability, memory, SMs)."""
    from mla_backends.core.device import DeviceInfo

    return DeviceInfo(kind="cuda", name=spec.name, compute_capability=spec.compute_capability,
                      total_memory=spec.memory_bytes, sm_count=spec.sms, simulated=True)


def detect(torch: Any) -> Any:
    """The device as the selector sees it (NVML through ``selector.detect``; torch as a fallback)."""
    from mla_backends.core.device import CPU_DEVICE, device_info_for

    dev = None
    try:
        from selector.detect import detect_device

        dev = detect_device(0)
    except Exception:  # NVML trouble: torch below
        dev = None
    if (dev is None or not dev.is_cuda) and torch.cuda.is_available():
        dev = device_info_for(torch.device("cuda", 0))
    return dev or CPU_DEVICE


def peaks(args: argparse.Namespace, device_name: str) -> tuple[Any, float | None, float | None]:
    """(table row or None, peak bytes/s, peak bf16 FLOP/s): ``--gpu``, else the device name; flags override."""
    from mla_backends.core.gpus import gpu_spec_for_device_name

    spec = args.gpu or gpu_spec_for_device_name(device_name)
    bw = args.peak_gbps * 1e9 if args.peak_gbps else (spec.bandwidth_bytes_per_s if spec else None)
    fl = args.peak_tflops * 1e12 if args.peak_tflops else (spec.tensor_flops_per_s() if spec else None)
    return spec, bw, fl


def judge(point: dict[str, Any], backend: str, spec: Any, bw: float, flops_bf16: float,
          args: argparse.Namespace) -> dict[str, Any]:
    """The roofline fields of one record (bytes, flops, roofline_us, bound)."""
    from mla_backends.planning.roofline import decode_roofline

    peak_flops = flops_bf16
    fp8_mma = point["kv_cache_dtype"].startswith("fp8") and backend in FP8_MMA_BACKENDS
    if fp8_mma and spec is not None and not args.peak_tflops:
        peak_flops = spec.tensor_flops_per_s(fp8_mma=True)
    r = decode_roofline(point_dims(point["heads"]), [point["context"]] * point["batch"],
                        cache_bytes=_kv_bytes(point["kv_cache_dtype"]), peak_bytes_per_s=bw,
                        peak_flops_per_s=peak_flops, query_lens=[point.get("query_len", 1)] * point["batch"])
    return {"bytes": r.bytes, "flops": r.flops, "roofline_us": r.roofline_us, "bound": r.bound,
            "peak_flops_from": "fp8" if fp8_mma else "bf16"}


def candidate_backends(names: tuple[str, ...] | None) -> dict[str, type]:
    from mla_backends.plugins.loading import registered_backends

    found = dict(registered_backends())
    if names:
        wanted = {n.upper() for n in names}
        unknown = wanted - set(found)
        if unknown:
            raise SystemExit(
                f"--backends: got {', '.join(sorted(unknown))}; supported {', '.join(sorted(found))}"
            )
        found = {k: v for k, v in found.items() if k in wanted}
    return found


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        dict(batch=b, context=c, heads=h, kv_cache_dtype=kv)
        for kv in args.kv_dtypes
        for h in args.heads
        for c in args.context
        for b in args.batch
    ]


def verdicts(torch: Any, backends: dict[str, type], point: dict[str, Any], device: Any,
             page: int) -> dict[str, list[str]]:
    """Each backend's reasons against the point on ``device`` (empty: it runs)."""
    from mla_backends.backends.contract import AttentionSpec

    spec = AttentionSpec(num_heads=point["heads"], dtype=torch.bfloat16, kv_cache_dtype=point["kv_cache_dtype"],
                         block_size=page, need_lse=False, device=device)
    return {name: [str(r) for r in cls.not_supported_reasons(spec)] for name, cls in backends.items()}


def estimate_seconds(records: list[dict[str, Any]], args: argparse.Namespace) -> float:
    """Rough wall time of a timed run over ``records``: per point overhead, calls at the roofline (at least
    20 us each), one compile per (backend, heads, kv dtype)."""
    calls = args.warmup + args.iters * (1 if args.no_profiler else 2)
    configs = {(r["backend"], r["heads"], r["kv_cache_dtype"]) for r in records}
    points = {(r["batch"], r["context"], r["heads"], r["kv_cache_dtype"]) for r in records}
    kernels = sum(calls * max(r["roofline_us"], 20.0) * 1e-6 for r in records)
    return len(points) * POINT_OVERHEAD_S + kernels + len(configs) * COMPILE_S


def build_inputs(torch: Any, point: dict[str, Any], page: int, device: Any) -> tuple[Any, ...]:
    """A filled cache (scattered pages), metadata for ``point["query_len"]`` (default 1) new tokens per
    request seeing ``point["context"]`` positions in all, and random queries ``[batch * query_len, H, ...]``."""
    from mla_backends.step.cache import LatentKVCache
    from mla_backends.step.metadata import BatchMetadata

    B, ctx, H = point["batch"], point["context"], point["heads"]
    dims = point_dims(H)
    pages = -(-ctx // page)
    num_blocks = B * pages
    cache = LatentKVCache(
        num_blocks,
        page,
        dims.kv_lora_rank,
        dims.qk_rope_head_dim,
        kv_cache_dtype=point["kv_cache_dtype"],
        model_dtype=torch.bfloat16,
        device=device,
        scale=1.0,
    )
    flat = cache.data.view(-1, cache.row_width)
    step = 1 << 18
    for r0 in range(0, flat.shape[0], step):  # fill in chunks: no full-size fp32 temporary
        rows = torch.randn(
            min(step, flat.shape[0] - r0), cache.row_width, device=device, dtype=torch.bfloat16
        )
        flat[r0 : r0 + rows.shape[0]] = cache.quantize(rows)
    bt = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32).view(B, pages)
    q = int(point.get("query_len", 1))
    meta = BatchMetadata.build([q] * B, [ctx - q] * B, bt, page, num_blocks=num_blocks)
    q_latent = torch.randn(B * q, H, dims.kv_lora_rank, device=device, dtype=torch.bfloat16)
    q_rope = torch.randn(B * q, H, dims.qk_rope_head_dim, device=device, dtype=torch.bfloat16)
    return cache, meta, q_latent, q_rope



def _kernel_ms(torch: Any, fn: Any, iters: int) -> float | None:
    """GPU time per call (ms): the summed durations of every CUDA kernel/memcpy the calls ran, from the
    profiler (the input validation's few small kernels included); None when it cannot be measured."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        total_us = sum(
            e.time_range.elapsed_us()
            for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA
        )
        return total_us / 1000.0 / iters if total_us > 0 else None
    except Exception:
        return None



def time_backend(
    torch: Any, backend: Any, inputs: tuple[Any, ...], args: argparse.Namespace, scale: float
) -> dict[str, Any]:
    cache, meta, q_latent, q_rope = inputs
    out = torch.empty_like(q_latent)
    lse = None
    if backend.capabilities.returns_lse:  # backends without an LSE are not handed a buffer for one
        lse = torch.empty(q_latent.shape[:2], device=q_latent.device, dtype=torch.float32)

    def call() -> None:
        backend.forward_mqa(q_latent, q_rope, cache, meta, scale=scale, out=out, lse_out=lse)

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        call()
    stop.record()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"call_ms": start.elapsed_time(stop) / args.iters}
    result["kernel_ms"] = None if args.no_profiler else _kernel_ms(torch, call, args.iters)
    if not bool(torch.isfinite(out.float()).all()):
        result["warning"] = "non-finite output"
    return result


def print_row(r: dict[str, Any]) -> None:
    t = r.get("time_us")
    frac = r.get("roofline_fraction")
    print(f"{r['backend']:<24} {r['kv_cache_dtype']:<9} {r['batch']:>5} {r['context']:>6} {r['heads']:>5} "
          f"{r['roofline_us']:>11.1f} {r['bound']:<8} {(f'{t:.1f}') if t else '-':>9} "
          f"{('%.0f%%' % (100 * frac)) if frac is not None else '-':>6}", flush=True)


def write_json(path: str, payload: dict[str, Any], quiet: bool = False) -> None:
    """Write ``payload`` to ``path`` whole or not at all (a temporary file renamed over it), so a run killed
    while writing leaves the previous version."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


def runnable_points(torch: Any, args: argparse.Namespace, device: Any, gpu_key: str, spec: Any, bw: float | None,
                    fl: float | None) -> tuple[list[tuple[dict[str, Any], list[tuple[str, type]]]],
                                               list[dict[str, Any]], list[dict[str, Any]]]:
    """(points with their runnable backends, records without timings, skipped (backend, point, reasons))."""
    backends = candidate_backends(args.backends)
    todo, records, skipped = [], [], []
    for point in grid(args):
        runnable = []
        for name, why in verdicts(torch, backends, point, device, args.page_size).items():
            if why:
                skipped.append({"backend": name, **point, "reasons": why})
                continue
            runnable.append((name, backends[name]))
            rec: dict[str, Any] = {"backend": name, "gpu": gpu_key, **point}
            if bw and fl:
                rec.update(judge(point, name, spec, bw, fl, args))
            records.append(rec)
        if runnable:
            todo.append((point, runnable))
    return todo, records, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = simulated_device_for(args.gpu) if (args.dry_run and args.gpu) else detect(torch)
    spec, bw, fl = peaks(args, device.name)
    gpu_key = spec.key if spec else (device.name if device.is_cuda else "cpu")
    payload: dict[str, Any] = {
        "format": "mla-backends/bench-decode-gpu/v2",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpu": gpu_key,
        "device": {"name": device.name, "compute_capability": device.compute_capability,
                   "sm_count": device.sm_count, "total_memory": device.total_memory,
                   "simulated": device.simulated},
        "peaks": {"bytes_per_s": bw, "bf16_flops_per_s": fl,
                  "from": "flags" if (args.peak_gbps or args.peak_tflops) else ("table" if spec else None)},
        "config": {k: (v.key if k == "gpu" and v is not None else v) for k, v in vars(args).items()
                   if k != "output"},
        "records": [], "skipped": [], "errors": [], "not_run": [],
    }
    if args.dry_run:
        todo, records, skipped = runnable_points(torch, args, device, gpu_key, spec, bw, fl)
        payload.update(records=records, skipped=skipped)
        est = estimate_seconds(records, args) if (bw and fl) else None
        payload["estimate_s"] = est
        print(f"device: {device.describe()}; {len(grid(args))} grid points, {len(records)} records "
              f"(point x accepting backend)" + (f", about {est:.0f} s when timed" if est else ""))
        if not (bw and fl):
            print("  peaks unknown for this device: pass --gpu NAME or --peak-gbps and --peak-tflops")
        grouped: dict[tuple[str, str], int] = {}
        for s in skipped:
            key = (s["backend"], "; ".join(s["reasons"]))
            grouped[key] = grouped.get(key, 0) + 1
        for (name, why), n in grouped.items():
            print(f"  skip {name:<24} at {n} point(s): {why}")
        if bw and fl:
            print(f"{'backend':<24} {'kv':<9} {'batch':>5} {'ctx':>6} {'heads':>5} {'roofline_us':>11} "
                  f"{'bound':<8} {'time_us':>9} {'frac':>6}")
            for r in records:
                print_row(r)
        if args.output:
            write_json(args.output, payload)
        return 0
    if not device.is_cuda or not torch.cuda.is_available():
        print("bench_decode_gpu: no CUDA device found (torch.cuda.is_available() is False); this benchmark "
              "times GPU kernels, so nothing was timed. Run it on a machine with an NVIDIA GPU "
              "(see README, 'GPU benchmarks'); --dry-run --gpu h200 shows the grid and the verdicts.")
        return 0
    if not (bw and fl):
        print(f"bench_decode_gpu: {device.name!r} is not in the GPU table (docs/gpus.md); the roofline "
              "needs --gpu NAME or --peak-gbps and --peak-tflops. Timing without it.")
    scale = softmax_scale()
    print(f"device: {device.describe()}, {device.sm_count} SMs; peaks "
          f"{(f'{bw / 1e9:.0f} GB/s, {fl / 1e12:.0f} bf16 TFLOP/s') if (bw and fl) else 'unknown'}")
    print(f"{'backend':<24} {'kv':<9} {'batch':>5} {'ctx':>6} {'heads':>5} {'roofline_us':>11} {'bound':<8} "
          f"{'time_us':>9} {'frac':>6}")
    todo, records, skipped = runnable_points(torch, args, device, gpu_key, spec, bw, fl)
    payload["skipped"] = skipped
    by_key = {(r["backend"], r["batch"], r["context"], r["heads"], r["kv_cache_dtype"]): r for r in records}
    instances: dict[str, Any] = {}
    path = args.output or "bench_decode_gpu.json"
    write_json(path, payload, quiet=True)  # the grid and the skips, before anything is timed
    t0 = time.monotonic()
    for point, runnable in todo:
        if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
            payload["not_run"].extend({"backend": n, **point, "reason": f"--max-seconds {args.max_seconds}"}
                                      for n, _ in runnable)
            continue
        try:
            inputs = build_inputs(torch, point, args.page_size, "cuda")
        except torch.cuda.OutOfMemoryError as exc:
            payload["errors"].append({**point, "error": f"out of memory building inputs: {exc}"})
            torch.cuda.empty_cache()
            continue
        for name, cls in runnable:
            rec = by_key[(name, point["batch"], point["context"], point["heads"], point["kv_cache_dtype"])]
            try:
                backend = instances.get(name) or instances.setdefault(name, cls())
                r = time_backend(torch, backend, inputs, args, scale)
            except Exception as exc:  # one backend failing must not stop the others
                payload["errors"].append({"backend": name, **point, "error": f"{type(exc).__name__}: {exc}",
                                          "traceback": traceback.format_exc(limit=3)})
                print(f"{name:<24} {point}: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache()
                continue
            ms = r["kernel_ms"] or r["call_ms"]
            rec.update(call_ms=r["call_ms"], kernel_ms=r["kernel_ms"], time_us=ms * 1e3,
                       time_from="kernel_ms" if r["kernel_ms"] else "call_ms")
            if "warning" in r:
                rec["warning"] = r["warning"]
            if "roofline_us" in rec:
                rec["roofline_fraction"] = rec["roofline_us"] / rec["time_us"]
            payload["records"].append(rec)
            print_row(rec)
        del inputs
        torch.cuda.empty_cache()
        write_json(path, payload, quiet=True)  # what was measured so far survives a kill
    target = [r for r in payload["records"] if r["backend"] == "TRITON_MLA" and r["batch"] >= 64
              and r["context"] >= 4096 and r["heads"] == 128 and r.get("roofline_fraction") is not None]
    if target:
        worst = min(r["roofline_fraction"] for r in target)
        met = worst >= TRITON_TARGET_FRACTION
        payload["triton_target"] = {"worst_fraction": worst, "target": TRITON_TARGET_FRACTION, "met": met}
        print(f"TRITON_MLA at batch>=64, context>=4k, 128 heads: worst {100 * worst:.0f}% of its roofline "
              f"({'meets' if met else 'misses'} the {100 * TRITON_TARGET_FRACTION:.0f}% target)")
    write_json(path, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
