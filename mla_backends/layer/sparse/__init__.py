"""DeepSeek-V3.2 sparse attention: the indexer key cache, the indexer (scores + causal top-k), skip layers.

The selected positions go to the same ``forward_mqa`` as dense attention, as ``topk_indices [tokens, topk]``
(``-1`` padded): sparse and dense share one kernel signature and one latent cache.
"""

from __future__ import annotations

from .indexer import Indexer, causal_topk, hadamard_matrix, index_scores
from .indexer_cache import (
    FP8_E4M3_MAX,
    QUANT_BLOCK,
    IndexerKeyCache,
    dequantize_fp8_blockwise,
    indexer_bytes_per_token,
    quantize_fp8_blockwise,
)
from .layer_support import SparseKVCache, build_indexer, split_indexer_state_dict

__all__ = [
    "FP8_E4M3_MAX", "QUANT_BLOCK", "Indexer", "IndexerKeyCache", "causal_topk", "dequantize_fp8_blockwise",
    "hadamard_matrix", "index_scores", "indexer_bytes_per_token", "quantize_fp8_blockwise", "SparseKVCache",
    "build_indexer", "split_indexer_state_dict",
]
