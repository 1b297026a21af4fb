"""Loading Hugging Face attention weights: validation lists every bad key and loads nothing; folds; reloads in
place; construction and forward arguments are validated."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from layer_cases import (
    hf_attention,
    tiny_config,
)

from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.loading.hf import StateDictError, expected_hf_shapes, random_hf_state_dict
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(**kw):
    return MLAAttention.from_hf_config(tiny_config(**kw), dtype=torch.float64)


def _snapshot(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()} | {"W_UK_T": layer.W_UK_T.clone(),
                                                                    "W_UV": layer.W_UV.clone()}


def test_bad_state_dict_lists_every_problem_and_loads_nothing():
    layer = _layer()
    good = hf_attention(tiny_config()).state_dict()
    layer.load_hf_state_dict(good)
    before = _snapshot(layer)
    bad = {k: torch.randn_like(v) for k, v in good.items()}  # different values: partial loads would show
    del bad["kv_b_proj.weight"]
    bad["o_proj.weight"] = torch.randn(3, 3, dtype=torch.float64)
    bad["rotary_emb.inv_freq"] = torch.randn(4)
    with pytest.raises(StateDictError) as info:
        layer.load_hf_state_dict(bad)
    msg = str(info.value)
    assert "kv_b_proj.weight" in msg and "missing" in msg
    assert "rotary_emb.inv_freq" in msg and "unexpected" in msg
    assert "o_proj.weight (got shape [3, 3]; supported [32, 48])" in msg
    assert info.value.missing == ["kv_b_proj.weight"]
    assert info.value.unexpected == ["rotary_emb.inv_freq"]
    after = _snapshot(layer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed weights"


def test_non_tensor_and_integer_values_are_rejected():
    layer = _layer(q_lora_rank=None)
    sd = random_hf_state_dict(layer.dims, dtype=torch.float64)
    sd["kv_a_layernorm.weight"] = [1.0] * 16
    sd["q_proj.weight"] = sd["q_proj.weight"].long()
    with pytest.raises(StateDictError, match="kv_a_layernorm.weight .got list.*|q_proj.weight .got dtype"):
        layer.load_hf_state_dict(sd)


def test_folds_and_in_place_reload():
    layer = _layer()
    sd1 = hf_attention(tiny_config(), seed=1).state_dict()
    layer.load_hf_state_dict(sd1)
    ptrs = {k: v.data_ptr() for k, v in layer.state_dict().items()} | {"W_UK_T": layer.W_UK_T.data_ptr(),
                                                                       "W_UV": layer.W_UV.data_ptr()}
    H, P, V = 4, 8, 12
    w = sd1["kv_b_proj.weight"]
    for h in range(H):  # transformers' layout: per head, W_UK rows then W_UV rows
        base = h * (P + V)
        torch.testing.assert_close(layer.W_UK_T[h], w[base: base + P])
        torch.testing.assert_close(layer.W_UV[h], w[base + P: base + P + V].T)
    assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
    sd2 = hf_attention(tiny_config(), seed=2).state_dict()
    layer.load_hf_state_dict({"model.layers.0.self_attn." + k: v for k, v in sd2.items()},
                             prefix="model.layers.0.self_attn.")
    new_ptrs = {k: v.data_ptr() for k, v in layer.state_dict().items()} | {"W_UK_T": layer.W_UK_T.data_ptr(),
                                                                           "W_UV": layer.W_UV.data_ptr()}
    assert new_ptrs == ptrs
    torch.testing.assert_close(layer.W_UK_T[0], sd2["kv_b_proj.weight"][:P])
    torch.testing.assert_close(layer.o_proj.weight, sd2["o_proj.weight"])


def test_tp_rank_takes_its_heads():
    cfg = tiny_config(attention_bias=True)
    sd = hf_attention(cfg).state_dict()
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64, tp_rank=1, tp_size=2)
    layer.load_hf_state_dict(sd)
    assert layer.dims.num_heads == 2
    qk, P, V = 16, 8, 12
    torch.testing.assert_close(layer.q_b_proj.weight, sd["q_b_proj.weight"][2 * qk: 4 * qk])
    torch.testing.assert_close(layer.kv_b_proj.weight, sd["kv_b_proj.weight"][2 * (P + V): 4 * (P + V)])
    torch.testing.assert_close(layer.o_proj.weight, sd["o_proj.weight"][:, 2 * V: 4 * V])
    torch.testing.assert_close(layer.kv_a_proj_with_mqa.weight, sd["kv_a_proj_with_mqa.weight"])
    torch.testing.assert_close(layer.W_UV[1], sd["kv_b_proj.weight"][3 * (P + V) + P: 4 * (P + V)].T)


def test_expected_shapes_for_deepseek_v3():
    shapes = expected_hf_shapes(MLADims.deepseek_v3())
    assert shapes["q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes["kv_b_proj.weight"] == (128 * 256, 512)
    assert shapes["o_proj.weight"] == (7168, 128 * 128)
    # a per-rank view still expects full checkpoint tensors
    assert expected_hf_shapes(MLADims.deepseek_v3().tensor_parallel(8)) == shapes


def test_construction_arguments_are_validated():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="tp_size: got 3"):
        MLAAttention.from_hf_config(cfg, tp_size=3)
    for bad in (0, "2", True):
        with pytest.raises((ValueError, TypeError), match="tp_size: got"):
            MLAAttention.from_hf_config(cfg, tp_size=bad)
    for rope in (0, 7):
        with pytest.raises(ValueError, match=f"qk_rope_head_dim: got {rope}; supported an even width >= 2"):
            MLAAttention(replace(MLADims.from_hf_config(cfg), qk_rope_head_dim=rope))
    with pytest.raises(ValueError, match="tp_rank: got 2"):
        MLAAttention.from_hf_config(cfg, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="dtype: got 'int8'"):
        MLAAttention.from_hf_config(cfg, dtype="int8")
    with pytest.raises(ValueError, match="backend: got 'NOPE'"):
        MLAAttention.from_hf_config(cfg, backend="NOPE")
    with pytest.raises(ValueError, match="dispatch: got 'fastest'"):
        MLAAttention.from_hf_config(cfg, dispatch="fastest")
    with pytest.raises(ValueError, match="workspace_rows: got 0"):
        MLAAttention.from_hf_config(cfg, workspace_rows=0)
    layer = MLAAttention.from_hf_config(cfg, backend="ref_torch")
    assert layer.backend_cls.name == "REF_TORCH" and layer.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype: got 'int4'"):
        layer.allocate_cache(4, 16, "int4")


def test_forward_arguments_are_validated():
    layer = _layer()
    cache = layer.allocate_cache(4, 4)
    meta = BatchMetadata.build([3], [0], [[0]], 4)
    x = torch.randn(3, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not loaded"):
        layer(x, torch.arange(3), cache, plan_step(meta, [layer]))
    layer.load_hf_state_dict(random_hf_state_dict(layer.dims, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"hidden_states: got shape \[2, 32\]"):
        layer(x[:2], torch.arange(3), cache, plan_step(meta, [layer]))
    with pytest.raises(TypeError, match="hidden_states: got dtype float32"):
        layer(x.float(), torch.arange(3), cache, plan_step(meta, [layer]))
    with pytest.raises(TypeError, match="positions: got dtype float64"):
        layer(x, torch.arange(3.0, dtype=torch.float64), cache, plan_step(meta, [layer]))
    with pytest.raises(ValueError, match="meta.block_size: got 8"):
        layer(x, torch.arange(3), cache, plan_step(BatchMetadata.build([3], [0], [[0]], 8), [layer]))
    with pytest.raises(TypeError, match="cache: got dict"):
        layer(x, torch.arange(3), {}, plan_step(meta, [layer]))
    assert torch.isfinite(layer(x, None, cache, plan_step(meta, [layer]))).all()
