#!/usr/bin/env python
"""GPU decode benchmark: every available backend's ``forward_mqa`` over a grid of batch x context x heads.

Usage::

    python benchmarks/bench_decode_gpu.py                      # full grid, writes bench_decode_gpu.json
    python benchmarks/bench_decode_gpu.py --quick              # batch 1/64, context 4k, 128 heads
    python benchmarks/bench_decode_gpu.py --backends TRITON_MLA --peak-gbps 3350 --output h100.json
    python benchmarks/bench_decode_gpu.py --dry-run            # print the grid and each backend's verdict

Grid (defaults): batch 1, 8, 64, 128; context 1k, 4k, 16k; heads 16, 128; kv caches bfloat16 and fp8_e4m3;
bf16 queries; DeepSeek-V3 latent (512 + 64); page size 64; one new token per request; scattered pages.

For every point and backend that accepts it (``not_supported_reasons`` on the detected device is empty) it
runs warm-up calls, then times ``--iters`` calls with CUDA events (``call_ms``: the whole ``forward_mqa``,
input validation included) and, when the profiler works, the GPU kernel time of the same calls
(``kernel_ms``). It reports:

* GB/s: bytes of latent cache read (``sum(seq_lens) * row_width * element size``) per second;
* TFLOP/s: absorbed-core FLOPs ``2 * tokens * heads * seq_len * (2 * kv_lora_rank + qk_rope_head_dim)``;
* the fraction of the device's peak HBM bandwidth (table below, or ``--peak-gbps``).

Rates use ``kernel_ms`` when measured, else ``call_ms``. Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import traceback
from typing import Any

#: peak HBM bandwidth in GB/s by marketing-name fragment (first match wins; more specific names first)
PEAK_HBM_GBPS: tuple[tuple[str, float], ...] = (
    ("GB200", 8000.0),
    ("B200", 8000.0),
    ("H200", 4800.0),
    ("H100 PCIE", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM (HBM3)
    ("H800", 3350.0),
    ("H20", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIE", 1935.0),
    ("A100", 1555.0),  # 40 GB
)

DEFAULT_BATCHES = (1, 8, 64, 128)
DEFAULT_CONTEXTS = (1024, 4096, 16384)
DEFAULT_HEADS = (16, 128)
DEFAULT_KV_DTYPES = ("bfloat16", "fp8_e4m3")
#: target from issue 6: Triton at batch >= 64, context >= 4k, 128 heads reaches this fraction of peak
TRITON_TARGET_FRACTION = 0.70


def peak_gbps_for(name: str) -> float | None:
    """Peak HBM bandwidth (GB/s) for a device name, or None when it is not in :data:`PEAK_HBM_GBPS`."""
    upper = name.upper()
    for fragment, gbps in PEAK_HBM_GBPS:
        if fragment in upper:
            return gbps
    return None


def point_dims(heads: int) -> Any:
    """The benchmarked shapes: DeepSeek-V3's latent (512 + 64) with ``heads`` query heads."""
    from mla_backends.dims import MLADims

    return MLADims(num_heads=heads)


def cache_bytes_read(seq_lens: list[int], dims: Any, element_size: int) -> int:
    """Bytes of latent cache one call reads: every visible row once (576 * 2 bytes per token in bf16)."""
    from mla_backends import costs

    return sum(seq_lens) * costs.latent_bytes_per_token_per_layer(dims, element_size)


