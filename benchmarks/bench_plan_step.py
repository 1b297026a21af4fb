"""The cost of a step's bookkeeping: planning it once, and what each layer call adds on top of its kernels.

1. ``plan_step(meta, layers)`` for a model's worth of ``MLAAttention`` layers (REF_TORCH, DeepSeek-V2-Lite
   attention dims, hidden size cut to 256: the weights play no part), a decode batch of ``--batch`` requests over
   ``--context`` cached tokens each, page 64. Layers configured alike share one ``plan_key()`` and ``plan_step``
   asks only the first of them for its request; the rest is a key per layer. Best time per plan, microseconds.
2. ``--per-layer``: the per-layer overhead, at shapes so small that the host work dominates (2 heads, latent 16,
   rope 8, float32, ``--batch`` single-token decodes over 40 cached tokens, page 16, REF_TORCH): the time of one
   layer call (``layer(x, None, cache, plan)``, every layer of ``--layers`` in turn, the plan made once), of
   one ``forward_mqa`` call with the plan, and of the backend's kernel method alone with the prepared state:
   ``forward_mqa`` minus the kernel is what the contract adds per call (validation, plan look-ups, outputs).
   The best of ``--rounds`` rounds (the least disturbed by other work), microseconds; and, exact whatever the
   machine's load, the function calls
   (Python and built-in, as ``cProfile`` counts them) each of the three makes. Uses only API older checkouts
   share.
3. ``--compare-with PATH``: the per-layer figures of another checkout (the code before a change, e.g. ``git
   worktree add /tmp/before main``) and of this one, in alternating subprocesses round by round, the best of each
   and the ratios (this / other). Quote the ratios: the absolute figures follow the machine's load.

Usage: ``python benchmarks/bench_plan_step.py [--layers 61] [--batch 8] [--context 4096]``;
``python benchmarks/bench_plan_step.py --per-layer [--compare-with /tmp/before] [--rounds 7] [--json out.json]``
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch


def plan_figure(args: argparse.Namespace) -> None:
    from mla_backends import BatchMetadata, MLAAttention, plan_step
    from mla_backends.core.dims import MLADims

    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   hidden_size=256, q_lora_rank=None)
    layers = [MLAAttention(dims, backend="REF_TORCH", dtype=torch.float32, layer_idx=i) for i in range(args.layers)]
    B, bs = args.batch, 64
    pages = -(-(args.context + 1) // bs)
    table = torch.randperm(B * pages + 1)[: B * pages].view(B, pages).int()
    meta = BatchMetadata.build([1] * B, [args.context] * B, table, bs)
    for _ in range(5):
        plan_step(meta, layers)
    best = float("inf")
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(20):
            plan_step(meta, layers)
        best = min(best, (time.perf_counter() - t0) / 20)
    print(f"plan_step, {args.layers} layers, decode batch {B}, context {args.context}: {best * 1e6:.0f} us a step")


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _calls_per(fn: Callable[[], object], calls: int) -> float:
    """Function calls (Python and built-in) one ``fn()`` makes, as cProfile counts them."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / calls  # type: ignore[attr-defined]


