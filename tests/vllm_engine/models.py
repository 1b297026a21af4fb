"""Tiny random DeepSeek-V3 (MoE, ``q_lora_rank``) and DeepSeek-V2 (``q_lora_rank`` None) checkpoints for the vLLM
tests: ``kv_lora_rank`` 512 and rope 64 (vLLM's CPU_MLA takes only 576-wide rows), the rest shrunk; fp32,
saved sharded by transformers' ``save_pretrained`` (no tokenizer: the tests send token ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mla_backends.testing import randomise_parameters

VOCAB = 211
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
              max_position_embeddings=512, rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=2, n_group=1, topk_group=1)


def build(kind: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save the ``kind`` (``"v3"`` or ``"v2"``) checkpoint under ``path`` in several safetensors shards
    (``overrides``: config fields replacing :data:`COMMON`'s, e.g. ``kv_lora_rank=256, qk_rope_head_dim=32``)."""
    import transformers

    common = {**COMMON, **overrides}
    if kind == "v3":  # vLLM needs noaux_tc + sigmoid (it loads e_score_correction_bias)
        cfg = transformers.DeepseekV3Config(**common, q_lora_rank=32, topk_method="noaux_tc", scoring_func="sigmoid",
                                            rope_interleave=True)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif kind == "v2":
        cfg = transformers.DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy")
        model = transformers.DeepseekV2ForCausalLM(cfg)
    else:
        raise ValueError(f"kind: got {kind!r}; supported 'v3', 'v2'")
    model = randomise_parameters(model.float(), seed=seed, std=0.2)
    out = Path(path)
    model.save_pretrained(out, max_shard_size="300KB", safe_serialization=True)
    return out
