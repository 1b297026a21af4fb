"""The SGLang adapter's expanded prefill on this CPU: the library's ``forward_mha`` (what the adapter runs since 0.5)
against SGLang's one-shot MHA inputs with a per-request SDPA loop (what it ran in 0.4), on the same extend batch.

An extend batch of ``B`` requests, each ``new`` tokens after ``prefix`` cached ones, DeepSeek-V2-Lite-shaped
(16 heads, kv_lora_rank 512 + rope 64, nope 128, v 128; fp32), the cache a page-1 pool like SGLang's:

- ``one-shot`` (0.4): SGLang's MHA one-shot prepare gathers every cached and new token's latent from the pool
  (``index_select``), up-projects all of them with ``kv_b_proj`` and builds each token's 192-wide key (the rope key
  broadcast over the heads); the adapter then ran PyTorch's SDPA per request, causal, offset by its prefix.
- ``forward_mha`` (0.5): the new tokens' latents and rope keys, the pool as a ``LatentKVCache`` and the batch's
  ``BatchMetadata``; ``forward_mha`` up-projects the cached prefix chunk by chunk into the shared workspace.

Each side is timed warm, best of ``--repeat``, alternating; both outputs are compared. The machine is shared:
compare the two sides of one run.

    .venv/bin/python benchmarks/bench_sglang_expanded_cpu.py [--repeat 5]
        [--json benchmarks/results/sglang-expanded-cpu.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import torch

H, R, P, N, V = 16, 512, 64, 128, 128
#: (requests, cached prefix, new tokens) per case
CASES = [(1, 1024, 64), (4, 1024, 64), (1, 4096, 256), (4, 2048, 16)]


def _case(b: int, prefix: int, new: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    slots = (prefix + new) * b
    pool = torch.randn(slots + 1, 1, R + P, generator=g)  # SGLang's layout, slot 0 its padding slot
    perm = torch.randperm(slots, generator=g) + 1
    table = perm.view(b, prefix + new).to(torch.int32)  # req_to_token rows
    q = torch.randn(b * new, H, N + P, generator=g)
    w = torch.randn(H * (N + V), R, generator=g) * R ** -0.5
    return pool, table, q, w


def one_shot(pool, table, q, w, prefix: int, new: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """SGLang's one-shot inputs (every token's latent gathered and up-projected, 192-wide keys), then SDPA per
    request, causal with the prefix offset."""
    b = table.shape[0]
    lat = pool[table.reshape(-1).long(), 0]  # [b * (prefix + new), R + P]
    kv = (lat[:, :R] @ w.t()).view(-1, H, N + V)
    k = torch.cat([kv[..., :N], lat[:, None, R:].expand(-1, H, P)], dim=-1)
    v = kv[..., N:]
    out = q.new_empty(q.shape[0], H, V)
    s = prefix + new
    for r in range(b):
        qi = torch.arange(new)[:, None] + prefix
        mask = torch.arange(s)[None, :] <= qi
        o = torch.nn.functional.scaled_dot_product_attention(
            q[r * new:(r + 1) * new].transpose(0, 1), k[r * s:(r + 1) * s].transpose(0, 1),
            v[r * s:(r + 1) * s].transpose(0, 1), attn_mask=mask, scale=scale)
        out[r * new:(r + 1) * new] = o.transpose(0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from mla_backends import BatchMetadata, LatentKVCache
    from mla_backends.layer.prefill import forward_mha
    from mla_backends.layer.workspace import PrefillWorkspace

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/sglang-expanded-cpu.json")
    args = ap.parse_args(argv)
    scale = (N + P) ** -0.5
    res: dict = {"shape": f"{H} heads, {R} + {P}, nope {N}, v {V}, fp32, page size 1",
                 "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                 "cases": []}
    ws = PrefillWorkspace(65536)
    for b, prefix, new in CASES:
        pool, table, q, w = _case(b, prefix, new)
        cache = LatentKVCache.from_tensor(pool.view(-1, 1, R + P), kv_lora_rank=R, model_dtype=torch.float32)
        meta = BatchMetadata.build([new] * b, [prefix] * b, table, 1, num_blocks=pool.shape[0], reorder=False)
        new_rows = pool[table[:, prefix:].reshape(-1).long(), 0]

        ours = functools.partial(forward_mha, q, new_rows[:, :R], new_rows[:, R:], cache, meta, w, scale=scale,
                                 workspace=ws)
        theirs = functools.partial(one_shot, pool, table, q, w, prefix, new, scale)

        a, c = ours(), theirs()  # warm, and the same answer
        err = float((a - c).abs().max())
        best = {"forward_mha": float("inf"), "one_shot": float("inf")}
        for _ in range(args.repeat):
            for name, fn in (("forward_mha", ours), ("one_shot", theirs)):
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        row = {"requests": b, "prefix": prefix, "new": new, "max_abs_diff": err,
               "forward_mha_ms": round(best["forward_mha"] * 1e3, 2), "one_shot_ms": round(best["one_shot"] * 1e3, 2),
               "speed_forward_mha_over_one_shot": round(best["one_shot"] / best["forward_mha"], 3)}
        res["cases"].append(row)
        print(f"B={b} prefix={prefix} new={new}: forward_mha {row['forward_mha_ms']} ms, one-shot + SDPA "
              f"{row['one_shot_ms']} ms ({row['speed_forward_mha_over_one_shot']}x), max |diff| {err:.2e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
