"""Tiny random transformers DeepSeek models for the checkpoint and integration tests (no downloads).

transformers is imported inside the functions (``pytest.importorskip``), so collecting a test module does not
need it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mla_backends.testing import randomise_parameters

VOCAB = 97
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
              tie_word_embeddings=False)


def tiny_v3(seed: int = 0, *, num_layers: int = 3, max_positions: int = 256) -> Any:
    """``DeepseekV3ForCausalLM``: 3 layers (the last two MoE), YaRN, interleaved RoPE, ``q_lora_rank`` 24
    (``max_positions``: its ``max_position_embeddings``)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        **{**COMMON, "max_position_embeddings": max_positions}, num_hidden_layers=num_layers, q_lora_rank=24,
        rope_interleave=True, rope_parameters=dict(YARN),
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1)
    cfg._attn_implementation = "eager"
    return randomise_parameters(transformers.DeepseekV3ForCausalLM(cfg).float(), seed=seed, std=0.3)


def tiny_v2(seed: int = 0, *, num_layers: int = 2) -> Any:
    """``DeepseekV2ForCausalLM`` with ``q_lora_rank`` None (a plain ``q_proj``), the second layer MoE."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV2Config(
        **COMMON, num_hidden_layers=num_layers, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy")
    cfg._attn_implementation = "eager"
    return randomise_parameters(transformers.DeepseekV2ForCausalLM(cfg).float(), seed=seed, std=0.3)


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, max], attention_mask [B, max])`` of random prompts, left-padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, S - n:] = 1
    return ids, mask


def right_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of :func:`left_padded` (same tokens), padded on the right instead."""
    ids, mask = left_padded(lengths, seed)
    S = ids.shape[1]
    for b, n in enumerate(lengths):
        ids[b] = torch.cat([ids[b, S - n:], ids.new_zeros(S - n)])
        mask[b] = torch.cat([mask.new_ones(n), mask.new_zeros(S - n)])
    return ids, mask


TIE = 1e-5  # relative gap of the unpatched top two logits below which the patched model may pick either
LOGITS_RTOL = 1e-4


def generate_greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int, **kw: Any) -> Any:
    """``model.generate`` greedy, with its logits (``return_dict_in_generate``), pad token 0."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kw)


def compare_generations(ref: Any, got: Any) -> int:
    """Steps of two greedy generations (``generate_greedy`` outputs) compared before a near-tie divergence:
    every step's logits within ``LOGITS_RTOL`` of ``ref``'s, the same tokens unless the unpatched top two
    logits are within ``TIE``; fails on any other difference."""
    steps = len(ref.logits)
    assert len(got.logits) == steps
    for t in range(steps):
        a, b = ref.logits[t], got.logits[t]
        err = ((a - b).abs().amax(-1) / a.abs().amax(-1)).max().item()
        assert err < LOGITS_RTOL, f"step {t}: logits differ by {err:.2e} relative"
        ta, tb = a.argmax(-1), b.argmax(-1)
        if not torch.equal(ta, tb):
            top2 = a.topk(2, dim=-1).values
            gap = ((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs())[ta != tb]
            assert (gap < TIE).all(), f"step {t}: tokens differ away from a near-tie (gap {gap.tolist()})"
            return t
    assert torch.equal(ref.sequences, got.sequences)
    return steps
