"""The reports ``mla-backends kv-cache`` and ``mla-backends crossover`` print, as JSON-ready dicts.

Built from the pure cost model in :mod:`mla_backends.planning.costs`; this module only gathers its figures into the
shape the command line prints (and ``--json`` writes). See ``docs/cost-model.md`` for the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

from ..core.dims import MLADims
from ..core.dtypes import parse_model_dtype, resolve_kv_cache_dtype
from ..core.validation import require_int
from ..layer.workspace import MAX_WORKSPACE_ROWS, workspace_widths
from ..planning import costs, deployment, reserve

__all__ = ["kv_cache_report", "crossover_report", "deployment_report", "usable_bytes", "prefill_workspace_figures",
           "DEFAULT_QUERY_LENS", "DEFAULT_CONTEXTS"]


def kv_cache_report(
    dims: MLADims,
    *,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tp: int = 1,
    context_len: int | None = None,
    gpu_memory_gib: float | None = None,
    gqa: costs.GQAConfig = costs.LLAMA3_70B,
    model_name: str | None = None,
    cache_memory_bytes: int | None = None,
) -> dict[str, Any]:
    """Everything ``mla-backends kv-cache`` prints, as a JSON-ready dict (bytes are per rank unless noted).

    ``gpu_memory_gib`` (GiB, read as the decimal it prints as) or ``cache_memory_bytes`` (what
    ``--cache-memory`` parses to) is the memory one rank gives to the KV cache; ``tokens_that_fit`` counts
    latent plus indexer bytes. ``context_len`` adds per-sequence bytes and how many such sequences fit.
    ``kv_cache_dtype`` in the result is the stored dtype (``auto`` resolved against ``model_dtype``).
    ``model_name`` labels the report (default ``dims.name``: ``deepseek-r1`` has V3's dims and keeps its own
    name).
    """
    b = costs.element_bytes(kv_cache_dtype, model_dtype)
    per_layer = costs.latent_bytes_per_token_per_layer(dims, b)  # checks dims
    expanded = costs.expanded_bytes_per_token(dims, b, tp=tp)  # checks tp
    d = dims
    cell = costs.cache_bytes_per_token(d, b)
    rep: dict[str, Any] = {
        "model": model_name or d.name,
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
    if gpu_memory_gib is not None and cache_memory_bytes is not None:
        raise ValueError(f"cache_memory_bytes: got {cache_memory_bytes!r} with gpu_memory_gib "
                         f"{gpu_memory_gib!r}; supported one of the two")
    if gpu_memory_gib is not None:
        if (
            isinstance(gpu_memory_gib, bool)
            or not isinstance(gpu_memory_gib, (int, float))
            or not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib))
        ):
            raise ValueError(f"gpu_memory_gib: got {gpu_memory_gib!r}; supported a positive number of GiB")
        cache_memory_bytes = deployment.parse_memory(gpu_memory_gib, "gpu_memory_gib")  # exact, as printed
    if cache_memory_bytes is not None:
        mem = require_int("cache_memory_bytes", cache_memory_bytes, minimum=1)
        if mem > deployment.MAX_SIZE_BYTES:
            raise ValueError(f"cache_memory_bytes: got {mem:,}; supported at most {deployment.MAX_SIZE_BYTES:,} "
                             "(2**53, 8 PiB)")
        rep["gpu_memory_bytes"] = mem
        rep["tokens_that_fit"] = mem // cell
        rep["gqa_tokens_that_fit"] = mem // rep["gqa_bytes_per_token"]
        if context_len is not None:
            rep["sequences_that_fit"] = mem // rep["bytes_per_sequence"]
    return rep


def prefill_workspace_figures(dims: MLADims, model_dtype: str = "bfloat16", tp: int = 1,
                              rows: int = MAX_WORKSPACE_ROWS) -> dict[str, int]:
    """The prefill workspace beside the cache, as ``forward_mha`` allocates it
    (:func:`mla_backends.layer.workspace.workspace_widths`): ``rows`` gathered latent rows plus their per-head K-nope
    and V (model dtype, this rank's ``total_num_heads // tp`` heads), the one buffer every layer of a device
    shares (:mod:`mla_backends.layer.workspace`), and what one per layer would take. Bytes."""
    mb = costs.element_bytes("auto", model_dtype)
    require_int("tp", tp, minimum=1)
    require_int("rows", rows, minimum=1)
    widths = workspace_widths(dims.kv_lora_rank, dims.qk_rope_head_dim, dims.total_num_heads // tp,
                              dims.qk_nope_head_dim, dims.v_head_dim)
    per_row = sum(widths) * mb
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


def usable_bytes(gpu_memory_bytes: int, gpu_memory_utilization: float) -> int:
    """``gpu_memory_bytes x gpu_memory_utilization`` rounded down to a whole byte, the utilization taken as the
    decimal it prints as (``0.9`` is 9/10 exactly, not the binary float): the JSON's ``usable_bytes``."""
    return math.floor(Fraction(gpu_memory_bytes) * Fraction(repr(float(gpu_memory_utilization))))


def _gb(nbytes: int, digits: int = 2) -> str:
    """``nbytes`` in GB (10**9) with ``digits`` decimals, rounded half up, in integer arithmetic (any size)."""
    whole, frac = divmod((nbytes * 10**digits + 10**9 // 2) // 10**9, 10**digits)
    return f"{whole:,}" + (f".{frac:0{digits}d}" if digits else "")


def _largest_fitting(limit: int, cost: Callable[[int], int], below: int) -> int:
    """The largest ``t`` in ``[1, below)`` with ``cost(t) < limit`` (``cost`` non-decreasing), else 0."""
    lo, hi = 0, below  # cost(lo) fits (or lo == 0), cost(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) < limit else (lo, mid)
    return lo


def _does_not_fit(model: str, *, tp: int, gpu: str, gpu_memory_bytes: int, usable: int, weights: int, wdt: str,
                  workspace: int, held: int, reserve_bytes: int | None, tokens: int,
                  held_at: Callable[[int], int]) -> str:
    """The message for a deployment whose weights, workspace and reserve leave no room for a cache, naming the
    flag whose value cannot fit: ``--tp`` when the weights and workspace alone fill the GPU, ``--reserve`` when
    its figure is what overflows, ``--max-num-batched-tokens`` when the reserve modelled for it does (with the
    largest budget that fits), ``--tp`` again when even one batched token's reserve does not fit."""
    fixed = f"{model}'s weights ({_gb(weights, 1)} GB per rank, {wdt}) and the prefill workspace ({_gb(workspace)} GB)"
    room = usable - weights - workspace  # what the reserve and the cache share
    if room <= 0:
        return (f"--tp: got {tp}; {fixed} do not fit {gpu}, before any reserve; supported a larger --tp, a "
                "smaller --weights-dtype, or a larger GPU (--gpu, --gpu-memory, --gpu-memory-utilization)")
    after = f"{gpu} has {_gb(room)} GB ({room:,} B) left after {fixed}, for the reserve and the cache together"
    if reserve_bytes is not None:
        whole = (f", more than the GPU's whole memory ({_gb(gpu_memory_bytes)} GB)"
                 if reserve_bytes >= gpu_memory_bytes else "")
        return (f"--reserve: got {_gb(reserve_bytes)} GB ({reserve_bytes:,} B) per rank{whole}; {after}; "
                f"supported a reserve of less than {room:,} bytes")
    fits = _largest_fitting(room, held_at, tokens)
    if fits:
        return (f"--max-num-batched-tokens: got {tokens:,}; the reserve modelled for that many tokens a step "
                f"({_gb(held)} GB per rank) does not fit: {after}; supported at most {fits:,} tokens (or --reserve "
                "with the figure an engine measured)")
    return (f"--tp: got {tp}; {fixed} and the reserve, even as modelled for one batched token "
            f"({_gb(held_at(1))} GB), do not fit {gpu}; supported a larger --tp, a smaller --weights-dtype, "
            "--reserve with the figure an engine measured, or a larger GPU")


def deployment_report(
    dims: MLADims,
    *,
    gpu_memory_bytes: int,
    gpu_name: str | None = None,
    gpu_memory_utilization: float = 0.9,
    tp: int = 1,
    dcp: int = 1,
    dp_attention: bool = False,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    weights_dtype: str | None = None,
    config: dict[str, Any] | None = None,
    context_len: int | None = None,
    max_num_batched_tokens: int = reserve.DEFAULT_MAX_NUM_BATCHED_TOKENS,
    reserve_bytes: int | None = None,
    model_name: str | None = None,
) -> dict[str, Any]:
    """What one rank of a deployment of ``tp`` GPUs holds: weights, the prefill workspace, the reserve (what
    an engine holds back: :mod:`mla_backends.planning.reserve`, or ``reserve_bytes`` given) and the latent cache in what
    is left of ``gpu_memory_bytes * gpu_memory_utilization``; tokens per rank and ``cluster_tokens``
    (``tokens per rank x dcp x data-parallel groups``: DP-attention makes every rank a group); the DCP
    communication per token per layer. Exact in whole bytes: ``usable_bytes`` (:func:`usable_bytes`) equals
    ``weights_bytes_per_rank + workspace_bytes + reserve_bytes + cache_bytes_per_rank``, and the
    ``reserve_terms`` sum to ``reserve_bytes``. ``model_name`` labels the report (default ``dims.name``).
    ValueError when the weights, workspace and reserve do not fit."""
    if (isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float))
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"--gpu-memory-utilization: got {gpu_memory_utilization!r}; supported (0, 1]")
    require_int("--gpu-memory", gpu_memory_bytes, minimum=1)
    if gpu_memory_bytes > deployment.MAX_SIZE_BYTES:
        raise ValueError(f"--gpu-memory: got {gpu_memory_bytes:,} bytes; supported at most "
                         f"{deployment.MAX_SIZE_BYTES:,} (2**53, 8 PiB)")
    require_int("tp", tp, minimum=1)
    require_int("dcp", dcp, minimum=1)
    if tp % dcp:
        raise ValueError(f"--dcp: got {dcp}; supported a divisor of --tp {tp}")
    if dp_attention and dcp > 1:
        raise ValueError(f"--dcp: got {dcp} with --dp-attention; supported 1 (DP-attention runs attention at "
                         "TP=1 on every rank, so there is no TP group to split the cache across)")
    if reserve_bytes is not None:
        require_int("--reserve", reserve_bytes, minimum=0)
        if reserve_bytes > deployment.MAX_SIZE_BYTES:
            raise ValueError(f"--reserve: got {reserve_bytes:,} bytes; supported at most "
                             f"{deployment.MAX_SIZE_BYTES:,} (2**53, 8 PiB)")
    attn_tp = 1 if dp_attention else tp
    b = costs.element_bytes(kv_cache_dtype, model_dtype)
    mb = costs.element_bytes("auto", model_dtype)
    wdt = weights_dtype or deployment.PUBLISHED_WEIGHTS_DTYPE.get(dims.name, "bfloat16")
    shape = deployment.model_shape(dims, config)
    weights = deployment.weight_bytes_per_rank(dims, shape, weights_dtype=wdt, tp=tp, dp_attention=dp_attention)
    rows = costs.workspace_rows(dims.max_position_embeddings, 256, 16)
    workspace = prefill_workspace_figures(dims, model_dtype, attn_tp, rows=rows)["prefill_workspace_bytes"]
    modelled = reserve.reserve_terms(dims, shape, tp=tp, dcp=dcp, dp_attention=dp_attention, model_bytes=mb,
                                     max_num_batched_tokens=max_num_batched_tokens)
    terms = modelled if reserve_bytes is None else {"reserve_override": reserve_bytes}
    held = sum(terms.values())
    usable = usable_bytes(gpu_memory_bytes, gpu_memory_utilization)
    left = usable - weights - workspace - held
    if left <= 0:
        def held_at(tokens: int) -> int:  # the modelled reserve at another token budget
            return sum(reserve.reserve_terms(dims, shape, tp=tp, dcp=dcp, dp_attention=dp_attention, model_bytes=mb,
                                             max_num_batched_tokens=tokens).values())

        raise ValueError(_does_not_fit(
            dims.name, tp=tp, gpu=f"{gpu_name or 'the GPU'} ({_gb(gpu_memory_bytes, 1)} GB x "
                                  f"{gpu_memory_utilization:g})",
            gpu_memory_bytes=gpu_memory_bytes, usable=usable, weights=weights, wdt=wdt, workspace=workspace,
            held=held, reserve_bytes=reserve_bytes, tokens=max_num_batched_tokens, held_at=held_at))
    cell = costs.cache_bytes_per_token(dims, b)  # a rank stores 1/dcp of each token: rows, not tokens
    per_rank = left // cell
    dp_groups = tp if dp_attention else 1
    rep: dict[str, Any] = {
        "model": model_name or dims.name, "gpu": gpu_name, "gpu_memory_bytes": gpu_memory_bytes,
        "gpu_memory_utilization": gpu_memory_utilization, "usable_bytes": usable,
        "usable_rule": "floor(gpu_memory_bytes x gpu_memory_utilization), the utilization as a decimal; "
                       "usable_bytes = weights_bytes_per_rank + workspace_bytes + reserve_bytes + "
                       "cache_bytes_per_rank",
        "tp": tp, "dcp": dcp, "dp_attention": dp_attention,
        "kv_cache_dtype": resolve_kv_cache_dtype(kv_cache_dtype, parse_model_dtype(model_dtype)),
        "weights_dtype": wdt, "weights_rule": deployment.WEIGHTS_RULE, "weights_bytes_per_rank": weights,
        "workspace_rows": rows, "workspace_bytes": workspace,
        "reserve_bytes": held, "reserve_terms": terms,
        "reserve_source": "model" if reserve_bytes is None else "--reserve",
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": reserve.DEFAULT_MAX_NUM_SEQS,
        "nccl_communicators": reserve.nccl_communicators(tp, dcp),
        "cache_bytes_per_rank": left, "cache_bytes_per_token": cell, "tokens_per_rank": per_rank,
        "tokens_per_dcp_group": per_rank * dcp, "data_parallel_groups": dp_groups,
        "cluster_tokens": per_rank * dcp * dp_groups,
        "max_position_embeddings": dims.max_position_embeddings,
        "dcp_comm_bytes_per_token_per_layer": deployment.dcp_comm_bytes_per_token(
            dims, tp=attn_tp, dcp=dcp, dtype_bytes=mb, cache_bytes=b),
        "warnings": [],
    }
    if reserve_bytes is not None:
        rep["reserve_modelled_terms"] = modelled  # what the model would hold back, for comparison
    if context_len is not None:
        s = require_int("context_len", context_len, minimum=1)
        rep["context_len"] = s
        rep["sequences_per_dcp_group"] = per_rank * dcp // s
        if s > dims.max_position_embeddings:
            rep["warnings"].append(f"context {s:,} is past max_position_embeddings "
                                   f"{dims.max_position_embeddings:,}: the model was not trained that long")
    return rep
