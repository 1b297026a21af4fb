"""Would ``torch.compile`` speed up REF_TORCH's CPU decode? The padded decode written as one plain function
(gather, scores positions first, masked softmax with the exp floor, the weighted sum, the LSE), run eager and
compiled (inductor, ``dynamic=True`` so that growing contexts do not recompile at every step), beside the
``REF_TORCH`` backend call on the same inputs.

Reports the first compiled call's time (compile included) at every context, then the best call time of
each variant and the largest difference from REF_TORCH's output. Every variant computes the same attention.

Usage: ``python benchmarks/bench_compile_cpu.py [--threads 1] [--contexts 16 64 256 600] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from mla_backends.ref_torch.plans import EXP_FLOOR, HIDDEN_SCORE  # noqa: E402

WIDTH, RANK = 576, 512  # the latent row and its value columns (DeepSeek's dims, as bench_ref_decode_cpu uses)


def padded_decode(data: torch.Tensor, page_ids: torch.Tensor, q_latent: torch.Tensor, q_rope: torch.Tensor,
                  hidden: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``data [pages, page, 576]``, ``page_ids [b * pages]``, queries ``[b, H, 512]`` /
    ``[b, H, 64]``, ``hidden [b, L, 1]`` bool -> ``(out [b, H, 512], lse [b, H])``."""
    b, r = hidden.shape[0], RANK
    kv = data.index_select(0, page_ids).view(b, -1, WIDTH)
    q = torch.cat([q_latent, q_rope], dim=-1)
    s = (torch.bmm(kv, q.transpose(1, 2)) * scale).masked_fill(hidden, HIDDEN_SCORE)  # [b, L, H]
    m = s.amax(dim=1, keepdim=True)
    p = torch.exp((s - m).clamp_min(EXP_FLOOR)).masked_fill(hidden, 0.0)
    total = p.sum(dim=1, keepdim=True)
    out = torch.bmm(p.transpose(1, 2), kv[..., :r]) / total.transpose(1, 2)
    return out, (total.log() + m).squeeze(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--contexts", type=int, nargs="+", default=[16, 64, 256, 600])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import bench_ref_decode_cpu as bench
    from bench_layer_cpu import best_time

    def best_ms(fn: Callable[[], object]) -> float:  # two untimed calls, then the best of --calls
        return best_time(fn, args.calls, warmup=2) * 1e3

    import mla_backends
    from mla_backends.ref_torch.backend import RefTorchBackend

    compiled = torch.compile(padded_decode, dynamic=True)
    rows = []
    print(f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load {os.getloadavg()}")
    for ctx in args.contexts:
        inp = bench.Inputs(mla_backends, ctx, bench.BATCH)
        ref = inp.call(RefTorchBackend())
        seqs = [c + 1 for c in inp.contexts]
        pages = -(-max(seqs) // bench.PAGE)
        ids = inp.meta.block_table[:, :pages].long().reshape(-1)
        hidden = torch.arange(pages * bench.PAGE)[None, :, None] >= torch.tensor(seqs)[:, None, None]
        args_ = (inp.cache.data, ids, inp.q_latent, inp.q_rope, hidden, bench.SCALE)
        t0 = time.perf_counter()
        out, _ = compiled(*args_)
        first_s = time.perf_counter() - t0
        ref()
        diff = float((out - inp.out).abs().max())
        row = {"context": ctx, "first_compiled_call_s": round(first_s, 2),
               "ref_torch_ms": round(best_ms(ref), 3),
               "eager_ms": round(best_ms(lambda a=args_: padded_decode(*a)), 3),
               "compiled_ms": round(best_ms(lambda a=args_: compiled(*a)), 3), "max_diff": diff}
        row["compiled_over_eager"] = round(row["compiled_ms"] / row["eager_ms"], 3)
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
