"""Shared pieces of the MLA layer tests: tiny DeepSeek-V3 configs, transformers' attention as the float64
oracle, and a driver that runs a multi-step schedule through :class:`MLAAttention` over a scattered paged
cache.

transformers is imported inside the functions that need it, so spawned worker processes stay light.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step

HIDDEN = 32
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_config(*, q_lora_rank: int | None = 24, interleave: bool = True, yarn: bool = False, heads: int = 4,
                attention_bias: bool = False) -> Any:
    """A small transformers ``DeepseekV3Config`` (hidden 32, 4 heads, r 16, nope 8, rope 8, v 12)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=16,
        q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=256, rope_interleave=interleave,
        rope_parameters=dict(YARN if yarn else DEFAULT_ROPE),
        num_hidden_layers=1, attention_bias=attention_bias,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg: Any, seed: int = 0) -> Any:
    """transformers' attention in float64 with random weights (std 0.2, so scores are far from uniform)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    torch.manual_seed(seed)
    attn = DeepseekV3Attention(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
        for name, p in attn.named_parameters():
            if "layernorm" in name:
                p.add_(1.0)
    return attn


@torch.no_grad()
def hf_full_sequence(attn: Any, cfg: Any, x: torch.Tensor) -> torch.Tensor:
    """Causal attention over one whole sequence ``x [L, hidden]`` -> ``[L, hidden]`` (no cache).

    Attention is causal, so row ``p`` equals what any incremental schedule must produce for position ``p``.
    """
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    L = x.shape[0]
    rot = DeepseekV3RotaryEmbedding(cfg)
    cos, sin = rot(x[None], torch.arange(L)[None])
    mask = torch.full((L, L), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    y, _ = attn(x[None], (cos, sin), mask)
    return y[0]


def scattered_block_tables(num_requests: int, max_len: int, block_size: int, seed: int = 0
                           ) -> tuple[torch.Tensor, int]:
    """Random, disjoint page lists per request (pages far from in order), and the cache's block count."""
    pages = -(-max_len // block_size)
    num_blocks = num_requests * pages + 5
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)[: num_requests * pages]
    return perm.view(num_requests, pages).to(torch.int32), num_blocks


def run_schedule(layer, cache, block_table: torch.Tensor, xs: list[torch.Tensor],
                 steps: list[list[int]], *, decode_threshold: int = 1) -> list[list[torch.Tensor]]:
    """Feed requests' tokens step by step. ``steps[s][b]`` = new tokens of request ``b`` at step ``s``.

    Returns ``outs[b]``: the list of output chunks of request ``b`` (concatenate for its full output).
    Tokens of one step are concatenated in request order (the caller's order).
    """
    done = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for qlens in steps:
        meta = BatchMetadata.build(qlens, list(done), block_table, cache.block_size,
                                   decode_threshold=decode_threshold, num_blocks=cache.num_blocks)
        hidden = torch.cat([xs[b][done[b]: done[b] + q] for b, q in enumerate(qlens)])
        positions = torch.cat([torch.arange(done[b], done[b] + q) for b, q in enumerate(qlens)])
        y = layer(hidden, positions, cache, plan_step(meta, [layer]))
        off = 0
        for b, q in enumerate(qlens):
            outs[b].append(y[off: off + q])
            off += q
            done[b] += q
    return outs


#: prefill of three requests of different lengths, three decode steps, then a mixed step where request 1
#: decodes while 0 and 2 extend by 4 and 9 over their cached prefixes (decodes are not first in caller order)
SCHEDULE = [[5, 11, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], [4, 1, 9]]
