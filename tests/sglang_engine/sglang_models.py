"""Tiny random DeepSeek-V2 (``q_lora_rank`` None) and DeepSeek-V3 (MoE, ``q_lora_rank``) checkpoints for the SGLang
tests: ``kv_lora_rank`` 512 and rope 64, the rest shrunk; fp32, saved sharded by transformers' ``save_pretrained``
with a word-level tokenizer of ``t0 .. t210`` (the tests send token ids; SGLang's OpenAI server needs a
tokenizer to return text next to the ids).

Two fields SGLang 0.5.23's loader needs that transformers leaves out: yarn rope parameters (SGLang's CPU rope
factory builds only DeepSeek's yarn rope) with factor 1.0, which is the plain rope transformers computes, and
``moe_layer_freq`` 1 (every layer past ``first_k_dense_replace`` is MoE, as transformers builds it); V2 also gets
``scoring_func`` softmax, the routing transformers' DeepSeek-V2 uses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mla_backends.testing import randomise_parameters

VOCAB = 211
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=2, n_group=1, topk_group=1)
#: yarn with factor 1: the same frequencies and softmax scale as no scaling, in the form SGLang's CPU rope takes
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def build(kind: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save the ``kind`` (``"v2"`` or ``"v3"``) checkpoint under ``path`` in several safetensors shards
    (``overrides``: config fields replacing :data:`COMMON`'s, e.g. ``kv_lora_rank=256, qk_rope_head_dim=32``)."""
    import transformers

    common = {**COMMON, **overrides}
    rope = dict(YARN, original_max_position_embeddings=common["max_position_embeddings"])
    if kind == "v3":
        cfg = transformers.DeepseekV3Config(**common, q_lora_rank=32, topk_method="noaux_tc", scoring_func="sigmoid",
                                            rope_interleave=True, rope_parameters=rope)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif kind == "v2":
        cfg = transformers.DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy", rope_parameters=rope)
        model = transformers.DeepseekV2ForCausalLM(cfg)
    else:
        raise ValueError(f"kind: got {kind!r}; supported 'v3', 'v2'")
    model = randomise_parameters(model.float(), seed=seed, std=0.2)
    out = Path(path)
    model.save_pretrained(out, max_shard_size="300KB", safe_serialization=True)
    conf = json.loads((out / "config.json").read_text())
    conf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": "yarn"}
    conf["rope_theta"] = rope["rope_theta"]
    conf["moe_layer_freq"] = 1
    conf.setdefault("scoring_func", "softmax")  # transformers' DeepSeek-V2 routing; SGLang reads the field
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    save_tokenizer(out, common["vocab_size"])
    return out


def save_tokenizer(path: str | Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer whose token ``i`` is the word ``t<i>`` (pad 0, bos 1, eos 2), saved under ``path``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1",
                                                eos_token="t2", unk_token="t3")
    fast.save_pretrained(path)
