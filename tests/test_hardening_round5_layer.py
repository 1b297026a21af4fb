"""Issue 48 class 6: the layer's cache and loading choices are the caller's.

(1) ``MLAAttention.allocate_cache(indexer_storage=...)``: fp8 indexer keys by default (132 bytes a token, as the
engines store them), the layer's own dtype with ``"auto"`` (then the top-k agrees with transformers'
``DeepseekV32Attention`` on every token and so does the output), a float dtype by name; anything else, and
anything but the default on a dense layer, is a ``ValueError`` naming ``indexer_storage`` before any allocation.
(2) ``load_hf_state_dict(whole_checkpoint, prefix=...)`` reads that layer's keys from a whole checkpoint: other
layers' keys are not unexpected, the layer's own missing or stray keys still are.
"""

from __future__ import annotations

import pytest
import torch
from layer_cases import tiny_config

from mla_backends import BatchMetadata, MLAAttention, plan_step
from mla_backends.layer.sparse import SparseKVCache
from mla_backends.loading.hf import StateDictError
from mla_backends.testing import random_hf_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- (1) the indexer key storage -------------------------------------------------------------------------------
def _v32():
    sparse_layer = pytest.importorskip("test_sparse_layer")  # transformers' DeepseekV32 and its helpers
    return sparse_layer


def test_allocate_cache_stores_indexer_keys_as_asked():
    v32 = _v32()
    layer = MLAAttention.from_hf_config(v32.v32_config(), dtype=torch.float64)
    default = layer.allocate_cache(3, 4)
    assert isinstance(default, SparseKVCache) and default.indexer_cache.storage == "fp8_e4m3"
    assert default.indexer_bytes_per_token == 132
    assert layer.allocate_cache(3, 4, indexer_storage="auto").indexer_cache.storage == "float64"
    assert layer.allocate_cache(3, 4, indexer_storage=torch.float32).indexer_cache.storage == "float32"
    assert layer.allocate_cache(3, 4, indexer_storage="bf16").indexer_cache.storage == "bfloat16"
    for bad in ("int8", "fp8_e5m2", 3):
        with pytest.raises(ValueError, match=rf"indexer_storage: got {bad!r}; supported fp8_e4m3"):
            layer.allocate_cache(3, 4, indexer_storage=bad)
    dense = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float32)
    with pytest.raises(ValueError, match="indexer_storage: got 'auto' for a dense layer"):
        dense.allocate_cache(3, 4, indexer_storage="auto")
    assert type(dense.allocate_cache(3, 4)).__name__ == "LatentKVCache"


def test_keys_in_the_layer_dtype_give_transformers_top_k_and_output():
    """fp8 keys (the default) change the top-k of some tokens here (the figures: docs/sparse.md); "auto" keys
    change none, and the output is transformers' to float64 rounding."""
    v32 = _v32()
    cfg = v32.v32_config(topk=4)
    attn = v32.hf_v32_attention(cfg)
    chosen = []
    hook = attn.indexer.register_forward_hook(lambda mod, args, out: chosen.append(out[0]))
    L, bs = 24, 4
    x = torch.randn(L, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = v32.hf_full_sequence(attn, cfg, x)
    hook.remove()
    want = [{int(p) for p in chosen[0][t] if 0 <= p <= t} for t in range(L)]  # transformers' visible picks
    differing = {}
    for storage in ("fp8_e4m3", "auto"):
        layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
        layer.load_hf_state_dict(attn.state_dict())
        cache = layer.allocate_cache(L // bs + 1, bs, indexer_storage=storage)
        meta = BatchMetadata.build([L], [0], [list(range(L // bs))], bs)
        y = layer(x, torch.arange(L), cache, plan_step(meta, [layer]))
        got = [{int(p) for p in row if p >= 0} for row in layer.last_topk_indices]
        differing[storage] = [t for t in range(L) if got[t] != want[t]]
        if storage == "auto":
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-6, f"relative error {err:.2e} against transformers"
    assert differing["auto"] == [] and differing["fp8_e4m3"], differing


# ---- (2) a whole checkpoint and a prefix -----------------------------------------------------------------------
def _checkpoint(layer: MLAAttention, layers: int = 3) -> dict[str, torch.Tensor]:
    """A whole model's dict: every layer's attention (different values each), embeddings and an MLP weight."""
    out = {"model.embed_tokens.weight": torch.randn(8, layer.dims.hidden_size), "lm_head.weight": torch.randn(8, 4)}
    for i in range(layers):
        for k, v in random_hf_state_dict(layer.dims, seed=i).items():
            out[f"model.layers.{i}.self_attn.{k}"] = v
        out[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.randn(4, layer.dims.hidden_size)
    return out


def test_a_prefix_selects_the_layer_from_a_whole_checkpoint():
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float32)
    whole = _checkpoint(layer, layers=12)  # layer 1 and layers 10, 11: "1." must not take "10."
    layer.load_hf_state_dict(whole, prefix="model.layers.1.self_attn.")
    assert torch.equal(layer.kv_a_proj_with_mqa.weight, whole["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    own = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float32)
    own.load_hf_state_dict(random_hf_state_dict(own.dims, seed=1))  # the same layer loaded from its own dict
    for name, value in own.state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), name


def test_keys_of_the_layer_itself_are_still_checked_under_a_prefix():
    layer = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float32)
    whole = _checkpoint(layer)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    missing = {k: v for k, v in whole.items() if k != "model.layers.2.self_attn.o_proj.weight"}
    with pytest.raises(StateDictError, match=r"missing keys: \['model\.layers\.2\.self_attn\.o_proj\.weight'\]") \
            as info:
        layer.load_hf_state_dict(missing, prefix="model.layers.2.self_attn.")
    assert not info.value.unexpected  # the other layers' keys are not this layer's business
    stray = {**whole, "model.layers.2.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    with pytest.raises(StateDictError, match=r"unexpected keys: \['model\.layers\.2\.self_attn\.rotary_emb"):
        layer.load_hf_state_dict(stray, prefix="model.layers.2.self_attn.")
    with pytest.raises(StateDictError, match="missing keys"):  # a prefix no key has
        layer.load_hf_state_dict(whole, prefix="model.layers.7.self_attn.")
    with pytest.raises(StateDictError, match="unexpected keys"):  # no prefix: every key must be the layer's
        layer.load_hf_state_dict(whole)
    with pytest.raises(TypeError, match="prefix: got int"):
        layer.load_hf_state_dict(whole, prefix=3)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a refused load"
