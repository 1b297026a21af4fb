"""The reports ``mla-backends kv-cache`` and ``mla-backends crossover`` print, as JSON-ready dicts.

Built from the pure cost model in :mod:`mla_backends.costs`; this module only gathers its figures into the
shape the command line prints (and ``--json`` writes). See ``docs/cost-model.md`` for the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from .. import costs
from ..dims import MLADims
from ..dtypes import parse_model_dtype, resolve_kv_cache_dtype
from ..prefill import MAX_WORKSPACE_ROWS
from ..validation import require_int

__all__ = ["kv_cache_report", "crossover_report", "prefill_workspace_figures", "DEFAULT_QUERY_LENS",
           "DEFAULT_CONTEXTS"]


def kv_cache_report(
    dims: MLADims,
    *,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tp: int = 1,
    context_len: int | None = None,
    gpu_memory_gib: float | None = None,
    gqa: costs.GQAConfig = costs.LLAMA3_70B,
) -> dict[str, Any]:
    """Everything ``mla-backends kv-cache`` prints, as a JSON-ready dict (bytes are per rank unless noted).

    ``gpu_memory_gib`` is the memory one rank gives to the KV cache; ``tokens_that_fit`` counts latent plus
    indexer bytes. ``context_len`` adds per-sequence bytes and how many such sequences fit. ``kv_cache_dtype``
    in the result is the stored dtype (``auto`` resolved against ``model_dtype``).
    """
    b = costs.element_bytes(kv_cache_dtype, model_dtype)
    per_layer = costs.latent_bytes_per_token_per_layer(dims, b)  # checks dims
    expanded = costs.expanded_bytes_per_token(dims, b, tp=tp)  # checks tp
    d = dims
    cell = costs.cache_bytes_per_token(d, b)
    rep: dict[str, Any] = {
        "model": d.name,
        "kv_cache_dtype": resolve_kv_cache_dtype(kv_cache_dtype, parse_model_dtype(model_dtype)),
        "element_bytes": b,
        "num_layers": d.num_layers,
        "tp": tp,
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": costs.latent_bytes_per_token(d, b),
        "expanded_bytes_per_token": expanded,
        "expanded_ratio": costs.expanded_ratio(d, tp),
        "indexer_bytes_per_token_per_layer": costs.indexer_bytes_per_token_per_layer(d),
        "indexer_bytes_per_token": costs.indexer_bytes_per_token(d),
        "indexing_layers": costs.indexing_layers(d),
        "indexer_overhead": costs.indexer_overhead(d, b),
        "total_bytes_per_token": cell,
        "cluster_bytes_per_token": costs.mla_cluster_bytes_per_token(d, b, tp),
        "gqa_model": gqa.name,
        "gqa_bytes_per_token": costs.gqa_bytes_per_token(gqa, b, tp),
        "gqa_cluster_bytes_per_token": costs.gqa_cluster_bytes_per_token(gqa, b, tp),
        "tp_break_even": costs.tp_break_even(d, gqa, b),
        "decode_arithmetic_intensity": costs.decode_arithmetic_intensity(d, b, tp),
        "gqa_decode_arithmetic_intensity": costs.gqa_decode_arithmetic_intensity(gqa, b),
        **prefill_workspace_figures(d, model_dtype, tp),
    }
    if context_len is not None:
        s = require_int("context_len", context_len, minimum=1)
        rep["context_len"] = s
        rep["bytes_per_sequence"] = s * cell
    if gpu_memory_gib is not None:
        if (
            isinstance(gpu_memory_gib, bool)
            or not isinstance(gpu_memory_gib, (int, float))
            or not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib))
        ):
            raise ValueError(f"gpu_memory_gib: got {gpu_memory_gib!r}; supported a positive number of GiB")
        mem = int(gpu_memory_gib * costs.GiB)
        rep["gpu_memory_bytes"] = mem
        rep["tokens_that_fit"] = mem // cell
        rep["gqa_tokens_that_fit"] = mem // rep["gqa_bytes_per_token"]
        if context_len is not None:
            rep["sequences_that_fit"] = mem // rep["bytes_per_sequence"]
    return rep


def prefill_workspace_figures(dims: MLADims, model_dtype: str = "bfloat16", tp: int = 1,
                              rows: int = MAX_WORKSPACE_ROWS) -> dict[str, int]:
    """The prefill workspace beside the cache: ``rows`` gathered latent rows plus their per-head K-nope and V
    (model dtype, this rank's heads), the one buffer every layer of a device shares
    (:mod:`mla_backends.workspace`), and what one per layer would take."""
    mb = costs.element_bytes("auto", model_dtype)
    heads = dims.total_num_heads // tp
    per_row = (dims.kv_lora_rank + dims.qk_rope_head_dim + heads * (dims.qk_nope_head_dim + dims.v_head_dim)) * mb
    return {
        "prefill_workspace_rows": rows,
        "prefill_workspace_bytes": rows * per_row,
        "prefill_workspace_bytes_if_per_layer": rows * per_row * dims.num_layers,
    }


DEFAULT_QUERY_LENS: tuple[int, ...] = (1, 16, 64, 128, 171, 256, 1024)
DEFAULT_CONTEXTS: tuple[int, ...] = (512, 4096, 32768, 131072)


def crossover_report(
    dims: MLADims,
    *,
    query_lens: Sequence[int] = DEFAULT_QUERY_LENS,
    contexts: Iterable[int] = DEFAULT_CONTEXTS,
    tp: int = 1,
    causal: bool = False,
) -> dict[str, Any]:
    """Everything ``mla-backends crossover`` prints: per context, each query length's FLOPs on both paths,
    the cheaper one, and the crossover query length; plus the asymptotic threshold."""
    threshold = costs.asymptotic_query_threshold(dims)  # checks dims
    d = dims
    qs = [require_int("query_len", q, minimum=1) for q in query_lens]
    rows = []
    for s in contexts:
        require_int("context_len", s, minimum=1)
        cells = []
        for q in qs:
            cells.append(
                {
                    "query_len": q,
                    "absorbed_flops": costs.absorbed_path_flops(d, q, s, tp=tp, causal=causal),
                    "expanded_flops": costs.expanded_path_flops(d, q, s, tp=tp, causal=causal),
                    "cheaper": costs.cheaper_path(d, q, s, tp=tp, causal=causal),
                }
            )
        rows.append(
            {
                "context_len": s,
                "crossover_query_len": costs.crossover_query_len(d, s, causal=causal),
                "paths": cells,
            }
        )
    return {
        "model": d.name,
        "tp": tp,
        "causal": causal,
        "up_projection_flops_per_context_token": costs.up_projection_flops_per_context_token(d, tp),
        "fold_flops_per_query_token": costs.fold_flops_per_query_token(d, tp),
        "absorbed_core_flops_per_context_token": costs.absorbed_core_flops_per_context_token(d, tp),
        "expanded_core_flops_per_context_token": costs.expanded_core_flops_per_context_token(d, tp),
        "core_cost_factor": costs.core_cost_factor(d),
        "asymptotic_query_threshold": threshold,
        "min_context_for_single_query_absorption": costs.min_context_for_absorption(d, 1),
        "contexts": rows,
    }