def absorbed_flops(seq_lens: list[int], dims: Any) -> int:
    """FLOPs of the absorbed core for one decode token per request: QK^T (r + rope wide) plus PV (r wide)."""
    from mla_backends import costs

    return sum(seq_lens) * costs.absorbed_core_flops_per_context_token(dims)


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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--batch", type=_int_list, default=DEFAULT_BATCHES, help="batch sizes (default 1,8,64,128)"
    )
    p.add_argument(
        "--context", type=_int_list, default=DEFAULT_CONTEXTS, help="context lengths (default 1k,4k,16k)"
    )
    p.add_argument("--heads", type=_int_list, default=DEFAULT_HEADS, help="query heads (default 16,128)")
    p.add_argument(
        "--kv-dtypes",
        type=_str_list,
        default=DEFAULT_KV_DTYPES,
        help="kv cache dtypes (default bfloat16,fp8_e4m3)",
    )
    p.add_argument("--page-size", type=int, default=64, help="cache page size (default 64)")
    p.add_argument("--backends", type=_str_list, default=None, help="only these backend names")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per point (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (default 20)")
    p.add_argument("--peak-gbps", type=float, default=None, help="peak HBM bandwidth (GB/s) for the fraction")
    p.add_argument("--no-profiler", action="store_true", help="skip the kernel-time measurement")
    p.add_argument("--quick", action="store_true", help="batch 1,64; context 4k; heads 128")
    p.add_argument("--dry-run", action="store_true", help="print the grid and verdicts, time nothing")
    p.add_argument("--output", default="bench_decode_gpu.json", help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.heads = (1, 64), (4096,), (128,)
    from mla_backends.dtypes import canonical_kv_cache_dtype

    try:
        args.kv_dtypes = tuple(canonical_kv_cache_dtype(k) for k in args.kv_dtypes)
    except (ValueError, TypeError) as exc:
        p.error(f"--kv-dtypes: {exc}")
    if args.page_size < 1:
        p.error(f"--page-size: got {args.page_size}; supported >= 1")
    if args.warmup < 0 or args.iters < 1:
        p.error(f"--warmup/--iters: got {args.warmup}/{args.iters}; supported >= 0 / >= 1")
    if args.peak_gbps is not None and not args.peak_gbps > 0:
        p.error(f"--peak-gbps: got {args.peak_gbps}; supported a positive number")
    return args


def detect(torch: Any) -> Any:
    """The device as the selector sees it (NVML through ``selector.detect``; torch as a fallback)."""
    from selector.device import CPU_DEVICE, DeviceInfo

    dev = None
    try:
        from selector.detect import detect_device

        dev = detect_device(0)
    except Exception:  # an older tree without selector.detect, or NVML trouble
        dev = None
    if (dev is None or not dev.is_cuda) and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        dev = DeviceInfo(
            kind="cuda",
            name=props.name,
            compute_capability=(props.major, props.minor),
            total_memory=int(props.total_memory),
            index=0,
            sm_count=props.multi_processor_count,
        )
    return dev or CPU_DEVICE


def candidate_backends(names: tuple[str, ...] | None) -> dict[str, type]:
    from mla_backends.registry import registered_backends

    found = dict(registered_backends())
    if "TRITON_MLA" not in found:  # registries without the built-in entry still get the Triton backend
        from mla_backends.triton_mla import TritonMLABackend

        found["TRITON_MLA"] = TritonMLABackend
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


def build_inputs(torch: Any, point: dict[str, Any], page: int, device: Any) -> tuple[Any, ...]:
    """A filled cache (scattered pages), metadata for one decode token per request, and random queries."""
    from mla_backends.cache import LatentKVCache
    from mla_backends.metadata import BatchMetadata

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
    meta = BatchMetadata.build([1] * B, [ctx - 1] * B, bt, page, num_blocks=num_blocks)
    q_latent = torch.randn(B, H, dims.kv_lora_rank, device=device, dtype=torch.bfloat16)
    q_rope = torch.randn(B, H, dims.qk_rope_head_dim, device=device, dtype=torch.bfloat16)
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


def rates(point: dict[str, Any], ms: float, elem_size: int, peak: float | None) -> dict[str, Any]:
    seq = [point["context"]] * point["batch"]
    dims = point_dims(point["heads"])
    nbytes = cache_bytes_read(seq, dims, elem_size)
    flops = absorbed_flops(seq, dims)
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "bytes": nbytes,
        "flops": flops,
        "gbps": gbps,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "fraction_of_peak": (gbps / peak) if peak else None,
    }


def print_row(name: str, p: dict[str, Any], r: dict[str, Any]) -> None:
    frac = r.get("fraction_of_peak")
    kern = r.get("kernel_ms")
    print(
        f"{name:<24} {p['kv_cache_dtype']:<9} {p['batch']:>5} {p['context']:>6} {p['heads']:>5} "
        f"{r['call_ms']:>9.4f} {(f'{kern:.4f}') if kern else '-':>9} {r['gbps']:>8.1f} {r['tflops']:>7.2f} "
        f"{('%.0f%%' % (100 * frac)) if frac is not None else '-':>6}",
        flush=True,
    )


def write_json(path: str, payload: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from mla_backends.backend import AttentionSpec
    from mla_backends.dims import MLADims

    device = detect(torch)
    payload: dict[str, Any] = {
        "format": "mla-backends/bench-decode-gpu/v1",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": {
            "name": device.name,
            "compute_capability": device.compute_capability,
            "sm_count": device.sm_count,
            "total_memory": device.total_memory,
        },
        "config": {k: v for k, v in vars(args).items() if k not in ("output",)},
        "results": [],
        "skipped": [],
        "errors": [],
    }
    backends = candidate_backends(args.backends)
    points = grid(args)
    if args.dry_run:
        print(f"device: {device.describe()}; {len(points)} grid points; backends: {', '.join(backends)}")
        for name, cls in backends.items():
            for kv in args.kv_dtypes:
                for h in args.heads:
                    spec = AttentionSpec(
                        num_heads=h,
                        dtype=torch.bfloat16,
                        kv_cache_dtype=kv,
                        block_size=args.page_size,
                        need_lse=False,
                        device=device,
                    )
                    why = cls.not_supported_reasons(spec)
                    print(f"  {name:<24} {kv:<9} heads {h:>3}: {'runs' if not why else '; '.join(map(str, why))}")
        return 0
    if not device.is_cuda or not torch.cuda.is_available():
        print(
            "bench_decode_gpu: no CUDA device found (torch.cuda.is_available() is False); this benchmark "
            "times GPU kernels, so nothing was timed. Run it on a machine with an NVIDIA GPU "
            "(see README, 'GPU benchmarks'); --dry-run shows the grid and the backends' verdicts."
        )
        return 0

    peak = args.peak_gbps or peak_gbps_for(device.name)
    payload["peak_gbps"] = peak
    scale = MLADims().softmax_scale
    print(
        f"device: {device.describe()}, {device.sm_count} SMs, peak HBM "
        f"{(f'{peak:.0f} GB/s') if peak else 'unknown (pass --peak-gbps)'}"
    )
    print(
        f"{'backend':<24} {'kv':<9} {'batch':>5} {'ctx':>6} {'heads':>5} {'call_ms':>9} {'kern_ms':>9} "
        f"{'GB/s':>8} {'TFLOP/s':>7} {'peak':>6}"
    )
    instances: dict[str, Any] = {}
    for point in points:
        runnable = []
        for name, cls in backends.items():
            spec = AttentionSpec(
                num_heads=point["heads"],
                dtype=torch.bfloat16,
                kv_cache_dtype=point["kv_cache_dtype"],
                block_size=args.page_size,
                need_lse=False,
                device=device,
            )
            why = cls.not_supported_reasons(spec)
            if why:
                payload["skipped"].append({"backend": name, **point, "reasons": [str(r) for r in why]})
            else:
                runnable.append((name, cls))
        if not runnable:
            continue
        try:
            inputs = build_inputs(torch, point, args.page_size, "cuda")
        except torch.cuda.OutOfMemoryError as exc:
            payload["errors"].append({**point, "error": f"out of memory building inputs: {exc}"})
            torch.cuda.empty_cache()
            continue
        elem = inputs[0].data.element_size()
        for name, cls in runnable:
            try:
                backend = instances.get(name) or instances.setdefault(name, cls())
                r = time_backend(torch, backend, inputs, args, scale)
            except Exception as exc:  # one backend failing must not stop the others
                payload["errors"].append(
                    {
                        "backend": name,
                        **point,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(limit=3),
                    }
                )
                print(f"{name:<24} {point}: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache()
                continue
            ms = r["kernel_ms"] or r["call_ms"]
            r.update(rates(point, ms, elem, peak))
            r["rates_from"] = "kernel_ms" if r["kernel_ms"] else "call_ms"
            payload["results"].append({"backend": name, **point, **r})
            print_row(name, point, r)
        del inputs
        torch.cuda.empty_cache()

    target = [
        r
        for r in payload["results"]
        if r["backend"] == "TRITON_MLA"
        and r["batch"] >= 64
        and r["context"] >= 4096
        and r["heads"] == 128
        and r.get("fraction_of_peak") is not None
    ]
    if target:
        worst = min(r["fraction_of_peak"] for r in target)
        verdict = "meets" if worst >= TRITON_TARGET_FRACTION else "misses"
        summary = (
            f"TRITON_MLA at batch>=64, context>=4k, 128 heads: worst {100 * worst:.0f}% of peak HBM "
            f"bandwidth ({verdict} the {100 * TRITON_TARGET_FRACTION:.0f}% target)"
        )
        payload["triton_target"] = {
            "worst_fraction": worst,
            "target": TRITON_TARGET_FRACTION,
            "met": worst >= 0.7,
        }
        print(summary)
    write_json(args.output, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
