"""The MLA cost model: bytes, FLOPs and thresholds derived from the shapes alone (nothing here is measured).

Every function is a pure function of an :class:`~mla_backends.core.dims.MLADims`, an element size in bytes, a
layer count and a tensor-parallel size. The dims describe the *whole* model (``dims.total_num_heads`` heads);
``tp`` picks the per-rank view, where the heads split across ranks but the latent cache is replicated.

Notation (DeepSeek-V3 values): ``h`` heads (128), ``r`` = ``kv_lora_rank`` (512), ``d_nope`` (128), ``d_rope``
(64), ``d_v`` (128), ``L`` layers (61), ``b`` bytes per cached element (2 for bf16). Counts are per layer and
per token unless a name says otherwise; a multiply-add is 2 FLOPs. ``docs/cost-model.md`` walks through each
formula with its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dims import MLADims
from ..core.dtypes import canonical_kv_cache_dtype, kv_cache_torch_dtype, parse_model_dtype
from ..core.validation import require_int
from ..layer.workspace import MAX_WORKSPACE_ROWS, default_workspace_rows

__all__ = [
    "GQAConfig", "LLAMA3_70B", "INDEXER_QUANT_BLOCK", "WORKSPACE_MAX_ROWS",
    "element_bytes", "latent_bytes_per_token_per_layer", "latent_bytes_per_token",
    "expanded_bytes_per_token_per_layer", "expanded_bytes_per_token", "expanded_ratio",
    "uncached_kv_bytes_per_token_per_layer", "gqa_bytes_per_token", "gqa_cluster_bytes_per_token",
    "cache_bytes_per_token", "mla_cluster_bytes_per_token", "tp_break_even",
    "up_projection_flops_per_context_token", "fold_flops_per_query_token",
    "absorbed_core_flops_per_context_token", "expanded_core_flops_per_context_token", "core_cost_factor",
    "decode_arithmetic_intensity", "gqa_decode_arithmetic_intensity", "attention_pairs", "absorbed_path_flops",
    "expanded_path_flops", "cheaper_path", "crossover_query_len", "asymptotic_query_threshold",
    "min_context_for_absorption", "workspace_rows", "workspace_latent_bytes",
    "workspace_upprojected_bytes", "indexer_bytes_per_token_per_layer", "indexing_layers",
    "indexer_bytes_per_token", "indexer_overhead", "KiB", "MiB", "GiB",
]

KiB, MiB, GiB = 1024, 1024**2, 1024**3

#: DeepSeek-V3.2 indexer keys are fp8 with one float32 scale per this many values (both engines use 128)
INDEXER_QUANT_BLOCK = 128
#: vLLM's cap on the chunked-prefill workspace, in cache rows ("limiting it to 64k tokens"): prefill's own cap
WORKSPACE_MAX_ROWS = MAX_WORKSPACE_ROWS


# ---- reference configurations (data) ---------------------------------------------------------------------
@dataclass(frozen=True)
class GQAConfig:
    """A grouped-query-attention model used as the comparison point: K and V cached per KV head."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int


#: Llama-3-70B: 80 layers, 64 query heads sharing 8 KV heads (GQA-8), head width 128
LLAMA3_70B = GQAConfig(name="llama-3-70b", num_layers=80, num_attention_heads=64, num_kv_heads=8, head_dim=128)


# ---- argument checks -------------------------------------------------------------------------------------
def _dims(dims: Any) -> MLADims:
    if not isinstance(dims, MLADims):
        raise TypeError(f"dims: got {type(dims).__name__}; supported an MLADims")
    return dims


def _pos_int(name: str, v: Any, *, allow_zero: bool = False) -> int:
    return require_int(name, v, minimum=0 if allow_zero else 1)


def _heads_per_rank(dims: MLADims, tp: int) -> int:
    """Heads one rank runs: whole-model dims split ``tp`` ways; per-rank dims (``tp_size > 1``) keep theirs."""
    _pos_int("tp", tp)
    if dims.tp_size > 1:
        if tp not in (1, dims.tp_size):
            raise ValueError(f"tp: got {tp} for per-rank dims (tp_size {dims.tp_size}); supported 1 or "
                             f"{dims.tp_size} (the dims' own split), or the whole model's dims")
        return dims.num_heads
    if dims.num_heads % tp:
        raise ValueError(f"tp: got {tp}; supported a divisor of the model's {dims.num_heads} heads")
    return dims.num_heads // tp