def per_layer_figures(layers_n: int, batch: int, rounds: int) -> dict[str, float]:
    """Best per-call seconds of a layer call, a ``forward_mqa`` call and the kernel alone (see the module
    docstring, 2.) over ``rounds`` rounds, and the function calls each makes; one torch thread."""
    from mla_backends import BatchMetadata, MLAAttention, plan_step
    from mla_backends.core.dims import MLADims
    from mla_backends.loading.hf import random_hf_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dims = MLADims(num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                   hidden_size=32, q_lora_rank=None, max_position_embeddings=256)
    bs, ctx = 16, 40
    pages = -(-(ctx + 1) // bs)
    layers, caches = [], []
    for i in range(layers_n):
        layer = MLAAttention(dims, backend="REF_TORCH", dtype=torch.float32, layer_idx=i)
        layer.load_hf_state_dict(random_hf_state_dict(dims, dtype=torch.float32, seed=i))
        cache = layer.allocate_cache(batch * pages + 1, bs)
        cache.data.normal_()
        layers.append(layer)
        caches.append(cache)
    table = torch.randperm(batch * pages + 1)[: batch * pages].view(batch, pages).int()
    meta = BatchMetadata.build([1] * batch, [ctx] * batch, table, bs, num_blocks=batch * pages + 1)
    plan = plan_step(meta, layers)
    x = torch.randn(batch, dims.hidden_size)
    backend, batch_meta = layers[0].backend, plan.batch(0, batch)
    q = torch.randn(batch, dims.num_heads, dims.kv_lora_rank)
    qr = torch.randn(batch, dims.num_heads, dims.qk_rope_head_dim)
    out, lse = torch.empty_like(q), torch.empty(batch, dims.num_heads)
    state = plan.state(backend, batch_meta)

    def step() -> None:
        y = x
        for layer, cache in zip(layers, caches, strict=True):
            y = layer(y, None, cache, plan)

    def mqa() -> None:
        backend.forward_mqa(q, qr, caches[0], batch_meta, scale=layers[0].scale, plan=plan)

    def kernel() -> None:
        backend.forward_mqa_kernel(q, qr, caches[0], batch_meta, scale=layers[0].scale, topk_indices=None,
                                   out=out, lse_out=lse, state=state)

    figures: dict[str, list[float]] = {"layer_call_s": [], "forward_mqa_s": [], "kernel_s": []}
    with torch.inference_mode():
        for fn in (step, mqa, kernel):  # warm: buffers made, first-use work done
            for _ in range(20):
                fn()
        for _ in range(rounds):  # interleaved, so that load shifts touch all three alike
            figures["layer_call_s"].append(_per_call(step, 20) / layers_n)
            figures["forward_mqa_s"].append(_per_call(mqa, 200))
            figures["kernel_s"].append(_per_call(kernel, 200))
        calls = {"layer_call_calls": _calls_per(step, 5) / layers_n, "forward_mqa_calls": _calls_per(mqa, 20),
                 "kernel_calls": _calls_per(kernel, 20)}
    best = {k: min(v) for k, v in figures.items()}
    best["contract_overhead_s"] = best["forward_mqa_s"] - best["kernel_s"]
    best.update(calls)
    best["contract_overhead_calls"] = calls["forward_mqa_calls"] - calls["kernel_calls"]
    return best


def compare(other: str, args: argparse.Namespace) -> dict[str, object]:
    """:func:`per_layer_figures` of ``other`` and of this checkout in alternating subprocesses (three rounds
    each time), the best of each figure over them and the ratios (this / other)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for label, root in (("before", other), ("after", here)):
            with tempfile.NamedTemporaryFile("r", suffix=".json") as fh:
                cmd = [sys.executable, os.path.abspath(__file__), "--per-layer", "--json", fh.name, "--layers",
                       str(args.layers), "--batch", str(args.batch), "--rounds", "3"]
                subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=root), stdout=subprocess.DEVNULL)
                got[label].append(json.load(fh))
    best = {label: {k: min(r[k] for r in runs) for k in runs[0]} for label, runs in got.items()}
    for side in best.values():
        side["contract_overhead_s"] = side["forward_mqa_s"] - side["kernel_s"]
    ratios = {k: best["after"][k] / best["before"][k] for k in best["after"]}
    return {"before": best["before"], "after": best["after"], "ratio": ratios}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="MLAAttention layers (default 61, DeepSeek-V3; 8 with --per-layer)")
    ap.add_argument("--batch", type=int, default=8, help="decode requests (default 8)")
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per request (default 4096)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the best kept")
    ap.add_argument("--per-layer", action="store_true", help="the per-layer overhead figures instead")
    ap.add_argument("--compare-with", metavar="PATH", help="with --per-layer: also time another checkout")
    ap.add_argument("--json", metavar="FILE", help="with --per-layer: write the figures as JSON")
    args = ap.parse_args(argv)
    if args.layers is None:
        args.layers = 8 if args.per_layer else 61
    for name in ("layers", "batch", "context", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; supported >= 1")
    if args.compare_with is not None and not args.per_layer:
        ap.error("--compare-with: supported with --per-layer only")
    if not args.per_layer:
        plan_figure(args)
        return 0
    if args.compare_with is not None:
        result: dict[str, object] = compare(args.compare_with, args)
        b, a, r = result["before"], result["after"], result["ratio"]  # type: ignore[misc]
        for k in ("layer_call_s", "forward_mqa_s", "kernel_s", "contract_overhead_s"):
            print(f"{k[:-2]:20s} before {b[k] * 1e6:8.1f} us   after {a[k] * 1e6:8.1f} us   "  # type: ignore[index]
                  f"after/before {r[k]:.2f}")  # type: ignore[index]
        for k in ("layer_call_calls", "forward_mqa_calls", "kernel_calls", "contract_overhead_calls"):
            print(f"{k:24s} before {b[k]:8.0f}      after {a[k]:8.0f}      "  # type: ignore[index]
                  f"after/before {r[k]:.2f}")  # type: ignore[index]
    else:
        result = per_layer_figures(args.layers, args.batch, args.rounds)
        for k, v in result.items():
            print(f"{k:24s} {v * 1e6:8.1f} us" if k.endswith("_s") else f"{k:24s} {v:8.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
