"""REF_TORCH's CPU decode, one ``forward_mqa`` (one layer call), against this machine's roofline and its peers.

Shape (issue 29's vLLM benchmark, DeepSeek-V2-Lite): ``--batch`` (8) decode requests, ``--heads`` (16) heads,
kv_lora_rank 512 + rope 64, ``--dtype`` (float32) queries and cache, page size 16 (vLLM's CPU backend forces
it), a scattered block table (``--table contiguous``: each request's pages consecutive); request ``i`` holds
``context - i`` cached rows, for each ``--contexts`` value.
Timed per context:

- ``ref``: REF_TORCH as shipped (its own choice of path, ``path`` in the output);
- ``fused``: CPU_FUSED, the compiled kernel (when it is built for this machine: ``mla-backends build``), with
  ``fused_over_roofline``, ``cpu_mla_over_fused`` (its speed-up over vLLM's op), ``fused_gflops`` and
  ``fused_over_matmul`` (its FLOP rate over this machine's fp32 matmul rate, measured in the same rounds);
- ``roofline``: ``max(bytes / copy bandwidth, FLOPs / matmul rate)`` of the call
  (:func:`mla_backends.planning.roofline.decode_roofline`: every visible cache row read once, queries read,
  outputs and the LSE written; scores over 576 columns and the weighted sum over 512), both rates measured in
  this run, in the same rounds as the kernels (a 1024^3 matmul and a 128 MiB copy, the best of each kept), and
  ``ref_over_roofline``. The bytes are the benchmark's dtype's (2-byte rows for bfloat16); the matmul rate is
  the faster of torch's fp32 and its dtype matmul (``matmul_gflops``; both kept: torch's bfloat16 matmul runs
  at about 1 GFLOP/s on a CPU without bf16 instructions, where the same products are exact in fp32);
- ``cpu_mla`` (when ``vllm`` imports: run this under ``.venv-vllm``'s python): vLLM's C++ ``CPU_MLA`` decode op
  ``torch.ops._C.mla_decode_kvcache`` on the same cache, table and lengths (its query concatenated per call, as
  ``CPUMLAImpl`` does), and ``cpu_mla_over_roofline``;
- ``transformers`` (``--transformers``, contexts up to ``--hf-max-context``): one decode step of transformers'
  ``DeepseekV3Attention`` (eager, its own ``DynamicCache``), which re-expands the whole latent through
  ``kv_b_proj`` every step. It is the whole attention layer (projections included: transformers has no
  separate attention core), set against the same roofline, so its ratio also counts work the others do not;
- ``padded`` / ``streamed`` (``--paths``): REF_TORCH forced onto one path (its thresholds patched for the call);
- ``baseline`` (``--paths``): a plain ``index_select`` of the batch's pages, ``bmm``, masked softmax, ``bmm``;
- ``before`` (with ``--before PATH``): the REF_TORCH of another checkout (e.g. the code before a change:
  ``git archive <commit> | tar -x -C /tmp/before``), loaded in this process under another package name.

Paired figures (``--pairs N``, default 24; 0: none), for a machine whose speed drifts: N rounds, each timing a
512^3 fp32 matmul and then one call of ``fused`` and of ``cpu_mla`` (each after one untimed call that brings its
data back), so each round's figures meet the same spell of the machine. ``fused_over_roofline_paired`` is the
median over rounds of the call's time over the roofline made with that round's matmul rate (and the run's best
copy rate), with its quartiles; ``cpu_mla_over_fused_paired`` the median of the two calls' ratio;
``fused_ms_at_best_matmul`` the median of the call's time scaled by the round's matmul rate over the run's best
(what the call takes when the machine runs at its fastest), whose intercept is ``fused_fixed_cost_ms_paired``.

Each call gets preallocated outputs and a step planned once (``plan_step``), as every layer of a step
after the first. The machine may be shared: every round times each variant once, in turn, and each keeps its
best over ``--rounds`` rounds (after a warm-up call); the load average is recorded. With ``--threads 1`` the
timer is the CPU time of the calling thread (torch runs every op on it), which time spent preempted by other
processes does not inflate; with more threads it is the wall clock. ``--crossover`` also times
the padded against the streamed path at 2, 8 and 32 requests, at lengths where the batch's rows take 8 to 48
MiB, which is where ``STREAM_MIN_BYTES`` comes from.

The JSON goes to ``--json``; the picture (fraction of the roofline, ``roofline / time``, against the context
length for each variant timed) to ``--png`` when matplotlib imports, else ``--plot JSON --png PNG`` draws it
later from the JSON (``.venv-vllm`` has no matplotlib: run the benchmark there, the picture under ``.venv``).

Usage: ``python benchmarks/bench_ref_decode_cpu.py [--rounds 7] [--threads 1] [--batch 8] [--heads 16]
[--dtype float32] [--contexts ...] [--transformers] [--paths] [--before PATH] [--crossover] [--skip ref cpu_mla]
[--json J] [--png P]``
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
DEFAULT_CONTEXTS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: the benchmark's dtype and shape (``--dtype``, ``--heads``, ``--batch``) and block table (``--table``)
DTYPE = torch.float32
TABLE = "scattered"
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
        order = torch.arange(nb) if TABLE == "contiguous" else torch.randperm(nb, generator=g)
        self.table = table = order[: batch * pages].view(batch, pages).int()
        self.cache = pkg.LatentKVCache(nb, PAGE, RANK, ROPE, model_dtype=DTYPE)
        self.cache.data.copy_(torch.randn(self.cache.data.shape, generator=g))
        self.meta = pkg.BatchMetadata.build([1] * batch, self.contexts, table, PAGE, num_blocks=nb)
        self.pkg = pkg
        self.q_latent = torch.randn(batch, HEADS, RANK, generator=g).to(DTYPE)
        self.q_rope = torch.randn(batch, HEADS, ROPE, generator=g).to(DTYPE)
        self.out = torch.empty(batch, HEADS, RANK, dtype=DTYPE)
        self.lse = torch.empty(batch, HEADS)

    def call(self, backend: object) -> Callable[[], object]:
        configure = getattr(backend, "configure", None)
        configure_backend = getattr(self.pkg, "configure_backend", None)
        caps = getattr(getattr(self.pkg, "backends", None), "capabilities", None)
        if caps is not None:  # as a layer configures its backend (heads, dtype, page)
            spec = caps.AttentionSpec(num_heads=HEADS, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, dtype=DTYPE,
                                      block_size=PAGE)
            if configure_backend is not None:  # 0.5: an immutable configured backend
                backend = configure_backend(backend, spec, SCALE)
            elif configure is not None:  # 0.4 (--before)
                configure(spec, SCALE)
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


def cpu_mla(inp: Inputs) -> Callable[[], torch.Tensor] | None:
    """vLLM's C++ CPU MLA decode op on ``inp``'s cache, table and lengths, called as ``CPUMLAImpl`` calls it
    (the query concatenated, the output zeroed), or None when ``vllm._custom_ops`` does not import."""
    try:
        ops = importlib.import_module("vllm._custom_ops")
    except Exception:  # noqa: BLE001 - any failure to import means: no peer here
        return None
    table = inp.table.to(torch.int32)
    seq_lens = torch.tensor([c + 1 for c in inp.contexts], dtype=torch.int32)
    data = inp.cache.data

    def run() -> torch.Tensor:
        q = torch.cat((inp.q_latent, inp.q_rope), dim=-1).contiguous()
        o = torch.zeros(q.shape[0], q.shape[1], RANK, dtype=q.dtype)
        ops.mla_decode_kvcache_cpu(o, q, data, float(SCALE), table, seq_lens)
        return o

    return run


def fused_backend() -> object | None:
    """A CPU_FUSED instance when its kernel is built for this machine (loaded here; never built by the
    benchmark: ``mla-backends build`` does that), else None."""
    try:
        from mla_backends.cpu_fused import CpuFusedBackend, build
    except ImportError:  # a checkout from before CPU_FUSED
        return None
    try:
        build.load(build_if_missing=False)
    except build.BuildError as exc:
        print(f"CPU_FUSED not timed: {exc}", flush=True)
        return None
    return CpuFusedBackend()


def transformers_step(context: int, batch: int) -> Callable[[], torch.Tensor] | None:
    """One decode step of transformers' ``DeepseekV3Attention`` (eager; DeepSeek-V2-Lite attention with
    ``HEADS`` heads) over ``context`` cached tokens per request held in its own ``DynamicCache``, or None when
    transformers does not import. Each call appends one token (as decode does)."""
    try:
        from transformers import DynamicCache
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3RotaryEmbedding,
        )
    except Exception:  # noqa: BLE001
        return None
    import dataclasses

    from mla_backends.core.dims import MLADims
    from mla_backends.loading.hf import random_hf_state_dict

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_layer_cpu import hf_config

    dims = dataclasses.replace(MLADims.deepseek_v2_lite(), num_heads=HEADS)
    cfg = hf_config(dims)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval().to(DTYPE)
    attn.load_state_dict({k: v.to(DTYPE) for k, v in random_hf_state_dict(dims, dtype=torch.float32).items()
                          if k in attn.state_dict()}, strict=False)
    rot = DeepseekV3RotaryEmbedding(cfg)
    hf_cache = DynamicCache(config=cfg)
    x = (torch.randn(batch, 1, dims.hidden_size) * 0.5).to(DTYPE)
    with torch.inference_mode():  # the cached context: one prefill-sized update of random rows
        hf_cache.update(torch.randn(batch, 1, context, RANK).to(DTYPE), torch.randn(batch, 1, context, ROPE).to(DTYPE),
                        0)
    steps = [0]

    def run() -> torch.Tensor:
        with torch.inference_mode():
            p = torch.full((batch, 1), context + steps[0])
            steps[0] += 1
            cos, sin = rot(x, p)
            return attn(x, (cos.to(DTYPE), sin.to(DTYPE)), None, cache=hf_cache)[0]

    return run


def _matmul_rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of one ``n^3`` matmul in ``dtype`` (after one untimed call), timed with ``CLOCK``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=c)
    t0 = CLOCK()
    torch.matmul(a, b, out=c)
    return 2 * n**3 / (CLOCK() - t0)


def machine_rates() -> dict[str, float]:
    """This machine's rates, one timing each with ``CLOCK``: fp32 matmul FLOP/s (1024^3), the benchmark dtype's
    (a 256^3 one when it is not fp32: torch's bfloat16 matmul is very slow without bf16 instructions), the rate
    the roofline uses (the faster of the two), and the copy bandwidth (bytes read + written per second, 32 Mi
    elements in the benchmark's dtype)."""
    fp32 = _matmul_rate(torch.float32)
    own = fp32 if DTYPE == torch.float32 else _matmul_rate(DTYPE, 256)
    src = torch.randn(32 << 20).to(DTYPE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = CLOCK()
    dst.copy_(src)
    t_cp = CLOCK() - t0
    return {"matmul_flops_per_s": max(fp32, own), "fp32_matmul_flops_per_s": fp32, "dtype_matmul_flops_per_s": own,
            "copy_bytes_per_s": 2 * src.numel() * src.element_size() / t_cp}


def roofline_s(inp: Inputs, rates: dict[str, float]) -> tuple[float, str]:
    """The call's roofline in seconds (``decode_roofline`` with ``rates``) and which bound it is."""
    import dataclasses

    from mla_backends.core.dims import MLADims
    from mla_backends.planning.roofline import decode_roofline

    dims = dataclasses.replace(MLADims.deepseek_v2_lite(), num_heads=HEADS)
    size = torch.empty((), dtype=DTYPE).element_size()
    roof = decode_roofline(dims, [c + 1 for c in inp.contexts], cache_bytes=size, q_bytes=size, out_bytes=size,
                           lse=True, peak_bytes_per_s=rates["copy_bytes_per_s"],
                           peak_flops_per_s=rates["matmul_flops_per_s"])
    return roof.roofline_us * 1e-6, roof.bound


def forced(module: ModuleType, make_call: Callable[[], Callable[[], object]], path: str) -> Callable[[], object]:
    """The call ``make_call()`` builds, built (and its step planned: REF_TORCH picks a request's path when the
    step is planned) with REF_TORCH's thresholds patched so that every request takes ``path``."""
    patch = ({"STREAM_MIN_ROWS": 1 << 40} if path == "padded" else {"STREAM_MIN_ROWS": 1, "STREAM_MIN_BYTES": 0})
    saved = {k: getattr(module, k) for k in patch}
    for k, v in patch.items():
        setattr(module, k, v)
    try:
        return make_call()
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


#: the timer: wall clock, or with one torch thread the CPU time of that thread (``--clock``)
CLOCK: Callable[[], float] = time.perf_counter


#: each round, calls of one function are timed until this many seconds are spent, or ...
MIN_SECONDS = 0.02
#: ... this many calls made (one at least)
MAX_CALLS = 20


def best_of(fns: dict[str, Callable[[], object]], rounds: int,
            rates: dict[str, float] | None = None) -> dict[str, float]:
    """Best seconds of one call of each function. Every round measures the machine's rates first (with
    ``rates``, updated in place: the best of each kept), then each function in turn, in an order rotated by
    one every round: one untimed call (its data back in cache after the rates' 128 MiB copy and the
    other functions), then calls timed one by one until ``MIN_SECONDS`` are spent or ``MAX_CALLS`` made.
    So no function is always the one that meets a cold cache, and a call of 0.1 ms is timed on more than
    one clock reading."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for r in range(rounds):
        if rates is not None:
            for k, v in machine_rates().items():
                rates[k] = max(rates.get(k, 0.0), v)
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            fn()
            spent, calls = 0.0, 0
            while calls == 0 or (spent < MIN_SECONDS and calls < MAX_CALLS):
                t0 = CLOCK()
                fn()
                dt = CLOCK() - t0
                best[name], spent, calls = min(best[name], dt), spent + dt, calls + 1
    return best


#: rounds of the paired figures (``--pairs``)
PAIRS = 24


def paired_rounds(fns: dict[str, Callable[[], object]], pairs: int) -> tuple[dict[str, list[float]], list[float]]:
    """``pairs`` rounds, each: one 512^3 fp32 matmul timed, then each function (in an order rotated every
    round) called once untimed and once timed. Returns each function's seconds per round and each round's matmul
    FLOP/s, so that every ratio is taken between timings a few milliseconds apart."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.matmul(a, b, out=c)
    times: dict[str, list[float]] = {k: [] for k in fns}
    rates: list[float] = []
    names = list(fns)
    for r in range(pairs):
        t0 = CLOCK()
        torch.matmul(a, b, out=c)
        rates.append(2 * n**3 / (CLOCK() - t0))
        for name in names[r % len(names):] + names[: r % len(names)]:
            fns[name]()
            t0 = CLOCK()
            fns[name]()
            times[name].append(CLOCK() - t0)
    return times, rates


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def paired_figures(fns: dict[str, Callable[[], object]], inp: Inputs, copy_bytes_per_s: float,
                   pairs: int) -> dict[str, object]:
    """The paired figures of ``fused`` (and ``cpu_mla`` when timed): see the module docstring."""
    times, rates = paired_rounds({k: fns[k] for k in ("fused", "cpu_mla") if k in fns}, pairs)
    best_rate = max(rates)
    fused = times["fused"]
    over = [t / roofline_s(inp, {"copy_bytes_per_s": copy_bytes_per_s, "matmul_flops_per_s": rate})[0]
            for t, rate in zip(fused, rates, strict=True)]
    row: dict[str, object] = {
        "paired_rounds": pairs,
        "paired_matmul_gflops": [round(min(rates) / 1e9, 1), round(best_rate / 1e9, 1)],
        "fused_over_roofline_paired": round(_quantile(over, 0.5), 3),
        "fused_over_roofline_paired_quartiles": [round(_quantile(over, 0.25), 3), round(_quantile(over, 0.75), 3)],
        "fused_ms_at_best_matmul": round(
            _quantile([t * rate / best_rate for t, rate in zip(fused, rates, strict=True)], 0.5) * 1e3, 4)}
    if "cpu_mla" in times:
        row["cpu_mla_over_fused_paired"] = round(
            _quantile([p / f for p, f in zip(times["cpu_mla"], fused, strict=True)], 0.5), 3)
    return row


def decode_flops(inp: Inputs) -> float:
    """FLOPs of one call: each visible row scored over 576 columns and summed over 512, for every head."""
    return sum(c + 1 for c in inp.contexts) * HEADS * 2 * (RANK + ROPE + RANK)


def decode_sweep(contexts: list[int], rounds: int, before: ModuleType | None, *, paths: bool = False,
                 hf: bool = False, hf_max_context: int = 2048, skip: tuple[str, ...] = ()) -> list[dict]:
    import mla_backends
    from mla_backends.ref_torch import backend as ref

    tol = 1e-4 if DTYPE == torch.float32 else 2e-2
    fused = fused_backend() if "fused" not in skip else None
    rows = []
    for ctx in contexts:
        inp = Inputs(mla_backends, ctx, BATCH)
        call = inp.call(ref.RefTorchBackend())
        fns: dict[str, Callable[[], object]] = {} if "ref" in skip else {"ref": call}
        out, lse = call()
        out = out.clone()
        if fused is not None:
            fns["fused"] = inp.call(fused)
            torch.testing.assert_close(fns["fused"]()[0], out, rtol=tol, atol=tol)  # the same attention
        peer = cpu_mla(inp) if "cpu_mla" not in skip else None
        if peer is not None:
            fns["cpu_mla"] = peer
            torch.testing.assert_close(peer(), out, rtol=tol, atol=tol)  # the same attention
        if paths:
            make = lambda: inp.call(ref.RefTorchBackend())  # noqa: E731,B023 (used at once)
            fns.update(padded=forced(ref, make, "padded"), streamed=forced(ref, make, "streamed"),
                       baseline=baseline(inp))
            torch.testing.assert_close(out, fns["baseline"]().to(out.dtype), rtol=tol, atol=tol)
        if before is not None:
            old = Inputs(before, ctx, BATCH)
            fns["before"] = old.call(importlib.import_module(before.__name__ + ".ref_torch.backend").RefTorchBackend())
        hf_fn = transformers_step(ctx, BATCH) if hf and ctx <= hf_max_context else None
        if hf_fn is not None:
            fns["transformers"] = hf_fn
        rates: dict[str, float] = {}
        t = best_of(fns, rounds, rates)
        roof, bound = roofline_s(inp, rates)
        min_rows = ref.stream_min_rows(BATCH, WIDTH * 4)
        row = {"context": ctx, "path": "streamed" if ctx + 1 >= min_rows else "padded",
               **{f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()},
               "roofline_ms": round(roof * 1e3, 4), "bound": bound,
               "matmul_gflops": round(rates["matmul_flops_per_s"] / 1e9, 1),
               "fp32_matmul_gflops": round(rates["fp32_matmul_flops_per_s"] / 1e9, 1),
               "dtype_matmul_gflops": round(rates["dtype_matmul_flops_per_s"] / 1e9, 1),
               "copy_gbps": round(rates["copy_bytes_per_s"] / 1e9, 1),
               **{f"{k}_over_roofline": round(v / roof, 3) for k, v in t.items()
                  if k in ("ref", "fused", "cpu_mla", "transformers", "before")}}
        if "before" in t and "ref" in t:
            row["ref_over_before"] = round(t["ref"] / t["before"], 3)
        if "cpu_mla" in t and "ref" in t:
            row["ref_over_cpu_mla"] = round(t["ref"] / t["cpu_mla"], 3)
        if "fused" in t:
            flops = decode_flops(inp)
            row["fused_gflops"] = round(flops / t["fused"] / 1e9, 1)
            row["fused_over_matmul"] = round(flops / t["fused"] / rates["fp32_matmul_flops_per_s"], 3)
            if "cpu_mla" in t:
                row["cpu_mla_over_fused"] = round(t["cpu_mla"] / t["fused"], 3)
            if "ref" in t:
                row["ref_over_fused"] = round(t["ref"] / t["fused"], 3)
            if PAIRS:
                row.update(paired_figures(fns, inp, rates["copy_bytes_per_s"], PAIRS))
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def fixed_cost_ms(rows: list[dict], key: str = "ref_ms", below: int = 256) -> float | None:
    """The per-call fixed cost of ``key``: the intercept at zero context of a least-squares line through the
    timings of the contexts under ``below`` (None with fewer than two)."""
    pts = [(r["context"], r[key]) for r in rows if r["context"] < below and key in r]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return round(my - slope * mx, 4)


LABELS = {"fused": "CPU_FUSED (mla-backends, compiled)", "ref": "REF_TORCH (mla-backends)",
          "cpu_mla": "vLLM CPU_MLA (C++ op)",
          "transformers": "transformers DeepseekV3Attention (whole layer, eager)", "before": "REF_TORCH before"}


def plot(result: dict, png: str, command: str) -> None:
    """Fraction of the roofline (roofline / time) against the context length, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decode"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for key, label in LABELS.items():
        pts = [(r["context"], r["roofline_ms"] / r[f"{key}_ms"]) for r in rows if f"{key}_ms" in r]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    paired = [(r["context"], 1 / r["fused_over_roofline_paired"], [1 / q for q in
               reversed(r["fused_over_roofline_paired_quartiles"])]) for r in rows if "fused_over_roofline_paired" in r]
    if paired:  # the median of the rounds timed beside a matmul, its quartiles as the bar
        xs, ys = [x for x, _, _ in paired], [y for _, y, _ in paired]
        err = [[y - q[0] for _, y, q in paired], [q[1] - y for _, y, q in paired]]
        ax.errorbar(xs, ys, yerr=err, marker="s", ls=":", color="tab:blue", capsize=3,
                    label="CPU_FUSED, paired with a matmul (median, quartiles)")
    ax.axhline(1 / 1.3, color="grey", ls="--", lw=1, label="CPU_FUSED's target: 1 / 1.3 of the roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (cached tokens per request)")
    ax.set_ylabel("fraction of roofline (roofline / time)")
    ax.set_ylim(0, 1.05)
    sh = result["shape"]
    ax.set_title(f"CPU decode, forward_mqa: batch {sh['batch']}, {sh['heads']} heads, {sh['dtype']}, page "
                 f"{sh['page']}, {sh.get('table', 'scattered')} table, {result['threads']} thread(s)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, command, fontsize=6, family="monospace")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def crossover_sweep(rounds: int) -> list[dict]:
    """Padded against streamed at 2, 8 and 32 requests, lengths where the batch's float32 rows take 8..48 MiB."""
    import mla_backends
    from mla_backends.ref_torch import backend as ref

    rows = []
    for batch in (2, 8, 32):
        for mib in (8, 16, 24, 32, 48):
            ctx = (mib << 20) // (batch * WIDTH * 4)
            inp = Inputs(mla_backends, ctx, batch)
            make = lambda: inp.call(ref.RefTorchBackend())  # noqa: E731,B023 (used at once)
            t = best_of({"padded": forced(ref, make, "padded"), "streamed": forced(ref, make, "streamed")}, rounds)
            row = {"batch": batch, "context": ctx, "rows_mib": mib, "padded_ms": round(t["padded"] * 1e3, 3),
                   "streamed_ms": round(t["streamed"] * 1e3, 3),
                   "padded_over_streamed": round(t["padded"] / t["streamed"], 3)}
            rows.append(row)
            print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    global CLOCK, DTYPE, HEADS, BATCH, TABLE, PAIRS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--table", choices=("scattered", "contiguous"), default="scattered",
                   help="block table: pages in random order, or each request's pages consecutive in the cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--before", metavar="PATH", help="also time the REF_TORCH of the checkout at PATH")
    p.add_argument("--paths", action="store_true", help="also time the forced padded / streamed paths and a "
                   "plain baseline")
    p.add_argument("--transformers", action="store_true", help="also time transformers' DeepseekV3Attention")
    p.add_argument("--hf-max-context", type=int, default=2048, help="longest context transformers is timed at")
    p.add_argument("--crossover", action="store_true", help="also time padded against streamed at 2/8/32 requests")
    p.add_argument("--skip", nargs="+", default=[], choices=("ref", "fused", "cpu_mla"),
                   help="variants not to time (REF_TORCH is still run once, as the output every variant is checked "
                        "against)")
    p.add_argument("--clock", choices=("wall", "thread"), default=None,
                   help="wall clock, or the CPU time of the calling thread (only with --threads 1: torch then runs "
                        "every op on it; time spent preempted by other processes is not counted). Default: thread "
                        "with --threads 1, else wall")
    p.add_argument("--pairs", type=int, default=PAIRS,
                   help="rounds of the paired figures of CPU_FUSED (matmul, CPU_FUSED and vLLM's op timed back to "
                        "back; 0: none)")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "ref-decode-cpu-roofline.json"))
    p.add_argument("--png", default=None, help="write the picture here (needs matplotlib)")
    p.add_argument("--plot", metavar="JSON", help="only draw --png from this JSON (no timing)")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        plot(result, args.png or os.path.join(ROOT, "docs", "ref-decode-cpu.png"), result.get("command", ""))
        return 0
    if args.rounds < 1 or min(args.contexts) < 0 or args.batch < 1 or args.heads < 1 or args.pairs < 0:
        p.error("--rounds, --batch and --heads must be >= 1, --contexts and --pairs >= 0")
    BATCH, HEADS, DTYPE, TABLE, PAIRS = args.batch, args.heads, getattr(torch, args.dtype), args.table, args.pairs
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = args.clock or ("thread" if torch.get_num_threads() == 1 else "wall")
    if clock == "thread" and torch.get_num_threads() != 1:
        p.error("--clock thread needs --threads 1 (other threads' work would not be counted)")
    CLOCK = time.thread_time if clock == "thread" else time.perf_counter
    before = load_package(os.path.abspath(args.before)) if args.before else None
    command = "python " + " ".join(["benchmarks/bench_ref_decode_cpu.py", *sys.argv[1:]]) if argv is None else ""
    print(f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load {os.getloadavg()}, best of {args.rounds}, "
          f"{clock} clock",
          flush=True)
    load0 = os.getloadavg()
    result = {"command": command,
              "shape": {"batch": BATCH, "heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "page": PAGE,
                        "dtype": args.dtype, "table": args.table},
              "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "rounds": args.rounds, "before": args.before, "clock": clock,
              "timing": "best of rounds, variants interleaved, machine rates measured in the same rounds",
              "decode": decode_sweep(args.contexts, args.rounds, before, paths=args.paths, hf=args.transformers,
                                     hf_max_context=args.hf_max_context, skip=tuple(args.skip))}
    result["ref_fixed_cost_ms"] = fixed_cost_ms(result["decode"])
    result["fused_fixed_cost_ms"] = fixed_cost_ms(result["decode"], "fused_ms")
    result["fused_fixed_cost_ms_paired"] = fixed_cost_ms(result["decode"], "fused_ms_at_best_matmul")
    if args.before:
        result["before_fixed_cost_ms"] = fixed_cost_ms(result["decode"], "before_ms")
    print(f"fixed cost per call (intercept below 256 tokens): ref {result['ref_fixed_cost_ms']} ms, "
          f"fused {result['fused_fixed_cost_ms']} ms (paired, at the best matmul rate: "
          f"{result['fused_fixed_cost_ms_paired']} ms)"
          + (f", before {result['before_fixed_cost_ms']} ms" if args.before else ""))
    if args.crossover:
        result["crossover"] = crossover_sweep(args.rounds)
    result["load_average"] = {"start": load0, "end": os.getloadavg()}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.json}")
    if args.png:
        try:
            plot(result, args.png, command)
        except ImportError:
            print(f"no matplotlib here: draw it with python benchmarks/bench_ref_decode_cpu.py --plot {args.json} "
                  f"--png {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
