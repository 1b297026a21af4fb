"""vLLM's own DeepSeek-V4 pool sizing, computed live from its spec classes (``benchmarks/v4_vllm_sizing.py``),
against ``mla_backends.planning.v4_costs`` and against the figures recorded in the repository."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_sizes_every_v4_pool_as_the_cost_model_does():
    from mla_backends.core.v4dims import SLIDING, V4Dims
    from mla_backends.planning.v4_costs import v4_pools

    script = load_benchmark("v4_vllm_sizing")
    recorded = json.loads((ROOT / "benchmarks" / "results" / "v4-vllm-sizing.json").read_text())
    flash = V4Dims.deepseek_v4_flash()
    dims = dataclasses.replace(flash, layer_types=(SLIDING,) + flash.layer_types[1:])
    for case, saved in zip(script.CASES, recorded["cases"], strict=True):
        live = script.vllm_sizing(case)
        assert live == saved["pools"]  # the recorded file is what this vLLM computes
        ours = {(p.kind, p.name): p for p in v4_pools(dims, kv_cache_dtype=case["cache"])}
        for row in live:
            p = ours[(row["kind"], row["pool"])]
            assert (p.page_tokens, p.page_bytes,
                    p.bytes_per_request(case["max_model_len"], case["in_flight_tokens"])) == (
                row["page_tokens"], row["page_bytes"], row["bytes_per_request"]), row
