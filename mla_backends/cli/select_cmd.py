"""``mla-backends select``: which backend this (or a simulated) machine gets for a model, and why.

Exit code 0 when a backend was chosen, 2 when none fits (or a forced one does not).
"""

from __future__ import annotations

import argparse
import json

from .args import load_model_dims, per_rank_dims


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("select", help="choose and explain the backend for a model on this or a simulated GPU",
                       description="Run select_backend() for a model and print every candidate of the ladder "
                                   "with its verdict and reasons (the same as Selection.explain()).",
                       epilog="examples: mla-backends select --device sm100 --kv-cache-dtype fp8 --block-size 16; "
                              "mla-backends select --device h200 --backend flashinfer --json")
    p.add_argument("--model", default="deepseek-v3",
                   help="preset name (deepseek-v3, deepseek-v2-lite, kimi-k2, ...) or a config.json path "
                        "(default deepseek-v3)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: heads per rank = heads / tp (default 1)")
    p.add_argument("--device", default="auto",
                   help="auto (GPU 0 via NVML; the default), cuda:N (the CPU when no GPU is found), cpu, "
                        "a simulated sm80/sm90/sm100/..., or a simulated product from the GPU table (a100, "
                        "h100, h200, b200, gb200, b300, rtx5090, rtx-pro-6000, l40s, ...; docs/gpus.md)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype: bfloat16, float16, float32 (default bfloat16)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), bfloat16, float16, float32, fp8 (= fp8_e4m3), fp8_e5m2 "
                        "(default auto)")
    p.add_argument("--block-size", type=int, default=None, help="page size in tokens (default: preferred)")
    p.add_argument("--sparse", action="store_true", help="top-k sparse attention (DeepSeek-V3.2)")
    p.add_argument("--max-query-len", type=int, default=1,
                   help="query tokens per request sent to the kernel (default 1)")
    p.add_argument("--uniform-query-len", action=argparse.BooleanOptionalAction, default=True,
                   help="every request sends the same number of query tokens (default: yes; "
                        "--no-uniform-query-len for varying lengths)")
    p.add_argument("--need-lse", action="store_true",
                   help="the caller needs the log-sum-exp of every query row (e.g. to merge partial results)")
    p.add_argument("--backend", default=None,
                   help="force a backend (beats MLA_BACKEND): a registered name, vLLM's or SGLang's name for "
                        "it (CUTLASS_MLA, trtllm_mla, ...) or package.module:Class (an uninstalled plugin); "
                        "'auto' = no override from this flag (MLA_BACKEND may still force one)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of the text report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from selector.select import SelectionError, select_backend

    model = load_model_dims(args.model)
    dims = per_rank_dims(model, args.tp)
    # what the JSON document says about the request beyond Selection.to_dict(): the model and TP
    head = {"model": model.name, "tp": args.tp, "num_heads_per_rank": dims.num_heads}
    try:
        sel = select_backend(dims, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                             block_size=args.block_size, sparse=args.sparse, max_query_len=args.max_query_len,
                             uniform_query_len=args.uniform_query_len, need_lse=args.need_lse,
                             device=args.device, backend=args.backend)
    except SelectionError as err:
        print(json.dumps({**head, **err.to_dict()}, indent=2) if args.json else str(err))
        return 2
    print(json.dumps({**head, **sel.to_dict()}, indent=2) if args.json else sel.explain())
    return 0
