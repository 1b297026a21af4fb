"""Tiny random DeepSeek-V2 (``q_lora_rank`` None) and DeepSeek-V3 (MoE, ``q_lora_rank``) checkpoints for the engine
tests: ``kv_lora_rank`` 512 and rope 64 (vLLM's CPU_MLA takes only 576-wide rows), the rest shrunk; fp32, saved
sharded by transformers' ``save_pretrained``. The tests send token ids.

What each engine's loader needs beyond what transformers writes (:data:`ENGINE_FIELDS`):

- vLLM: a V3 config with ``topk_method`` noaux_tc and ``scoring_func`` sigmoid (vLLM loads
  ``e_score_correction_bias``; the V2 routing stays transformers' greedy softmax).
- SGLang 0.5.23: yarn rope parameters with factor 1.0, which is the plain rope transformers computes (SGLang's CPU
  rope factory builds only DeepSeek's yarn rope), ``moe_layer_freq`` 1 (every layer past
  ``first_k_dense_replace`` is MoE, as transformers builds it), ``scoring_func`` softmax for V2, and a word-level
  tokenizer of ``t0 .. t210`` (its OpenAI server needs one to return text next to the ids).

:func:`with_kv_scale` copies a checkpoint and gives its MLA layers a per-tensor fp8 KV-cache scale the way a
quantised release carries one (a compressed-tensors ``kv_cache_scheme`` and ``attn_mqa.k_scale`` tensors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mla_backends.testing import randomise_parameters

VOCAB = 211
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=2, n_group=1, topk_group=1)
#: what each engine's loader needs (see the module docstring)
ENGINES = ("vllm", "sglang")


def _yarn(max_positions: int) -> dict[str, Any]:
    """Yarn with factor 1: the same frequencies and softmax scale as no scaling, in the form SGLang's CPU rope
    takes."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
            "original_max_position_embeddings": max_positions, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0}


def build(kind: str, path: str | Path, *, engine: str, seed: int = 0, **overrides: Any) -> Path:
    """Save the ``kind`` (``"v2"`` or ``"v3"``) checkpoint for ``engine`` (``"vllm"`` or ``"sglang"``) under
    ``path`` in several safetensors shards (``overrides``: config fields replacing :data:`COMMON`'s, e.g.
    ``kv_lora_rank=256, qk_rope_head_dim=32``)."""
    import transformers

    if engine not in ENGINES:
        raise ValueError(f"engine: got {engine!r}; supported {', '.join(ENGINES)}")
    common = {**COMMON, **overrides}
    rope: dict[str, Any] = ({"rope_parameters": _yarn(common["max_position_embeddings"])} if engine == "sglang"
                            else {"rope_theta": 10000.0})
    if kind == "v3":  # noaux_tc + sigmoid: vLLM loads e_score_correction_bias
        cfg = transformers.DeepseekV3Config(**common, **rope, q_lora_rank=32, topk_method="noaux_tc",
                                            scoring_func="sigmoid", rope_interleave=True)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif kind == "v2":
        cfg = transformers.DeepseekV2Config(**common, **rope, q_lora_rank=None, topk_method="greedy")
        model = transformers.DeepseekV2ForCausalLM(cfg)
    else:
        raise ValueError(f"kind: got {kind!r}; supported 'v3', 'v2'")
    model = randomise_parameters(model.float(), seed=seed, std=0.2)
    out = Path(path)
    model.save_pretrained(out, max_shard_size="300KB", safe_serialization=True)
    if engine == "sglang":
        conf = json.loads((out / "config.json").read_text())
        yarn = _yarn(common["max_position_embeddings"])
        conf["rope_scaling"] = {k: v for k, v in yarn.items() if k != "rope_theta"} | {"type": "yarn"}
        conf["rope_theta"] = yarn["rope_theta"]
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


def with_kv_scale(src: str | Path, dst: str | Path, scale: float) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose MLA layers carry the per-tensor fp8 KV-cache scale ``scale``:
    a compressed-tensors ``quantization_config`` that quantises nothing but declares a static per-tensor fp8
    ``kv_cache_scheme``, and ``model.layers.<i>.self_attn.attn_mqa.k_scale`` / ``v_scale`` tensors in a shard of
    their own (what SGLang's loader reads into the layer's ``k_scale`` / ``k_scale_float``)."""
    import torch
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    conf["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
        "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True,
                            "dynamic": False}}
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    tensors = {f"model.layers.{i}.self_attn.attn_mqa.{name}": torch.tensor(float(scale))
               for i in range(conf["num_hidden_layers"]) for name in ("k_scale", "v_scale")}
    save_file(tensors, str(dst / "kv-scales.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "kv-scales.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst
