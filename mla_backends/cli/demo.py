"""``mla-backends demo``: the main job of ``make run``.

It runs a DeepSeek-V3-shaped absorbed decode (16 local heads, V3 at TP=8) over a paged cache with a scattered
block table, checks it against the naive expanded computation, and prints both times and their ratio.

Then it runs a real :class:`~mla_backends.layer.attention.MLAAttention` (random weights, the same shapes): a batched
prefill, decode steps, and a mixed step (decodes plus extends over cached prefixes), and checks the mixed step
against the same step run entirely through the expanded path. Last, transformers' own ``generate()`` of a tiny
random DeepSeek model, unpatched and patched (:mod:`mla_backends.cli.generate_demo`).
"""

from __future__ import annotations

import argparse
import time

from .args import csv_text, int_at_least, int_list, int_list_at_least


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run a DeepSeek-V3-shaped decode and compare it with the naive path",
        description="The `make run` job: print the selection for this machine, time a DeepSeek-V3-shaped absorbed "
                    "decode (16 heads, V3 at TP=8) against the naive expanded path and check that they match, "
                    "then run an MLAAttention layer with random weights through prefill, decode and mixed steps.",
    )
    p.add_argument("--requests", type=int_at_least(1), default=4, help="decode requests in the batch (default 4)")
    p.add_argument("--context", type=int_list_at_least(0), default=[3000], metavar="S[,S...]",
                   help="cached tokens per request, one or a list cycled over the requests (default 3000)")
    p.add_argument("--block-size", type=int_at_least(1), default=64, help="page size in tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed for inputs and weights (default 0)")
    prompts = [96, 64, 80, 32]
    p.add_argument("--prompts", type=int_list, default=prompts, metavar="N[,N...]",
                   help=f"layer section: prompt lengths, comma-separated (default {csv_text(prompts)})")
    p.add_argument("--decode-steps", type=int_at_least(0), default=6,
                   help="layer section: decode steps (default 6)")
    p.add_argument("--skip-layer", action="store_true", help="only the decode comparison")
    p.add_argument("--skip-generate", action="store_true",
                   help="no transformers generate() section (tiny DeepSeek model, unpatched vs patched)")
    p.set_defaults(func=run)


