"""``MLADims``: presets, derived widths and scale, Hugging Face configs (both RoPE forms), tensor parallel."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mla_backends.core.dims import MLADims, RopeScaling
from mla_backends.step.cache import LatentKVCache

PRESETS = ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3", "kimi_k2", "deepseek_v32"]

# DeepSeek-YaRN magnitude for factor 40, mscale_all_dim 1: 0.1 * 1 * ln(40) + 1, applied squared
V3_MSCALE = 0.1 * math.log(40.0) + 1.0
V3_SCALE = (128 + 64) ** -0.5 * V3_MSCALE**2

# the attention-relevant part of DeepSeek-V3's published config.json, in its real format
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_row_width_576(name):
    dims = getattr(MLADims, name)()
    assert dims.cache_row_width == 576
    assert dims.kv_lora_rank + dims.qk_rope_head_dim == 576
    assert dims.qk_head_dim == 192


def test_preset_shapes_and_names():
    assert MLADims.deepseek_v3().num_heads == 128
    assert MLADims.kimi_k2().num_heads == 64
    assert MLADims.deepseek_v2_lite().num_heads == 16 and MLADims.deepseek_v2_lite().q_lora_rank is None
    assert MLADims.deepseek_v32().is_sparse and not MLADims.deepseek_v3().is_sparse
    assert MLADims.preset("R1") == MLADims.deepseek_v3()
    assert MLADims.preset("deepseek_v3") == MLADims.deepseek_v3()
    with pytest.raises(ValueError, match="preset"):
        MLADims.preset("llama-3")


def test_v3_bf16_cache_is_1152_bytes_per_token_per_layer():
    dims = MLADims.deepseek_v3()
    assert LatentKVCache.allocate(dims, 1, 16, "bfloat16").bytes_per_token == 1152
    assert LatentKVCache.allocate(dims, 1, 16, "auto", model_dtype=torch.bfloat16).bytes_per_token == 1152
    assert LatentKVCache.allocate(dims, 1, 16, "fp8_e4m3").bytes_per_token == 576
    assert LatentKVCache.allocate(dims, 1, 16, "float32").bytes_per_token == 2304


def test_softmax_scale_is_unabsorbed_with_yarn_mscale():
    dims = MLADims.deepseek_v3()
    assert dims.softmax_scale == pytest.approx(V3_SCALE, rel=1e-12)
    plain = MLADims(num_heads=16, rope_scaling=None)
    assert plain.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)
    # not the latent width's scale: absorption must not change the function
    assert plain.softmax_scale != pytest.approx(576 ** -0.5)


def _check_v3(dims: MLADims) -> None:
    shape = (dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim)
    assert shape == (128, 512, 128, 64, 128)
    assert dims.q_lora_rank == 1536 and dims.hidden_size == 7168 and dims.num_layers == 61
    assert dims.rope_theta == 10000.0
    assert dims.rope_scaling == RopeScaling(
        type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
        beta_fast=32.0, beta_slow=1.0)
    assert dims.cache_row_width == 576
    assert dims.softmax_scale == pytest.approx(V3_SCALE, rel=1e-12)
    assert dims.indexer is None


def test_from_hf_config_real_v3_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG, indent=2))
    _check_v3(MLADims.from_hf_config(path))
    _check_v3(MLADims.from_hf_config(str(path)))
    _check_v3(MLADims.from_hf_config(tmp_path))  # the folder holding it
    _check_v3(MLADims.from_hf_config(DEEPSEEK_V3_CONFIG))  # the same as a dict


def test_from_hf_config_rope_parameters_form():
    """transformers 5 moves the block to ``rope_parameters`` (``rope_type``, with ``rope_theta`` inside)."""
    d = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    block = dict(DEEPSEEK_V3_CONFIG["rope_scaling"])
    block["rope_type"] = block.pop("type")
    d["rope_parameters"] = {**block, "rope_theta": 10000.0}
    _check_v3(MLADims.from_hf_config(d))
    # a different theta inside rope_parameters is honoured
    d["rope_parameters"]["rope_theta"] = 50000.0
    assert MLADims.from_hf_config(d).rope_theta == 50000.0


def test_from_hf_config_v32_indexer_and_no_scaling():
    d = dict(DEEPSEEK_V3_CONFIG, index_n_heads=64, index_head_dim=128, index_topk=2048, rope_scaling=None)
    dims = MLADims.from_hf_config(d)
    assert dims.is_sparse and dims.indexer.topk == 2048 and dims.indexer.n_heads == 64
    assert dims.rope_scaling is None and dims.softmax_scale == pytest.approx(192 ** -0.5)


def test_from_hf_config_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="config"):
        MLADims.from_hf_config({"hidden_size": 4096, "num_attention_heads": 32})  # not MLA
    with pytest.raises(ValueError, match="config"):
        MLADims.from_hf_config(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="config"):
        MLADims.from_hf_config(42)
    with pytest.raises(ValueError, match="rope_scaling"):
        MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(TypeError, match="config.index_n_heads: got str '64'"):
        MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, index_topk=2048, index_n_heads="64"))
    for freq in (0, -4):
        with pytest.raises(ValueError, match=f"config.index_topk_freq: got {freq}; supported an int >= 1"):
            MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, index_topk=2048, index_topk_freq=freq))
    absent = MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, index_topk=2048, index_topk_freq=None))
    assert absent.indexer.n_heads == 64 and absent.indexer.skip_layers == frozenset()  # freq 1: every layer


def _tiny_hf_config(**rope):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=1,
        n_routed_experts=4, max_position_embeddings=163840, **rope)


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707, None])
def test_scale_matches_transformers_attention(mscale_all_dim):
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    params = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "original_max_position_embeddings": 4096,
              "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
    if mscale_all_dim is not None:  # without it, YaRN leaves the attention scale alone
        params["mscale_all_dim"] = mscale_all_dim
    config = _tiny_hf_config(rope_parameters=params)
    dims = MLADims.from_hf_config(config)  # the config object itself
    assert (dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dims.q_lora_rank) == (4, 32, 8, None)
    expected = DeepseekV3Attention(config, 0).scaling
    assert dims.softmax_scale == pytest.approx(expected, rel=1e-12)
    changed = dims.softmax_scale != pytest.approx(24 ** -0.5)
    assert changed == (mscale_all_dim is not None)


def test_scale_matches_transformers_without_scaling():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = _tiny_hf_config()
    expected = DeepseekV3Attention(config, 0).scaling
    assert MLADims.from_hf_config(config).softmax_scale == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_divides_heads():
    v3 = MLADims.deepseek_v3()
    tp8 = v3.tensor_parallel(8)
    assert tp8.num_heads == 16 and tp8.total_num_heads == 128 and tp8.tp_size == 8
    assert tp8.cache_row_width == 576  # the latent cache is replicated, not split
    assert tp8.softmax_scale == v3.softmax_scale
    assert v3.tensor_parallel(2).tensor_parallel(4).num_heads == 16
    with pytest.raises(ValueError, match="tp_size") as info:
        v3.tensor_parallel(3)
    assert "128" in str(info.value)
    for exc, bad in ((ValueError, 0), (ValueError, -2), (TypeError, True), (TypeError, 2.0)):
        with pytest.raises(exc, match="tp_size: got"):
            v3.tensor_parallel(bad)


def test_dims_validate_fields():
    with pytest.raises(ValueError, match="num_heads"):
        MLADims(num_heads=0)
    with pytest.raises(TypeError, match="kv_lora_rank"):
        MLADims(num_heads=4, kv_lora_rank=512.0)
    with pytest.raises(ValueError, match="q_lora_rank"):
        MLADims(num_heads=4, q_lora_rank=-1)
    for bad in (True, "1536", 1536.0):
        with pytest.raises(TypeError, match="MLADims.q_lora_rank: got"):
            MLADims(num_heads=4, q_lora_rank=bad)
    assert MLADims(num_heads=4, qk_rope_head_dim=0).cache_row_width == 512  # no RoPE slice is allowed
    with pytest.raises(ValueError, match="rope_scaling"):
        RopeScaling(type="linear")
