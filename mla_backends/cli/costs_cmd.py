"""``mla-backends kv-cache`` and ``mla-backends crossover``: the cost model on the command line.

``kv-cache`` sizes the cache of a preset or a ``config.json`` (bytes per token, tokens that fit, the expanded
and GQA comparisons); ``crossover`` prints where the absorbed and expanded paths cost the same FLOPs.
Both take ``--json``. See docs/cost-model.md for the formulas.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.v4dims import V4Dims
from ..planning import reserve
from .args import add_model_args, csv_text, int_at_least, int_list, load_model_dims, per_rank_dims, refuse_v4

__all__ = ["register", "load_model_dims", "per_rank_dims", "run_kv_cache", "run_crossover", "model_label"]


def register(sub: argparse._SubParsersAction) -> None:
    from . import reports

    p = sub.add_parser("kv-cache", help="bytes per token, tokens that fit, expanded and GQA comparisons",
                       description="Size the latent KV cache of a model: bytes per token (per layer and over all "
                                   "layers, plus the V3.2 indexer cache), against expanded K/V and Llama-3-70B's "
                                   "GQA cache, and how many tokens fit in --cache-memory (or on --gpu). "
                                   "A DeepSeek-V4 model (deepseek-v4-flash, or its config.json) gets every pool "
                                   "of its layers instead, per page, per token and per request (docs/v4.md). "
                                   "See docs/cost-model.md.")
    add_model_args(p)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model dtype), bfloat16, float16, float32, fp8_e4m3, fp8_e5m2 (default auto)",
    )
    p.add_argument("--dtype", default="bfloat16", help="model dtype that 'auto' follows (default bfloat16)")
    p.add_argument(
        "--context", type=int_list, default=None, metavar="S[,S...]",
        help="tokens per sequence, one or a list, for per-sequence sizes (and how many fit in --cache-memory; "
        "with --gpu the first length)",
    )
    p.add_argument("--cache-memory", default=None, metavar="SIZE",
                   help="memory one rank gives to the KV cache alone (40GiB, 42.9GB; a bare number is GiB; "
                        "no weights counted)")
    p.add_argument("--gpu", default=None, metavar="NAME", help="size a deployment on this GPU (a100, h100, h200, "
                   "b200): weights, prefill workspace, what is left for the cache")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="the GPU's memory (143771MiB, 150.75GB = 150.75e9 bytes, 140GiB; a bare number is GiB); "
                        "overrides --gpu's, which is what the driver reports (nvidia-smi's total)")
    p.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None, metavar="T",
                   help="tokens one engine step runs, which sizes the activation reserve (default "
                        f"{reserve.DEFAULT_MAX_NUM_BATCHED_TOKENS:,}, vLLM's; needs --gpu or --gpu-memory); for "
                        "DeepSeek-V4 the tokens in flight that windowed pools hold beyond their window")
    p.add_argument("--reserve", default=None, metavar="SIZE",
                   help="memory per rank the engine holds back before the cache (activations, MoE buffers, "
                        "CUDA graphs, NCCL), replacing the modelled terms: e.g. the figures an engine logs "
                        "(2.5GiB; 0 holds nothing back; needs --gpu or --gpu-memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the GPU's memory the engine uses (default 0.9)")
    p.add_argument("--dcp", type=int, default=1, metavar="N",
                   help="decode context parallelism: N consecutive TP ranks split each sequence's cache "
                        "(needs --gpu or --gpu-memory)")
    p.add_argument("--dp-attention", action="store_true",
                   help="attention at TP=1 on every data-parallel rank (the experts still split --tp ways; "
                        "needs --gpu or --gpu-memory)")
    p.add_argument("--weights-dtype", default=None, help="weights dtype (default: as the preset is published; "
                   "DeepSeek-V3/R1 fp8_e4m3 with 128x128 block scales): fp8_e4m3, bfloat16, float16, float32")
    p.set_defaults(func=run_kv_cache)

    c = sub.add_parser("crossover", help="modelled FLOP crossover between the absorbed and the expanded path",
                       description="Print, per context length, the query-block length below which the absorbed "
                                   "path costs fewer FLOPs than the expanded one (a model; `mla-backends tune` "
                                   "measures it). See docs/cost-model.md.")
    add_model_args(c)
    c.add_argument(
        "--context",
        type=int_list,
        default=None,
        metavar="S[,S...]",
        help=f"context lengths of the report (default {csv_text(reports.DEFAULT_CONTEXTS)})",
    )
    c.add_argument(
        "--query-lens",
        type=int_list,
        default=None,
        metavar="Q[,Q...]",
        help=f"query-block lengths of the report (default {csv_text(reports.DEFAULT_QUERY_LENS)})",
    )
    c.add_argument(
        "--causal",
        action="store_true",
        help="count causal pairs (new tokens also attend each other) instead of the rectangular block",
    )
    c.set_defaults(func=run_crossover)


def model_label(spec: str, dims: Any) -> str:
    """The name a report shows: the preset the user asked for (``--model deepseek-r1`` has V3's dims and is
    still called ``deepseek-r1``; ``r1`` and ``deepseek_r1`` spell it too), or the config's own name."""
    import os

    from ..core.dims import PRESET_NAMES

    if os.path.exists(str(spec)):
        return dims.name
    key = str(spec).strip().lower().replace("_", "-")
    for name in (key, f"deepseek-{key}"):
        if name in PRESET_NAMES:
            return name
    return dims.name