def _timed(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def decode_comparison(args: argparse.Namespace) -> int:
    import torch

    from ..backends.naive import expanded_decode
    from ..core.dims import MLADims
    from ..core.errors import plugin_call
    from ..plugins.loading import get_backend
    from ..step.cache import LatentKVCache, block_table_slots
    from ..step.metadata import BatchMetadata

    torch.manual_seed(args.seed)
    dims = MLADims.deepseek_v3().tensor_parallel(8)
    H, r, P, R, V = dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    B, bs = args.requests, args.block_size
    contexts = [args.context[b % len(args.context)] for b in range(B)]
    pages = -(-(max(contexts) + 1) // bs)
    num_blocks = B * pages + 8
    cache = LatentKVCache.allocate(dims, num_blocks, bs, "auto", model_dtype=torch.float32)
    block_table = torch.randperm(num_blocks)[: B * pages].view(B, pages).to(torch.int32)
    meta = BatchMetadata.build([1] * B, contexts, block_table, bs, num_blocks=num_blocks)
    for b, ctx in enumerate(contexts):  # fill every request's context and its new token
        slots = block_table_slots(block_table[b], ctx + 1, bs)
        cache.write(torch.randn(ctx + 1, r) * 0.5, torch.randn(ctx + 1, R) * 0.5, slots)
    w_uk = torch.randn(H, P, r) * r**-0.5
    w_uv = torch.randn(H, r, V) * r**-0.5
    q_nope, q_pe = torch.randn(B, H, P), torch.randn(B, H, R)
    backend_cls = getattr(args, "backend_cls", None) or get_backend("REF_TORCH")
    with plugin_call(backend_cls, "__init__()"):  # a plugin's sys.exit() is an error the CLI reports
        backend = backend_cls()

    def absorbed():
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, r]
        o, _ = backend.forward_mqa(q_latent.contiguous(), q_pe, cache, meta, scale=dims.softmax_scale)
        return torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)  # [B, H, V]

    def naive():
        return expanded_decode(q_nope, q_pe, w_uk, w_uv, cache, meta, dims.softmax_scale)

    out_a, t_a = _timed(absorbed)
    out_n, t_n = _timed(naive)
    err = (out_a - out_n).abs().max().item()
    ok = torch.allclose(out_a, out_n, atol=1e-4, rtol=1e-4)
    ctx_text = f"{contexts[0]}" if len(set(contexts)) == 1 else "/".join(map(str, contexts))
    print(f"Absorbed decode, DeepSeek-V3 shapes at TP=8 ({H} heads, {r}+{R} cache row), {B} requests x "
          f"{ctx_text} cached tokens, page {bs}, fp32, backend {backend_cls.name}")
    print(f"  absorbed (forward_mqa + folds): {t_a * 1e3:8.2f} ms")
    print(f"  naive expanded (up-project):    {t_n * 1e3:8.2f} ms")
    print(f"  speed-up: {t_n / t_a:.1f}x   max |difference|: {err:.2e}   {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def layer_demo(args: argparse.Namespace) -> int:
    """DeepSeek-V3 layer, 16 local heads: prefill, decode steps, a mixed step; absorbed vs expanded check."""
    import dataclasses

    import torch

    from ..core.dims import MLADims
    from ..layer.attention import MLAAttention
    from ..layer.dispatch import PerRequestPolicy
    from ..loading.hf import random_hf_state_dict
    from ..step.metadata import BatchMetadata
    from ..step.plan import plan_step

    prompts = args.prompts
    torch.manual_seed(args.seed)
    # one TP=8 rank of DeepSeek-V3, as a standalone 16-head layer (so the random checkpoint is rank-sized)
    dims = dataclasses.replace(MLADims.deepseek_v3().tensor_parallel(8), tp_size=1)
    backend = getattr(args, "backend_cls", None)
    t0 = time.perf_counter()
    sd = random_hf_state_dict(dims, dtype=torch.float32, seed=args.seed)
    layer = MLAAttention(dims, dtype=torch.float32, backend=backend)
    layer.load_hf_state_dict(sd)
    t_load = time.perf_counter() - t0
    B, bs, extend = len(prompts), args.block_size, 5
    total = [p + args.decode_steps + extend + 1 for p in prompts]
    pages = -(-max(total) // bs)
    num_blocks = B * pages + 4
    cache = layer.allocate_cache(num_blocks, bs)
    block_table = torch.randperm(num_blocks)[: B * pages].view(B, pages).to(torch.int32)
    print(f"\nMLAAttention layer, DeepSeek-V3 shapes at 16 local heads (hidden {dims.hidden_size}, q_lora "
          f"{dims.q_lora_rank}, {dims.kv_lora_rank}+{dims.qk_rope_head_dim} cache row), fp32, backend "
          f"{layer.backend_cls.name}, dispatch {layer.dispatch.name}")
    print(f"  random checkpoint made, loaded and folded (W_UK_T, W_UV) in {t_load:.2f} s")
    done = [0] * B

    def step(qlens: list[int], lay: MLAAttention = layer, c=cache) -> tuple[torch.Tensor, float]:
        meta = BatchMetadata.build(qlens, list(done), block_table, bs, num_blocks=num_blocks,
                                   decode_threshold=lay.decode_threshold)
        x = torch.randn(sum(qlens), dims.hidden_size) * 0.5
        with torch.inference_mode():
            t = time.perf_counter()
            y = lay(x, None, c, plan_step(meta, [lay]))
            return y, time.perf_counter() - t

    y, t = step(prompts)
    done = list(prompts)
    print(f"  prefill of {B} requests ({', '.join(map(str, prompts))} tokens) in one batch (forward_mha): "
          f"{t * 1e3:.1f} ms -> output {list(y.shape)}")
    times = []
    for _ in range(args.decode_steps):
        y, t = step([1] * B)
        times.append(t)
        done = [d + 1 for d in done]
    if times:
        print(f"  {len(times)} decode steps of batch {B} (absorbed forward_mqa): "
              f"{min(times) * 1e3:.1f} ms best, {sum(times) / len(times) * 1e3:.1f} ms mean")
    mixed = [extend if b % 2 else 1 for b in range(B)]
    expanded = MLAAttention(dims, dtype=torch.float32, backend=backend,
                            dispatch=PerRequestPolicy(threshold=0))  # threshold 0: every request expanded
    expanded.load_hf_state_dict(sd)
    cache2 = expanded.allocate_cache(num_blocks, bs)
    cache2.data.copy_(cache.data)
    rng = torch.random.get_rng_state()
    y_mix, t_mix = step(mixed)
    torch.random.set_rng_state(rng)
    y_exp, t_exp = step(mixed, expanded, cache2)
    err = ((y_mix - y_exp).abs().max() / y_exp.abs().max()).item()
    ok = err < 1e-4
    print(f"  mixed step (query lens {mixed} over cached {done}): {t_mix * 1e3:.1f} ms")
    print(f"  the same step all through forward_mha: {t_exp * 1e3:.1f} ms; max relative difference "
          f"{err:.1e}   "
          f"{'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    from selector.select import SelectionError, select_backend

    from ..core.dims import MLADims

    print("$ mla-backends select   (this machine; the demo below runs fp32 on the CPU)")
    try:  # the demo's own request: V3 at TP=8, fp32, its page size
        sel = select_backend(MLADims.deepseek_v3().tensor_parallel(8), dtype="float32",
                             block_size=args.block_size)
        print(sel.explain() + "\n")
        if not sel.device.is_cuda:  # the demo's tensors live on the CPU
            args.backend_cls = sel.backend
    except SelectionError as err:
        print(f"{err}\n")
    rc = decode_comparison(args)
    if getattr(args, "skip_layer", False):
        return rc
    rc = max(rc, layer_demo(args))
    if getattr(args, "skip_generate", False):
        return rc
    from .generate_demo import generate_demo

    return max(rc, generate_demo(args))
