"""vLLM's own sizing of DeepSeek-V4's cache pools, from its code (run in ``.venv-vllm``; no model, no GPU).

For each pool of each layer kind, vLLM 0.32's V4 modules build their cache spec (``DeepseekV4SWACache``,
``DeepseekV4Attention.get_kv_cache_spec``, ``CompressorStateCache``, ``DeepseekV4IndexerCache``) inside a bare
``VllmConfig``; this script asks each spec for ``page_size_bytes`` and ``max_memory_usage_bytes`` (the
per-request bound vLLM's admission check adds up) and prints, or writes, one JSON document::

    .venv-vllm/bin/python benchmarks/v4_vllm_sizing.py --json benchmarks/results/v4-vllm-sizing.json

``tests/test_v4_sizing.py`` compares ``mla_backends.planning.v4_costs`` with the recorded file;
``tests/vllm_engine/test_v4_vllm_sizing.py`` with a live run of :func:`vllm_sizing`.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any

#: the configurations recorded: V4-Flash's attention (transformers' DeepseekV4Config defaults)
CASES = ({"cache": "bfloat16", "max_model_len": 65536, "in_flight_tokens": 8192, "window": 128, "head_dim": 512,
          "index_head_dim": 128},
         {"cache": "fp8_ds_mla", "max_model_len": 65536, "in_flight_tokens": 8192, "window": 128, "head_dim": 512,
          "index_head_dim": 128},
         {"cache": "bfloat16", "max_model_len": 1048576, "in_flight_tokens": 16384, "window": 128, "head_dim": 512,
          "index_head_dim": 128})
RATIOS = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def vllm_specs(case: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """``{(layer kind, pool): vLLM's KVCacheSpec}`` for one case, built by vLLM's own V4 modules."""
    import torch
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    fp8 = case["cache"] == "fp8_ds_mla"
    cfg = VllmConfig()
    cache_config = CacheConfig(block_size=256, cache_dtype="fp8" if fp8 else "auto")
    cfg.cache_config = cache_config
    kv_dtype, torch_dtype = _resolve_dsv4_kv_cache_dtype(fp8, cache_config.cache_dtype, cache_config)
    D, Di = case["head_dim"], case["index_head_dim"]
    specs: dict[tuple[str, str], Any] = {}
    with set_current_vllm_config(cfg):
        for n, kind in enumerate(("sliding_attention", *RATIOS)):
            swa = DeepseekV4SWACache(head_dim=D, window_size=case["window"], dtype=torch_dtype, prefix=f"{n}.swa",
                                     cache_config=cache_config)
            specs[(kind, "window")] = swa.get_kv_cache_spec(cfg)
            if kind == "sliding_attention":
                continue
            r = RATIOS[kind]
            coff = 2 if r == 4 else 1
            attn = SimpleNamespace(compress_ratio=r, kv_cache_dtype=kv_dtype, head_dim=D,
                                   kv_cache_torch_dtype=torch_dtype)
            specs[(kind, "compressed")] = DeepseekV4Attention.get_kv_cache_spec(attn, cfg)
            specs[(kind, "state")] = CompressorStateCache(state_dim=2 * coff * D, dtype=torch.float32,
                                                          compress_ratio=r, prefix=f"{n}.state").get_kv_cache_spec(cfg)
            if r == 4:
                keys = DeepseekV4IndexerCache(head_dim=Di + Di // 128 * 4, dtype=torch.uint8, prefix=f"{n}.ik",
                                              cache_config=cache_config, compress_ratio=r)
                specs[(kind, "indexer_keys")] = keys.get_kv_cache_spec(cfg)
                specs[(kind, "indexer_state")] = CompressorStateCache(
                    state_dim=2 * 2 * Di, dtype=torch.float32, compress_ratio=r,
                    prefix=f"{n}.istate").get_kv_cache_spec(cfg)
    return specs


def vllm_sizing(case: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (layer kind, pool): vLLM's page tokens, page bytes and per-request bytes for ``case``."""
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=case["max_model_len"]),
                             parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             max_in_flight_tokens=case["in_flight_tokens"])
    rows = []
    for (kind, pool), spec in vllm_specs(case).items():
        rows.append({"kind": kind, "pool": pool, "spec": type(spec).__name__, "page_tokens": spec.block_size,
                     "page_bytes": spec.page_size_bytes,
                     "bytes_per_request": spec.max_memory_usage_bytes(config)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, metavar="FILE", help="write the document here (default: print)")
    args = parser.parse_args()
    import vllm

    doc = {"vllm": vllm.__version__, "command": "python benchmarks/v4_vllm_sizing.py --json FILE",
           "cases": [{**case, "pools": vllm_sizing(case)} for case in CASES]}
    text = json.dumps(doc, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
