"""The naive (expanded) decode path, kept as a timing baseline: up-project every cached latent to per-head K
and V, then run ordinary attention. This is what absorption avoids; benchmarks and ``mla-backends demo``
compare against it. Tests use their own independent float64 reference, not this.
"""

from __future__ import annotations

import torch

from ..core.validation import require_scale
from ..step.cache import LatentKVCache
from ..step.checks import require_step_lengths, require_whole_sequences
from ..step.metadata import BatchMetadata

__all__ = ["expanded_decode"]


def expanded_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    scale: float,
) -> torch.Tensor:
    """Expanded attention for single-token decode requests.

    Args:
        q_nope: ``[B, H, qk_nope]``; q_pe: ``[B, H, qk_rope]`` (one token per request, processing order).
        w_uk: ``[H, qk_nope, kv_lora_rank]`` (``W_UK_T``); w_uv: ``[H, kv_lora_rank, v_head_dim]``.
    Returns:
        ``[B, H, v_head_dim]``.
    """
    require_scale("scale", scale)
    require_whole_sequences(meta, "expanded_decode")
    require_step_lengths(meta, "expanded_decode")
    if meta.max_query_len > 1:
        raise ValueError(f"meta: got query length {meta.max_query_len}; supported 1 (decode only)")
    r = cache.kv_lora_rank
    outs = []
    for b, s in enumerate(meta.seq_lens_list):
        rows = cache.gather(meta.block_table[b], s, q_nope.dtype)  # [S, 576]
        c, k_pe = rows[:, :r], rows[:, r:]
        k_nope = torch.einsum("sr,hpr->hsp", c, w_uk)  # [H, S, P]  (the expensive up-projection)
        v = torch.einsum("sr,hrv->hsv", c, w_uv)  # [H, S, V]
        scores = torch.einsum("hp,hsp->hs", q_nope[b], k_nope) + (q_pe[b] @ k_pe.T)
        p = torch.softmax(scores * scale, dim=-1)
        outs.append(torch.einsum("hs,hsv->hv", p, v))
    return torch.stack(outs)