def _size_label(text: str) -> str:
    """A size as the user wrote it, with the GiB a bare number means (``40`` -> ``40 GiB``)."""
    text = text.strip()
    return text if text[-1:].isalpha() else f"{text} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:,.3f} KiB"


def run_kv_cache(args: argparse.Namespace) -> int:
    from . import reports

    dims = load_model_dims(args.model)
    per_rank_dims(dims, args.tp)  # checks --tp; the cost functions take the whole model and tp
    tp = args.tp
    if isinstance(dims, V4Dims):
        return _run_v4_kv_cache(args, dims)
    cache_bytes = None
    if args.cache_memory is not None:
        from ..planning.deployment import parse_memory

        cache_bytes = parse_memory(args.cache_memory, "--cache-memory")  # exact decimal, whole bytes
    if args.gpu is not None or args.gpu_memory is not None:
        return _run_deployment(args, dims)
    if args.dcp != 1:  # the report below is one replicated rank: DCP/DP-attention would go unseen
        raise ValueError(f"--dcp: got {args.dcp} without --gpu or --gpu-memory; supported only with --gpu or "
                         "--gpu-memory (the deployment sizing, which applies it); --cache-memory alone sizes one "
                         "rank of a replicated cache")
    if args.dp_attention:
        raise ValueError("--dp-attention: got it without --gpu or --gpu-memory; supported only with --gpu or "
                         "--gpu-memory (the deployment sizing, which applies it); --cache-memory alone sizes one "
                         "rank of a replicated cache")
    for flag, value in (("--max-num-batched-tokens", args.max_num_batched_tokens), ("--reserve", args.reserve)):
        if value is not None:
            raise ValueError(f"{flag}: got {value} without --gpu or --gpu-memory; supported only with --gpu or "
                             "--gpu-memory (the deployment sizing, which holds the reserve back); --cache-memory "
                             "is the cache's own memory, with nothing held back")
    contexts = args.context or [None]
    label = model_label(args.model, dims)
    reps = [reports.kv_cache_report(dims, kv_cache_dtype=args.kv_cache_dtype, model_dtype=args.dtype, tp=tp,
                                    context_len=s, cache_memory_bytes=cache_bytes, model_name=label)
            for s in contexts]
    rep = reps[0]  # the first --context's per-sequence figures stay at the top level
    if args.context:
        rep["sequences"] = [{k: r[k] for k in ("context_len", "bytes_per_sequence", "sequences_that_fit")
                             if k in r} for r in reps]
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    b = rep["element_bytes"]
    print(
        f"{rep['model']}: {dims.cache_row_width}-wide latent row, {rep['kv_cache_dtype']} cache "
        f"({b} byte{'s' if b > 1 else ''}), {rep['num_layers']} layers, TP={tp}"
    )
    print(
        f"  latent cache      {rep['bytes_per_token_per_layer']:>12,} B/token/layer"
        f"   {rep['bytes_per_token']:>12,} B/token ({_kib(rep['bytes_per_token'])}), same on every rank"
    )
    if rep["indexer_bytes_per_token"]:
        print(
            f"  indexer cache     {rep['indexer_bytes_per_token_per_layer']:>12,} B/token/layer"
            f"   {rep['indexer_bytes_per_token']:>12,} B/token ({_kib(rep['indexer_bytes_per_token'])}, "
            f"{rep['indexing_layers']} indexing layers, +{100 * rep['indexer_overhead']:.1f}%)"
        )
    print(
        f"  expanded K+V      {rep['expanded_bytes_per_token']:>12,} B/token per rank "
        f"({rep['expanded_ratio']:.2f}x the latent)"
    )
    print(
        f"  GQA ({rep['gqa_model']}) {rep['gqa_bytes_per_token']:>12,} B/token per rank "
        f"({_kib(rep['gqa_bytes_per_token'])}); cluster total {rep['gqa_cluster_bytes_per_token']:,} "
        f"vs MLA {rep['cluster_bytes_per_token']:,}"
    )
    print(f"  replicated latent stops beating the sharded GQA cache at TP ~ {rep['tp_break_even']:.1f}")
    print(
        f"  decode arithmetic intensity {rep['decode_arithmetic_intensity']:.0f} FLOP/B per rank "
        f"(GQA: {rep['gqa_decode_arithmetic_intensity']:.0f})"
    )
    print(
        f"  prefill workspace {rep['prefill_workspace_bytes'] / 2**20:>12,.0f} MiB per device "
        f"({rep['prefill_workspace_rows']:,} rows, model dtype), shared by all {rep['num_layers']} layers "
        f"(one per layer would be {rep['prefill_workspace_bytes_if_per_layer'] / 2**30:,.1f} GiB)"
    )
    for seq in rep.get("sequences", []):
        print(f"  one {seq['context_len']:,}-token sequence: {seq['bytes_per_sequence'] / 2**20:,.1f} MiB")
    if "tokens_that_fit" in rep:
        line = (
            f"  {_size_label(args.cache_memory)} holds {rep['tokens_that_fit']:,} tokens "
            f"(GQA: {rep['gqa_tokens_that_fit']:,})"
        )
        fits = [f"{seq['sequences_that_fit']:,} sequences of {seq['context_len']:,}"
                for seq in rep.get("sequences", []) if "sequences_that_fit" in seq]
        print(", ".join([line, *fits]))
    return 0


