"""The CPU kernel choices behind REF_TORCH's dense decode, each timed against its alternative in one process.

- **Score layout.** ``q [b, N, 576] @ kv^T`` (``N`` = query rows of a request, 16 at 16 heads) against
  ``kv [b, L, 576] @ q^T``: the same scores, transposed. CPU BLAS runs the second 1.3-2x faster at N = 16.
- **Query transpose.** For the second form, ``q^T`` as a strided view against a contiguous copy: at padded-group
  sizes the view is as fast (the copy costs ~70-100 us), over many streamed chunks the copy, made once, wins.
- **Position max.** ``amax(dim=1)`` over ``[b, L, N]`` (a strided reduction) against a max pool over the
  transposed view (what :func:`mla_backends.ref_torch.backend.position_max` does).
- **exp floor.** ``exp`` of shifted scores with hidden positions at ``HIDDEN_SCORE`` (or visible ones far below
  the maximum) against the same after ``clamp_min(EXP_FLOOR)``: denormal and far-out-of-range inputs are slow.
- **bf16 math.** torch's CPU matmul on bf16 copies of the same tensors against fp32, a 1024^3 product and a
  decode score product: whether computing a bf16 cache in bf16 (``avx512_bf16``, AMX) would pay here.

Every figure is the best of ``--rounds`` rounds of ``--calls`` calls, alternatives timed in turn, ratios within
one run. Usage: ``python benchmarks/bench_decode_layouts_cpu.py [--threads 1] [--json out.json]``
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
WIDTH, RANK = 576, 512


def best_us(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Best microseconds per call of each function: ``rounds`` rounds, each timing ``calls`` calls of every
    function in turn (after one untimed call)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def layouts(b: int, n: int, L: int, rounds: int, calls: int) -> dict:
    """Score matmul layouts and the query transpose at ``b`` requests, ``n`` query rows, ``L`` positions."""
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(b, n, WIDTH, generator=g), torch.randn(b, L, WIDTH, generator=g)
    q_t = torch.empty(b, WIDTH, n)
    s, s_t = torch.empty(b, n, L), torch.empty(b, L, n)
    t = best_us({
        "q_at_kv_t": lambda: torch.bmm(q, kv.transpose(1, 2), out=s),
        "kv_at_q_t_view": lambda: torch.bmm(kv, q.transpose(1, 2), out=s_t),
        "kv_at_q_t_copy": lambda: torch.bmm(kv, q_t.copy_(q.transpose(1, 2)), out=s_t),
        "q_t_copy_only": lambda: q_t.copy_(q.transpose(1, 2)),
    }, rounds, calls)
    flops = 2 * b * n * WIDTH * L
    return {"requests": b, "rows": n, "positions": L, **{f"{k}_us": round(v, 1) for k, v in t.items()},
            "q_at_kv_t_gflops": round(flops / t["q_at_kv_t"] / 1e3, 1),
            "kv_at_q_t_view_gflops": round(flops / t["kv_at_q_t_view"] / 1e3, 1),
            "view_speedup": round(t["q_at_kv_t"] / t["kv_at_q_t_view"], 2)}


def reductions(b: int, n: int, L: int, rounds: int, calls: int) -> dict:
    """The position max two ways, and exp with and without the floor, on ``[b, L, n]`` scores whose second
    half of positions is hidden."""
    from mla_backends.ref_torch.backend import position_max
    from mla_backends.ref_torch.plans import EXP_FLOOR, HIDDEN_SCORE

    g = torch.Generator().manual_seed(1)
    s = torch.randn(b, L, n, generator=g)
    s[:, L // 2:] = HIDDEN_SCORE
    work = torch.empty_like(s)
    m = s.amax(dim=1, keepdim=True)
    assert torch.equal(position_max(s), m[:, 0])
    t = best_us({
        "amax_dim1": lambda: torch.amax(s, dim=1),
        "pool_max": lambda: position_max(s),
        "exp": lambda: work.copy_(s).sub_(m).exp_(),
        "exp_floored": lambda: work.copy_(s).sub_(m).clamp_min_(EXP_FLOOR).exp_(),
        "copy_sub_only": lambda: work.copy_(s).sub_(m),
    }, rounds, calls)
    return {"requests": b, "rows": n, "positions": L, **{f"{k}_us": round(v, 1) for k, v in t.items()},
            "pool_speedup": round(t["amax_dim1"] / t["pool_max"], 2),
            "floor_speedup": round(t["exp"] / t["exp_floored"], 2)}


def bf16_math(rounds: int, calls: int) -> list[dict]:
    """fp32 against bf16 ``torch.mm`` / ``torch.bmm`` time and rate, on the same values."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for label, a, b in (("1024^3", torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)),
                        ("8 x [512 x 576] @ [576 x 16]", torch.randn(8, 512, WIDTH, generator=g),
                         torch.randn(8, 16, WIDTH, generator=g).transpose(1, 2))):
        op = torch.mm if a.dim() == 2 else torch.bmm
        a16, b16 = a.bfloat16(), b.bfloat16()
        t = best_us({"fp32": lambda op=op, a=a, b=b: op(a, b), "bf16": lambda op=op, a=a16, b=b16: op(a, b)},
                    rounds, max(1, calls // 4))
        flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        rows.append({"shape": label, **{f"{k}_us": round(v, 1) for k, v in t.items()},
                     **{f"{k}_gflops": round(flops / v / 1e3, 1) for k, v in t.items()},
                     "bf16_speedup": round(t["fp32"] / t["bf16"], 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, ROOT)
    shapes = [(8, 16, 32), (8, 16, 128), (8, 16, 512), (2, 16, 2048), (1, 16, 5000), (32, 16, 128), (8, 128, 256)]
    rows = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load": os.getloadavg(),
            "layouts": [], "reductions": [], "bf16": []}
    print(f"threads {rows['threads']}, cpus {rows['cpus']}, load {rows['load']}")
    for b, n, L in shapes:
        row = layouts(b, n, L, args.rounds, args.calls)
        rows["layouts"].append(row)
        print("layout  " + "  ".join(f"{k} {v}" for k, v in row.items()))
    for b, n, L in [(8, 16, 128), (8, 16, 1024)]:
        row = reductions(b, n, L, args.rounds, args.calls)
        rows["reductions"].append(row)
        print("reduce  " + "  ".join(f"{k} {v}" for k, v in row.items()))
    for row in bf16_math(args.rounds, args.calls):
        rows["bf16"].append(row)
        print("bf16    " + "  ".join(f"{k} {v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
