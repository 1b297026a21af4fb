"""A tiny float64 transformers DeepSeek-V4 model and its attention layers' recorded inputs and outputs.

Three layers, one of each kind: window-only, CSA (ratio 4, indexer top-3 of 4 heads) and HCA (ratio 8, a test
size: transformers accepts any ratio; 128 would need prompts of hundreds of tokens). hidden 64, 4 heads of 64
(rope 16), window 8, YaRN on the compress rotary; two Sinkhorn iterations in the hyper-connections (they are not
attention, and twenty made every forward 4x slower). transformers runs each request alone, prefill then one token at
a time; hooks keep, per layer, every token's attention input and output, the CSA indexer's scores and picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from mla_backends.testing import randomise_parameters

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATIOS = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
TOPK = 3
VOCAB = 97


def tiny_v4_config(**kw: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                head_dim=64, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                partial_rotary_factor=0.25, layer_types=list(KINDS), compress_rates=dict(RATIOS), sliding_window=8,
                o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=32, index_topk=TOPK, hc_mult=2,
                hc_sinkhorn_iters=2, mlp_layer_types=["moe"] * 3, max_position_embeddings=4096, pad_token_id=0,
                bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 32, "beta_slow": 1})
    return transformers.DeepseekV4Config(**{**base, **kw})


def tiny_v4(seed: int = 1, *, std: float = 0.2, **kw: Any) -> Any:
    """A float64 ``DeepseekV4ForCausalLM`` (eager attention and experts), random weights, random sinks."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_v4_config(**kw)
    model = transformers.DeepseekV4ForCausalLM._from_config(cfg, dtype=torch.float64, attn_implementation="eager",
                                                            experts_implementation="eager")
    randomise_parameters(model, seed=seed, std=std)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model.eval()


@dataclass
class Recorded:
    """One request run alone: per layer ``x``/``y [tokens, hidden]``; the CSA layer's indexer ``scores [tokens,
    entries]`` (float32, as transformers computes them) and ``picks`` (sets of entry numbers, per token)."""

    ids: torch.Tensor
    x: dict[int, torch.Tensor] = field(default_factory=dict)
    y: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: list[torch.Tensor] = field(default_factory=list)
    picks: list[set[int]] = field(default_factory=list)


def record(model: Any, ids: torch.Tensor, prompt: int) -> Recorded:
    """transformers on ``ids [n]``: a prefill of ``prompt`` tokens, then one token a step, with a cache."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    rec = Recorded(ids)
    xs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.model.layers))}
    ys: dict[int, list[torch.Tensor]] = {i: [] for i in xs}
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        handles.append(attn.register_forward_pre_hook(
            lambda m, a, k, i=i: xs[i].append((k.get("hidden_states", a[0] if a else None))[0]), with_kwargs=True))
        handles.append(attn.register_forward_hook(lambda m, a, k, out, i=i: ys[i].append(out[0][0]), with_kwargs=True))
    for mod in model.modules():
        if isinstance(mod, hf.DeepseekV4IndexerScorer):
            handles.append(mod.register_forward_hook(lambda m, a, out: rec.scores.extend(out[0].float())))
        if isinstance(mod, hf.DeepseekV4Indexer):
            handles.append(mod.register_forward_hook(
                lambda m, a, out: rec.picks.extend({int(v) for v in row if v >= 0} for row in out[0])))
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[None, :prompt], cache=cache, use_cache=True)
            for t in range(prompt, len(ids)):
                model(ids[None, t:t + 1], cache=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    rec.x = {i: torch.cat(v) for i, v in xs.items()}
    rec.y = {i: torch.cat(v) for i, v in ys.items()}
    return rec


def topk_gaps(rec: Recorded, ratio: int = 4, k: int = TOPK) -> list[float]:
    """For every token that sees more than ``k`` entries: the gap between its k-th and (k+1)-th best indexer
    score over its visible entries, relative to its largest |score| (a tie at the boundary would be ~1e-7)."""
    gaps = []
    for p, s in enumerate(rec.scores):
        vis = (p + 1) // ratio
        if vis > k:
            top = torch.sort(s[:vis], descending=True).values
            gaps.append(float((top[k - 1] - top[k]) / top.abs().max().clamp_min(1e-30)))
    return gaps