def run_crossover(args: argparse.Namespace) -> int:
    from . import reports

    dims = load_model_dims(args.model)
    refuse_v4(dims, "crossover")
    per_rank_dims(dims, args.tp)  # checks --tp; the cost functions take the whole model and tp
    tp = args.tp
    kwargs: dict[str, Any] = {"tp": tp, "causal": args.causal}
    if args.context:
        kwargs["contexts"] = args.context
    if args.query_lens:
        kwargs["query_lens"] = args.query_lens
    rep = reports.crossover_report(dims, **kwargs)
    rep["model"] = model_label(args.model, dims)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    print(
        f"{rep['model']}, TP={tp}, {'causal' if args.causal else 'rectangular'} query block "
        f"(FLOPs per layer; absorbed wins below the crossover)"
    )
    print(
        f"  up-projection {rep['up_projection_flops_per_context_token']:,} FLOP per context token; "
        f"folds {rep['fold_flops_per_query_token']:,} per query token"
    )
    print(
        f"  core per pair: absorbed {rep['absorbed_core_flops_per_context_token']:,}, "
        f"expanded {rep['expanded_core_flops_per_context_token']:,} ({rep['core_cost_factor']:.1f}x)"
    )
    qs = [c["query_len"] for c in rep["contexts"][0]["paths"]] if rep["contexts"] else []
    print(f"  {'context':>9} {'crossover Q':>12}  " + " ".join(f"{'Q=' + str(q):>6}" for q in qs))
    for row in rep["contexts"]:
        marks = " ".join(f"{'abs' if c['cheaper'] == 'absorbed' else 'exp':>6}" for c in row["paths"])
        print(f"  {row['context_len']:>9,} {row['crossover_query_len']:>12.1f}  {marks}")
    print(
        f"  asymptotic query threshold: {rep['asymptotic_query_threshold']:.2f} "
        f"(absorbed is cheaper for Q below it as the context grows)"
    )
    return 0


#: kv-cache options a DeepSeek-V4 report does not take (the deployment sizing models V2/V3 weights)
_V4_REFUSED = (("--gpu", "gpu"), ("--gpu-memory", "gpu_memory"), ("--reserve", "reserve"),
               ("--weights-dtype", "weights_dtype"))
