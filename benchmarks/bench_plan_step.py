"""The cost of planning one step: ``plan_step(meta, layers)`` for a model's worth of ``MLAAttention`` layers.

Layers configured alike (same dispatch, a backend prepared alike, the same DCP place) share one ``plan_key()``,
and ``plan_step`` asks only the first of them for its request; the rest of the time is a key per layer. Prints
the best time per plan, in microseconds, for ``--layers`` REF_TORCH layers (DeepSeek-V2-Lite attention dims,
hidden size cut to 256: the weights play no part), a decode batch of ``--batch`` requests over ``--context``
cached tokens each, page 64.

Usage: ``python benchmarks/bench_plan_step.py [--layers 61] [--batch 8] [--context 4096]``
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61, help="MLAAttention layers (default 61, DeepSeek-V3)")
    ap.add_argument("--batch", type=int, default=8, help="decode requests (default 8)")
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per request (default 4096)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of 20 plans, best kept (default 5)")
    args = ap.parse_args(argv)
    for name in ("layers", "batch", "context", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: got {getattr(args, name)}; supported >= 1")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