def _layers(dims: MLADims, num_layers: int | None) -> int:
    return _dims(dims).num_layers if num_layers is None else _pos_int("num_layers", num_layers)


def element_bytes(
    kv_cache_dtype: str | torch.dtype = "auto", model_dtype: str | torch.dtype = "bfloat16"
) -> int:
    """Bytes per cached element: 2 for bf16/fp16 (and ``auto`` over a bf16 model), 1 for fp8, 4 for fp32.

    The fp8 cache's scale is one float32 per cache, not per token, so it adds nothing per token.
    """
    canonical_kv_cache_dtype(kv_cache_dtype)  # validates, naming the argument
    return kv_cache_torch_dtype(kv_cache_dtype, parse_model_dtype(model_dtype)).itemsize


# ---- cache bytes -----------------------------------------------------------------------------------------
def latent_bytes_per_token_per_layer(dims: MLADims, dtype_bytes: int = 2) -> int:
    """``(r + d_rope) * b``: one 576-wide row, 1,152 bytes for DeepSeek-V3 in bf16. Same on every TP rank."""
    return _dims(dims).cache_row_width * _pos_int("dtype_bytes", dtype_bytes)


def latent_bytes_per_token(dims: MLADims, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
    """``L * (r + d_rope) * b``: 70,272 bytes (68.625 KiB) for DeepSeek-V3 in bf16 over 61 layers."""
    return _layers(dims, num_layers) * latent_bytes_per_token_per_layer(dims, dtype_bytes)


def expanded_bytes_per_token_per_layer(dims: MLADims, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Per-head K (``d_nope + d_rope`` wide) and V (``d_v`` wide) for ``h / tp`` heads, times ``b``.

    81,920 bytes for DeepSeek-V3 at TP=1 in bf16 (``128 * (192 + 128) * 2``): what the naive path materialises
    per context token, and what a cache of expanded keys and values would hold.
    """
    d = _dims(dims)
    return _heads_per_rank(d, tp) * (d.qk_head_dim + d.v_head_dim) * _pos_int("dtype_bytes", dtype_bytes)


def expanded_bytes_per_token(
    dims: MLADims, dtype_bytes: int = 2, num_layers: int | None = None, tp: int = 1
) -> int:
    """``L * h * (d_nope + d_rope + d_v) * b``: 4,997,120 bytes (4.765625 MiB) for DeepSeek-V3 in bf16."""
    return _layers(dims, num_layers) * expanded_bytes_per_token_per_layer(dims, dtype_bytes, tp)


def expanded_ratio(dims: MLADims, tp: int = 1) -> float:
    """Expanded over latent bytes per token (independent of ``b`` and ``L``): 71.11 for V3 at TP=1."""
    return expanded_bytes_per_token_per_layer(dims, 1, tp) / latent_bytes_per_token_per_layer(dims, 1)


def uncached_kv_bytes_per_token_per_layer(dims: MLADims, dtype_bytes: int = 2) -> int:
    """``h * (d_nope + d_v) * b``: per-head K-nope and V, never cached: 65,536 bytes for V3 (57x the row)."""
    d = _dims(dims)
    return d.total_num_heads * (d.qk_nope_head_dim + d.v_head_dim) * _pos_int("dtype_bytes", dtype_bytes)


def _gqa(cfg: Any) -> GQAConfig:
    if not isinstance(cfg, GQAConfig):
        raise TypeError(f"gqa: got {type(cfg).__name__}; supported a GQAConfig (e.g. costs.LLAMA3_70B)")
    return cfg


def gqa_bytes_per_token(gqa: GQAConfig = LLAMA3_70B, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Per-rank GQA cache bytes per token: ``2 * L * ceil(kv_heads / tp) * d_h * b`` (K and V).

    Llama-3-70B in bf16 at TP=1: 327,680 bytes = 320 KiB. KV heads shard across ranks until ``tp`` exceeds
    their count, after which each rank keeps one (replicated) KV head.
    """
    g = _gqa(gqa)
    kv_per_rank = math.ceil(g.num_kv_heads / _pos_int("tp", tp))
    return 2 * g.num_layers * kv_per_rank * g.head_dim * _pos_int("dtype_bytes", dtype_bytes)


def gqa_cluster_bytes_per_token(gqa: GQAConfig = LLAMA3_70B, dtype_bytes: int = 2, tp: int = 1) -> int:
    """GQA bytes per token summed over all ``tp`` ranks (constant while ``tp <= kv_heads``)."""
    return tp * gqa_bytes_per_token(gqa, dtype_bytes, tp)


def cache_bytes_per_token(dims: MLADims, dtype_bytes: int = 2) -> int:
    """Per-rank cache bytes per token: the latent plus, for DeepSeek-V3.2, the (fp8) indexer key.

    70,272 for DeepSeek-V3 in bf16; 70,272 + 8,052 = 78,324 for V3.2. Same on every TP rank.
    """
    return latent_bytes_per_token(dims, dtype_bytes) + indexer_bytes_per_token(dims)


def mla_cluster_bytes_per_token(dims: MLADims, dtype_bytes: int = 2, tp: int = 1) -> int:
    """MLA bytes per token summed over ``tp`` ranks: ``tp`` times :func:`cache_bytes_per_token` (replicated).

    ``tp * L * (r + d_rope) * b`` for a dense model, plus ``tp`` times the indexer bytes for V3.2.
    """
    return _pos_int("tp", tp) * cache_bytes_per_token(dims, dtype_bytes)


def tp_break_even(dims: MLADims, gqa: GQAConfig = LLAMA3_70B, dtype_bytes: int = 2) -> float:
    """TP size at which MLA's replicated cache costs the cluster as much as the sharded GQA cache.

    ``gqa_cluster_bytes / cache_bytes``: 327,680 / 70,272 = 4.66 (about 4.7) for DeepSeek-V3 vs Llama-3-70B;
    327,680 / 78,324 = 4.18 (about 4.2) for V3.2, whose indexer key is replicated too.
    """
    return gqa_cluster_bytes_per_token(gqa, dtype_bytes, 1) / cache_bytes_per_token(dims, dtype_bytes)


# ---- FLOPs -----------------------------------------------------------------------------------------------
def up_projection_flops_per_context_token(dims: MLADims, tp: int = 1) -> int:
    """Naive path: ``2 * r * h * (d_nope + d_v)`` to rebuild one token's K-nope and V: 33,554,432 for V3."""
    d = _dims(dims)
    return 2 * d.kv_lora_rank * _heads_per_rank(d, tp) * (d.qk_nope_head_dim + d.v_head_dim)


def fold_flops_per_query_token(dims: MLADims, tp: int = 1) -> int:
    """Absorbed path: ``2 h d_nope r`` (``q @ W_UK_T``) plus ``2 h r d_v`` (``o @ W_UV``) per query token.

    Equal to :func:`up_projection_flops_per_context_token`: absorption moves the cost from the context axis
    to the query axis.
    """
    d = _dims(dims)
    h = _heads_per_rank(d, tp)
    return 2 * h * d.qk_nope_head_dim * d.kv_lora_rank + 2 * h * d.kv_lora_rank * d.v_head_dim


def absorbed_core_flops_per_context_token(dims: MLADims, tp: int = 1) -> int:
    """Absorbed attention core per (query, context) pair: ``2 h ((r + d_rope) + r)`` = 278,528 for V3 at TP=1.

    Scores over the 576-wide row, then the weighted sum over the 512-wide latent.
    """
    d = _dims(dims)
    return 2 * _heads_per_rank(d, tp) * (d.cache_row_width + d.kv_lora_rank)


def expanded_core_flops_per_context_token(dims: MLADims, tp: int = 1) -> int:
    """Expanded attention core per pair: ``2 h ((d_nope + d_rope) + d_v)`` = 81,920 for V3 at TP=1."""
    d = _dims(dims)
    return 2 * _heads_per_rank(d, tp) * (d.qk_head_dim + d.v_head_dim)


def core_cost_factor(dims: MLADims) -> float:
    """How much dearer the absorbed core is than the expanded core: 278,528 / 81,920 = 3.4 for V3."""
    return absorbed_core_flops_per_context_token(dims) / expanded_core_flops_per_context_token(dims)


def decode_arithmetic_intensity(dims: MLADims, dtype_bytes: int = 2, tp: int = 1) -> float:
    """FLOP per cache byte of one absorbed decode token, per rank: core FLOPs over the latent row's bytes.

    ``2 (h / tp) (2r + d_rope) / ((r + d_rope) b)``: 278,528 / 1,152 = 241.8 (242) at TP=1 and 34,816 / 1,152
    = 30.2 (30) at TP=8 for DeepSeek-V3 in bf16. The heads split across ranks; the bytes each rank reads
    do not.
    """
    return absorbed_core_flops_per_context_token(dims, tp) / latent_bytes_per_token_per_layer(
        dims, dtype_bytes
    )


def gqa_decode_arithmetic_intensity(gqa: GQAConfig = LLAMA3_70B, dtype_bytes: int = 2) -> float:
    """GQA decode intensity: ``2 hq (2 d_h) / (2 kv d_h b)`` = group size / b * 2 = 8 for GQA-8 in bf16."""
    g = _gqa(gqa)
    flops = 2 * g.num_attention_heads * 2 * g.head_dim
    return flops / (2 * g.num_kv_heads * g.head_dim * _pos_int("dtype_bytes", dtype_bytes))


# ---- absorbed vs expanded for a query block -------------------------------------------------------------
def attention_pairs(query_len: int, context_len: int, *, causal: bool = False) -> int:
    """(query, key) pairs a block of ``Q`` new tokens attends.

    Rectangular (``causal=False``): every query sees all ``S`` keys, ``Q * S``. Causal: ``S`` is the cached
    prefix and the new tokens see the prefix plus themselves causally, ``Q * S + Q (Q + 1) / 2`` (Q=3 over a
    prefix of 5: 21 pairs).
    """
    q = _pos_int("query_len", query_len)
    s = _pos_int("context_len", context_len, allow_zero=causal)
    return q * s + (q * (q + 1) // 2 if causal else 0)


def absorbed_path_flops(
    dims: MLADims, query_len: int, context_len: int, *, tp: int = 1, causal: bool = False
) -> int:
    """Absorbed path: folds for every query token plus the absorbed core for every pair.

    Rectangular: ``Q * 33,554,432 + Q * S * 278,528`` for V3 at TP=1.
    """
    pairs = attention_pairs(query_len, context_len, causal=causal)
    return query_len * fold_flops_per_query_token(dims, tp) + pairs * absorbed_core_flops_per_context_token(dims, tp)


def expanded_path_flops(dims: MLADims, query_len: int, context_len: int, *, tp: int = 1, causal: bool = False) -> int:
    """Expanded path: up-project every key token once, then the expanded core for every pair.

    Rectangular: ``S * 33,554,432 + Q * S * 81,920``. Causal: the ``Q`` new tokens are up-projected too.
    """
    pairs = attention_pairs(query_len, context_len, causal=causal)
    keys = context_len + (query_len if causal else 0)
    up = up_projection_flops_per_context_token(dims, tp)
    return keys * up + pairs * expanded_core_flops_per_context_token(dims, tp)


def cheaper_path(
    dims: MLADims, query_len: int, context_len: int, *, tp: int = 1, causal: bool = False
) -> str:
    """``"absorbed"`` when its FLOPs are strictly lower, else ``"expanded"`` (ties go to expanded)."""
    a = absorbed_path_flops(dims, query_len, context_len, tp=tp, causal=causal)
    e = expanded_path_flops(dims, query_len, context_len, tp=tp, causal=causal)
    return "absorbed" if a < e else "expanded"


def asymptotic_query_threshold(dims: MLADims) -> float:
    """Query length below which absorption wins as ``S`` grows without bound.

    From ``up (Q / S) + Q (core_abs - core_exp) < up``: ``Q < up / (core_abs - core_exp)``
    = 33,554,432 / 196,608 = 170.67 (about 171) for DeepSeek-V3, at any TP size and in both the rectangular
    and the causal model. Independent of the head count:
    ``r (d_nope + d_v) / (2r + d_rope - d_nope - d_rope - d_v)``.
    """
    d = _dims(dims)
    diff = absorbed_core_flops_per_context_token(d) - expanded_core_flops_per_context_token(d)
    if diff <= 0:
        return math.inf
    return up_projection_flops_per_context_token(d) / diff


def crossover_query_len(dims: MLADims, context_len: int, *, causal: bool = False) -> float:
    """Query length at which both paths cost the same over context ``S`` (absorbed wins below it).

    Rectangular: ``Q* = S up / (fold + S (core_abs - core_exp))``, tending to
    :func:`asymptotic_query_threshold`.
    Causal: the positive root of ``(core_abs - core_exp) (Q S + Q (Q + 1) / 2) = S up``.
    """
    d = _dims(dims)
    s = _pos_int("context_len", context_len, allow_zero=causal)
    up = up_projection_flops_per_context_token(d)
    diff = absorbed_core_flops_per_context_token(d) - expanded_core_flops_per_context_token(d)
    if diff <= 0:
        return math.inf
    if not causal:
        return s * up / (fold_flops_per_query_token(d) + s * diff)
    # diff/2 Q^2 + diff (S + 1/2) Q - S up = 0  (fold cost equals the up-projection of the new tokens)
    a, b, c = diff / 2, diff * (s + 0.5), -s * up
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def min_context_for_absorption(dims: MLADims, query_len: int = 1) -> int | None:
    """Smallest context at which absorption is cheaper for ``Q`` query tokens (rectangular model).

    2 for a single decode token on DeepSeek-V3. None when ``Q`` is at or above the asymptotic threshold.
    """
    d = _dims(dims)
    q = _pos_int("query_len", query_len)
    fold = fold_flops_per_query_token(d)
    up = up_projection_flops_per_context_token(d)
    diff = absorbed_core_flops_per_context_token(d) - expanded_core_flops_per_context_token(d)
    denom = up - q * diff  # absorbed < expanded  <=>  S (up - Q diff) > Q fold
    if denom <= 0:
        return None
    s = math.floor(q * fold / denom) + 1
    return max(s, 1)


# ---- chunked-prefill workspace ---------------------------------------------------------------------------
def workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """vLLM's chunked-prefill workspace rows.

    ``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 65536)``.

    Room for eight full-length requests or at least four pages per sequence, capped at 64k rows. The same
    sizing :func:`mla_backends.layer.workspace.default_workspace_rows` gives ``forward_mha`` (this delegates to it).
    """
    return default_workspace_rows(max_model_len, max_num_seqs, block_size)


def workspace_latent_bytes(dims: MLADims, rows: int, dtype_bytes: int = 2) -> int:
    """``rows * (r + d_rope) * b``: 75,497,472 bytes (72 MiB) at 64k rows of V3 in bf16."""
    return _pos_int("rows", rows) * latent_bytes_per_token_per_layer(dims, dtype_bytes)


def workspace_upprojected_bytes(
    dims: MLADims, rows: int, dtype_bytes: int = 2, *, tp: int = 1, include_values: bool = False
) -> int:
    """Bytes once the workspace is up-projected: ``rows * h * (d_nope + d_rope) * b`` keys.

    3,221,225,472 bytes (3 GiB) of keys at 64k rows of V3 in bf16 (``2 * 192 * 128 * 65,536``, the figure in
    vLLM's comment); ``include_values`` adds the ``h * d_v`` values (5 GiB in all). ``forward_mha``'s own
    workspace holds K-nope and V instead (the RoPE part is shared by the heads):
    ``rows * uncached_kv_bytes_per_token_per_layer`` = 4 GiB.
    """
    d = _dims(dims)
    width = d.qk_head_dim + (d.v_head_dim if include_values else 0)
    return _pos_int("rows", rows) * _heads_per_rank(d, tp) * width * _pos_int("dtype_bytes", dtype_bytes)


# ---- DeepSeek-V3.2 indexer cache -------------------------------------------------------------------------
def indexer_bytes_per_token_per_layer(dims: MLADims) -> int:
    """``head_dim + head_dim // 128 * 4``: fp8 key, a float32 scale per 128 values; 132 (V3.2), 0 dense."""
    d = _dims(dims)
    if d.indexer is None:
        return 0
    hd = d.indexer.head_dim
    return hd + hd // INDEXER_QUANT_BLOCK * 4


def indexing_layers(dims: MLADims) -> int:
    """Layers that keep their own indexer key: all but ``indexer.skip_layers`` (0 for dense models)."""
    d = _dims(dims)
    if d.indexer is None:
        return 0
    return sum(1 for i in range(d.num_layers) if d.indexer.indexes(i))


def indexer_bytes_per_token(dims: MLADims) -> int:
    """Indexer bytes per token over the indexing layers: 132 * 61 = 8,052 (7.86 KiB) for V3.2."""
    return indexer_bytes_per_token_per_layer(dims) * indexing_layers(dims)


def indexer_overhead(dims: MLADims, dtype_bytes: int = 2) -> float:
    """Indexer bytes as a fraction of the latent bytes per token: 8,052 / 70,272 = 0.115 (+11.5%) for V3.2."""
    return indexer_bytes_per_token(dims) / latent_bytes_per_token(dims, dtype_bytes)