#: --kv-cache-dtype spellings -> V4 row layouts (vLLM's: plain bf16 rows or 584-byte fp8_ds_mla records)
_V4_CACHE_NAMES = {"auto": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16", "fp8": "fp8_ds_mla",
                   "fp8_ds_mla": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla"}


def _run_v4_kv_cache(args: argparse.Namespace, dims: V4Dims) -> int:
    """``kv-cache`` of a DeepSeek-V4 model: :func:`mla_backends.planning.v4_costs.v4_report` per ``--context``."""
    from ..planning.v4_costs import v4_report

    for flag, attr in _V4_REFUSED:
        if getattr(args, attr) is not None:
            raise ValueError(f"{flag}: got {getattr(args, attr)} for DeepSeek-V4; supported only for V2/V3-style "
                             "models (the V4 report sizes its cache pools: use --cache-memory)")
    for flag, value, off in (("--dcp", args.dcp, 1), ("--dp-attention", args.dp_attention, False)):
        if value != off:
            raise ValueError(f"{flag}: got {value} for DeepSeek-V4; supported {off} (its caches are replicated)")
    layout = _V4_CACHE_NAMES.get(str(args.kv_cache_dtype).lower())
    if layout is None:
        raise ValueError(f"--kv-cache-dtype: got {args.kv_cache_dtype!r} for DeepSeek-V4; supported "
                         f"{', '.join(_V4_CACHE_NAMES)} (plain bfloat16 rows or 584-byte fp8_ds_mla records)")
    cache_bytes = None
    if args.cache_memory is not None:
        from ..planning.deployment import parse_memory

        cache_bytes = parse_memory(args.cache_memory, "--cache-memory")
    in_flight = args.max_num_batched_tokens or reserve.DEFAULT_MAX_NUM_BATCHED_TOKENS
    reps = [v4_report(dims, kv_cache_dtype=layout, max_model_len=s or dims.max_position_embeddings,
                      in_flight_tokens=in_flight, cache_memory_bytes=cache_bytes)
            for s in (args.context or [None])]
    rep = reps[0]
    rep["model"] = model_label(args.model, dims)
    if args.context:
        rep["sequences"] = [{k: r[k] for k in ("max_model_len", "bytes_per_request", "requests_that_fit") if k in r}
                            for r in reps]
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    short = {"sliding_attention": "window-only", "compressed_sparse_attention": "CSA",
             "heavily_compressed_attention": "HCA"}
    counts = ", ".join(f"{n} {short[k]}" for k, n in rep["layers"].items() if n)
    print(f"{rep['model']}: DeepSeek-V4, {layout} rows, {rep['num_layers']} layers ({counts}), window "
          f"{rep['sliding_window']}, same on every TP rank (TP={args.tp}); per request: max_model_len "
          f"{rep['max_model_len']:,}, {rep['in_flight_tokens']:,} tokens in flight")
    print(f"  {'pool':<14} {'layer kind':<29} {'layers':>6} {'page tok':>8} {'page B':>8} {'B/token':>9} "
          f"{'B/request':>14}")
    for p in rep["pools"]:
        kept = "window" if p["window"] is not None else "sequence"
        print(f"  {p['name']:<14} {p['kind']:<29} {p['layers']:>6} {p['page_tokens']:>8} {p['page_bytes']:>8,} "
              f"{p['bytes_per_token_per_layer'] * p['layers']:>9,.1f} {p['bytes_per_request']:>14,}  ({kept})")
    print(f"  total: {rep['bytes_per_token']:,.1f} B per token, {rep['bytes_per_request_fixed'] / 2**20:,.1f} MiB "
          f"per request in windowed pools, {rep['bytes_per_request'] / 2**20:,.1f} MiB per request in all")
    for seq in rep.get("sequences", [])[1:]:
        print(f"  max_model_len {seq['max_model_len']:,}: {seq['bytes_per_request'] / 2**20:,.1f} MiB per request")
    if "requests_that_fit" in rep:
        print(f"  {_size_label(args.cache_memory)} holds {rep['requests_that_fit']:,} requests of "
              f"{rep['max_model_len']:,} tokens")
    return 0


def _run_deployment(args: argparse.Namespace, dims: Any) -> int:
    """``kv-cache --gpu/--gpu-memory``: the deployment sizing of :func:`reports.deployment_report`."""
    from ..core.gpus import gpu_spec
    from ..planning import deployment
    from . import reports
    from .args import load_model_config

    gpu = gpu_spec(args.gpu) if args.gpu is not None else None
    mem = deployment.parse_memory(args.gpu_memory) if args.gpu_memory is not None else gpu.memory_bytes  # type: ignore[union-attr]
    held = None if args.reserve is None else deployment.parse_memory(args.reserve, "--reserve", allow_zero=True)
    tokens = args.max_num_batched_tokens or reserve.DEFAULT_MAX_NUM_BATCHED_TOKENS
    config = load_model_config(args.model)  # its MLP/MoE fields checked, errors under --model
    rep = reports.deployment_report(
        dims, gpu_memory_bytes=mem, gpu_name=gpu.name if gpu else None,
        gpu_memory_utilization=args.gpu_memory_utilization, tp=args.tp, dcp=args.dcp,
        dp_attention=args.dp_attention, kv_cache_dtype=args.kv_cache_dtype, model_dtype=args.dtype,
        weights_dtype=args.weights_dtype, config=config,
        context_len=args.context[0] if args.context else None,  # the first --context
        max_num_batched_tokens=tokens, reserve_bytes=held, model_name=model_label(args.model, dims))
    if gpu is not None and args.gpu_memory is None:
        rep["gpu_memory_source"] = gpu.memory_source
        rep["gpu_memory_confirmed"] = gpu.memory_confirmed
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    _print_deployment(rep, mem)
    return 0


def _print_deployment(rep: dict[str, Any], mem: int) -> None:
    mode = "DP-attention" if rep["dp_attention"] else f"DCP={rep['dcp']}"
    print(f"{rep['model']} on {rep['tp']} x {rep['gpu'] or 'GPU'} ({mem / 1e9:,.1f} GB = {mem / 2**30:,.1f} GiB, "
          f"utilization {rep['gpu_memory_utilization']:g}), TP={rep['tp']}, {mode}, {rep['kv_cache_dtype']} cache")
    if rep.get("gpu_memory_confirmed") is False:
        print(f"  note: this GPU's memory is not confirmed ({rep['gpu_memory_source']}); pass --gpu-memory")
    print(f"  usable            {rep['usable_bytes'] / 1e9:>10,.2f} GB per rank (memory x utilization)")
    print(f"  weights           {rep['weights_bytes_per_rank'] / 1e9:>10,.2f} GB per rank ({rep['weights_dtype']})")
    print(f"  prefill workspace {rep['workspace_bytes'] / 1e9:>10,.2f} GB ({rep['workspace_rows']:,} rows)")
    terms = rep["reserve_terms"]
    if rep["reserve_source"] == "--reserve":
        print(f"  reserve           {rep['reserve_bytes'] / 1e9:>10,.2f} GB per rank (--reserve)")
    else:
        print(f"  reserve           {rep['reserve_bytes'] / 1e9:>10,.2f} GB per rank held back (modelled; "
              "--reserve overrides)")
        print(f"    activations     {terms['activations'] / 1e9:>10,.2f} GB "
              f"({rep['max_num_batched_tokens']:,} batched tokens, {rep['max_num_seqs']} sequences' logits)")
        print(f"    MoE dispatch    {terms['moe_dispatch'] / 1e9:>10,.2f} GB (per-expert buffers of those tokens)")
        print(f"    CUDA-graph pool {terms['cuda_graph_pool'] / 1e9:>10,.2f} GB (decode batches up to "
              f"{reserve.CUDA_GRAPH_MAX_BATCH})")
        print(f"    NCCL            {terms['nccl'] / 1e9:>10,.2f} GB ({rep['nccl_communicators']} "
              f"communicator{'s' if rep['nccl_communicators'] != 1 else ''})")
    print(f"  latent cache      {rep['cache_bytes_per_rank'] / 1e9:>10,.2f} GB per rank, "
          f"{rep['cache_bytes_per_token']:,} B per token")
    print(f"  tokens per rank {rep['tokens_per_rank']:,}; per DCP group {rep['tokens_per_dcp_group']:,}; "
          f"deployment (cluster_tokens) {rep['cluster_tokens']:,}")
    comm = rep["dcp_comm_bytes_per_token_per_layer"]
    if rep["dcp"] > 1:
        print(f"  DCP decode, B sent per rank per token per layer: query all-gather "
              f"{comm['decode_query_all_gather']:,}, LSE all-gather {comm['decode_lse_all_gather']:,}, "
              f"output reduce-scatter {comm['decode_output_reduce_scatter']:,}")
        print(f"  DCP prefill: context all-gather {comm['prefill_context_all_gather_per_context_token']:,} B "
              "per context token per layer")
    print(f"  TP all-reduce (apart): {comm['tp_all_reduce']:,} B per token per layer")
    if "context_len" in rep:
        print(f"  sequences of {rep['context_len']:,} per DCP group: {rep['sequences_per_dcp_group']:,}")
    for w in rep["warnings"]:
        print(f"  warning: {w}")
