"""DeepSeek-V4's attention shape read from transformers' DeepseekV4Config, and V4's rotary against transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.core.v4dims import CSA, HCA, SLIDING, V4Dims, is_v4_config
from mla_backends.core.v4rope import V4Rotary

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

TYPES = [SLIDING, CSA, HCA, CSA]


def _config(**kw):
    base = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32,
                partial_rotary_factor=0.25, layer_types=TYPES, sliding_window=8, o_groups=2, o_lora_rank=16,
                index_n_heads=4, index_head_dim=32, index_topk=3, max_position_embeddings=4096,
                compress_rates={CSA: 4, HCA: 16},
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    return DeepseekV4Config(**{**base, **kw})


def test_every_attention_field_is_read_from_the_transformers_config():
    cfg = _config()
    d = V4Dims.from_hf_config(cfg)
    assert (d.num_heads, d.head_dim, d.rope_head_dim, d.q_lora_rank, d.hidden_size) == (4, 64, 16, 32, 64)
    assert d.layer_types == tuple(TYPES) and (d.csa_ratio, d.hca_ratio) == (4, 16)
    assert [d.ratio(i) for i in range(4)] == [0, 4, 16, 4] and d.ratios == (4, 16)
    assert (d.sliding_window, d.index_n_heads, d.index_head_dim, d.index_topk) == (8, 4, 32, 3)
    assert (d.o_groups, d.o_lora_rank, d.softmax_scale) == (2, 16, 64 ** -0.5)
    assert (d.rope_theta, d.compress_rope_theta) == (10000.0, 160000.0)
    assert d.compress_rope.factor == 4.0 and d.compress_rope.original_max_position_embeddings == 64
    assert d.compress_attention_factor == 1.0  # V4 scales no cos/sin under YaRN
    assert is_v4_config(cfg) and is_v4_config(cfg.to_dict())
    # the same through a config.json-style dict with DeepSeek's legacy keys
    legacy = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 128],
              "qk_rope_head_dim": 64, "num_attention_heads": 64, "o_groups": 8}
    dl = V4Dims.from_hf_config(legacy)
    assert dl.layer_types == (SLIDING, CSA, HCA) and dl.rope_head_dim == 64 and dl.compress_rope is None


def test_the_flash_preset_is_transformers_default_config():
    d = V4Dims.deepseek_v4_flash()
    ref = V4Dims.from_hf_config(DeepseekV4Config())
    assert dataclasses.replace(d, name="x") == dataclasses.replace(ref, name="x")
    assert d.kinds_count() == {SLIDING: 0, CSA: 20, HCA: 23} and (d.num_heads, d.head_dim) == (64, 512)


@pytest.mark.parametrize(("change", "field"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {"rope_type": "default"}}},
     "rope_parameters.main.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters.rope_type"),
    ({"compress_ratios": [0, 4, 8, 4]}, "compress_ratios"),
    ({"o_groups": 3}, "o_groups"),
])
def test_unsupported_fields_are_refused_by_name(change, field):
    d = _config().to_dict()
    if "compress_ratios" in change:
        d.pop("layer_types")
    d.update(change)
    with pytest.raises(ValueError, match=field):
        V4Dims.from_hf_config(d)


def test_tensor_parallel_splits_heads_and_output_groups():
    d = V4Dims.from_hf_config(_config())
    r = d.tensor_parallel(2)
    assert (r.num_heads, r.local_o_groups, r.tp_size, r.total_num_heads) == (2, 1, 2, 4)
    with pytest.raises(ValueError, match="tp_size"):
        d.tensor_parallel(4)  # 2 output groups cannot split 4 ways


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rotary_matches_transformers(kind):
    cfg = _config()
    d = V4Dims.from_hf_config(cfg)
    ours = V4Rotary.for_kind(d, SLIDING if kind == "main" else CSA)
    theirs = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 100, 3000])
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    cos_t, sin_t = theirs(x, position_ids=pos[None], layer_type=kind)
    cos, sin = ours.cos_sin(pos, torch.float64)
    assert torch.equal(cos, cos_t[0]) and torch.equal(sin, sin_t[0])
    want = hf_v4.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos_t, sin_t)[0].transpose(0, 1)  # [1, H, S, D]
    got = ours.apply(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)  # transformers rotates in float32
    # rotating back undoes it up to cos^2 + sin^2 = 1 in float32 (the angles' precision)
    torch.testing.assert_close(ours.apply(got, cos, sin, inverse=True), x, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, x, rtol=1e-3, atol=1e-3)  # and it did rotate
