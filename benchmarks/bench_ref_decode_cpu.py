"""REF_TORCH's CPU decode, one ``forward_mqa`` (one layer call), against a plain gather + batched matmul.

Shape (issue 29's vLLM benchmark, DeepSeek-V2-Lite): 8 decode requests, 16 heads, kv_lora_rank 512 + rope 64,
float32, page size 16 (vLLM's CPU backend forces it), a scattered block table; request ``i`` holds
``context - i`` cached rows, for each ``--contexts`` value (default 16 .. 1100). Timed per context:

- ``ref``: REF_TORCH as shipped (its own choice of path, ``path`` in the output);
- ``padded`` / ``streamed``: REF_TORCH forced onto one path (its thresholds patched for the call);
- ``baseline``: a plain ``index_select`` of the batch's pages, ``bmm``, masked softmax, ``bmm``, written here
  (no LSE, no validation);
- ``before`` (with ``--before PATH``): the REF_TORCH of another checkout (e.g. the code before a change:
  ``git worktree add /tmp/before <commit>``), loaded in this process under another package name.

Each call gets preallocated outputs and a step planned once (``plan_step``), as every layer of a step
after the first. The machine may be shared: every round times each variant once, in turn, and each keeps its
best over ``--rounds`` rounds (after a warm-up call); the load average is recorded. With ``--threads 1`` the
timer is the CPU time of the calling thread (torch runs every op on it), which time spent preempted by other
processes does not inflate; with more threads it is the wall clock. ``--crossover`` also times
the padded against the streamed path at 2, 8 and 32 requests, at lengths where the batch's rows take 8 to 48
MiB, which is where ``STREAM_MIN_BYTES`` comes from.

Usage: ``python benchmarks/bench_ref_decode_cpu.py [--rounds 15] [--threads N] [--before PATH] [--crossover]
[--json benchmarks/results/ref-decode-cpu.json]``
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch

HEADS, RANK, ROPE, PAGE, BATCH = 16, 512, 64, 16, 8
WIDTH = RANK + ROPE
SCALE = (128 + ROPE) ** -0.5
DEFAULT_CONTEXTS = (16, 64, 128, 256, 512, 768, 1000, 1023, 1064, 1100)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_package(path: str, name: str = "mla_backends_before") -> ModuleType:
    """The ``mla_backends`` package of the checkout at ``path``, imported as ``name`` (its modules import
    each other relatively, so both versions live side by side in this process)."""
    init = os.path.join(path, "mla_backends", "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--before: got {path!r}; supported a checkout holding mla_backends/__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Inputs:
    """One decode step of ``batch`` requests, request ``i`` holding ``context - i`` cached rows (at least 0)
    plus its new one, built with package ``pkg``'s classes; the cache is random and the table scattered."""

    def __init__(self, pkg: ModuleType, context: int, batch: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.contexts = [max(0, context - i) for i in range(batch)]
        pages = -(-(context + 1) // PAGE)
        nb = batch * pages + 1
        table = torch.randperm(nb, generator=g)[: batch * pages].view(batch, pages).int()
        self.cache = pkg.LatentKVCache(nb, PAGE, RANK, ROPE, model_dtype=torch.float32)
        self.cache.data.copy_(torch.randn(self.cache.data.shape, generator=g))
        self.meta = pkg.BatchMetadata.build([1] * batch, self.contexts, table, PAGE, num_blocks=nb)
        self.pkg = pkg
        self.q_latent = torch.randn(batch, HEADS, RANK, generator=g)
        self.q_rope = torch.randn(batch, HEADS, ROPE, generator=g)
        self.out = torch.empty(batch, HEADS, RANK)
        self.lse = torch.empty(batch, HEADS)

    def call(self, backend: object) -> Callable[[], object]:
        planner = getattr(self.pkg, "plan_step", None)  # once per step, as an engine does before the first layer
        if planner is None:  # a checkout from before the step plan (--before): its metadata prepares itself
            self.meta.prepare(backend)
            kw = {}
        else:
            kw = {"plan": planner(self.meta, [backend])}
        return lambda: backend.forward_mqa(self.q_latent, self.q_rope, self.cache, self.meta, scale=SCALE,
                                           out=self.out, lse_out=self.lse, **kw)


def baseline(inp: Inputs) -> Callable[[], torch.Tensor]:
    """Plain decode attention: gather every page of the batch into ``[B, L, 576]`` (one ``index_select``),
    scores in one ``bmm``, hidden positions at -inf, softmax, one ``bmm`` with the first 512 columns."""
    seqs = [c + 1 for c in inp.contexts]
    pages = -(-max(seqs) // PAGE)
    rows = pages * PAGE
    ids = inp.meta.block_table[:, :pages].long().clamp_min(0).reshape(-1)
    hidden = torch.arange(rows)[None, None, :] >= torch.tensor(seqs)[:, None, None]  # [B, 1, L]
    data, b = inp.cache.data, len(seqs)

    def run() -> torch.Tensor:
        kv = torch.index_select(data, 0, ids).view(b, rows, WIDTH)
        q = torch.cat([inp.q_latent, inp.q_rope], dim=-1)
        s = torch.bmm(q, kv.transpose(1, 2)).mul_(SCALE).masked_fill_(hidden, float("-inf"))
        return torch.bmm(torch.softmax(s, dim=-1), kv[..., :RANK])

    return run


def forced(module: ModuleType, call: Callable[[], object], path: str) -> Callable[[], object]:
    """``call`` with REF_TORCH's thresholds patched so that every request takes ``path``."""
    patch = ({"STREAM_MIN_ROWS": 1 << 40} if path == "padded" else {"STREAM_MIN_ROWS": 1, "STREAM_MIN_BYTES": 0})

    def run() -> object:
        saved = {k: getattr(module, k) for k in patch}
        for k, v in patch.items():
            setattr(module, k, v)
        try:
            return call()
        finally:
            for k, v in saved.items():
                setattr(module, k, v)

    return run


#: the timer: wall clock, or with one torch thread the CPU time of that thread (``--clock``)
CLOCK: Callable[[], float] = time.perf_counter


def best_of(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best seconds of each function, timed in turn every round, after one warm-up call each."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = CLOCK()
            fn()
            best[name] = min(best[name], CLOCK() - t0)
    return best


def decode_sweep(contexts: list[int], rounds: int, before: ModuleType | None) -> list[dict]:
    import mla_backends
    from mla_backends.ref_torch import backend as ref

    rows = []
    for ctx in contexts:
        inp = Inputs(mla_backends, ctx, BATCH)
        call = inp.call(ref.RefTorchBackend())
        fns = {"ref": call, "padded": forced(ref, call, "padded"), "streamed": forced(ref, call, "streamed"),
               "baseline": baseline(inp)}
        out, lse = call()
        torch.testing.assert_close(out, fns["baseline"](), rtol=1e-4, atol=1e-4)  # the same attention
        if before is not None:
            old = Inputs(before, ctx, BATCH)
            fns["before"] = old.call(importlib.import_module(before.__name__ + ".ref_torch.backend").RefTorchBackend())
        t = best_of(fns, rounds)
        min_rows = ref.stream_min_rows(BATCH, WIDTH * 4)
        row = {"context": ctx, "path": "streamed" if ctx + 1 >= min_rows else "padded",
               **{f"{k}_ms": round(v * 1e3, 3) for k, v in t.items()},
               "ref_over_baseline": round(t["ref"] / t["baseline"], 3)}
        if "before" in t:
            row["ref_over_before"] = round(t["ref"] / t["before"], 3)
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def crossover_sweep(rounds: int) -> list[dict]:
    """Padded against streamed at 2, 8 and 32 requests, lengths where the batch's float32 rows take 8..48 MiB."""
    import mla_backends
    from mla_backends.ref_torch import backend as ref

    rows = []
    for batch in (2, 8, 32):
        for mib in (8, 16, 24, 32, 48):
            ctx = (mib << 20) // (batch * WIDTH * 4)
            inp = Inputs(mla_backends, ctx, batch)
            call = inp.call(ref.RefTorchBackend())
            t = best_of({"padded": forced(ref, call, "padded"), "streamed": forced(ref, call, "streamed")}, rounds)
            row = {"batch": batch, "context": ctx, "rows_mib": mib, "padded_ms": round(t["padded"] * 1e3, 3),
                   "streamed_ms": round(t["streamed"] * 1e3, 3),
                   "padded_over_streamed": round(t["padded"] / t["streamed"], 3)}
            rows.append(row)
            print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--before", metavar="PATH", help="also time the REF_TORCH of the checkout at PATH")
    p.add_argument("--crossover", action="store_true", help="also time padded against streamed at 2/8/32 requests")
    p.add_argument("--clock", choices=("wall", "thread"), default=None,
                   help="wall clock, or the CPU time of the calling thread (only with --threads 1: torch then runs "
                        "every op on it; time spent preempted by other processes is not counted). Default: thread "
                        "with --threads 1, else wall")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "ref-decode-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.contexts) < 0:
        p.error("--rounds must be >= 1 and --contexts >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = args.clock or ("thread" if torch.get_num_threads() == 1 else "wall")
    if clock == "thread" and torch.get_num_threads() != 1:
        p.error("--clock thread needs --threads 1 (other threads' work would not be counted)")
    global CLOCK
    CLOCK = time.thread_time if clock == "thread" else time.perf_counter
    before = load_package(os.path.abspath(args.before)) if args.before else None
    print(f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load {os.getloadavg()}, best of {args.rounds}, "
          f"{clock} clock",
          flush=True)
    load0 = os.getloadavg()
    result = {"shape": {"batch": BATCH, "heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "page": PAGE,
                        "dtype": "float32"},
              "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "rounds": args.rounds, "before": args.before, "clock": clock,
              "timing": "best of rounds, variants interleaved",
              "decode": decode_sweep(args.contexts, args.rounds, before)}
    if args.crossover:
        result["crossover"] = crossover_sweep(args.rounds)
    result["load_average"] = {"start": load0, "end": os.getloadavg()}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
