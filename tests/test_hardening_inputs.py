"""Issue 21, hostile input to the data-path entry points: one test per fault class.

Each checks the exception type, that the message names the argument, and that no state changed (tensors
compared before and after).
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.prefill import forward_mha
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

R, ROPE, H, BS, N, V = 512, 64, 4, 16, 32, 32


def _raises(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"message does not name {name!r}: {info.value}"
    return str(info.value)


@pytest.fixture
def step():
    """Two decode requests (contexts 20 and 5) on an 8-page float32 cache of random rows."""
    g = torch.Generator().manual_seed(0)
    cache = LatentKVCache(8, BS, R, ROPE, model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 1], [20, 5], torch.tensor([[3, 6], [1, -1]]), BS, num_blocks=8)
    return cache, meta, torch.randn(2, H, R, generator=g), torch.randn(2, H, ROPE, generator=g)


def test_scales_must_be_finite_and_positive_everywhere(step):
    """Class: scales (forward_mqa, forward_mha, the fp8 cache scale)."""
    cache, meta, q_latent, q_rope = step
    before = cache.data.clone()
    for bad in (math.inf, -math.inf, math.nan, 0.0, "0.1", None, torch.tensor(0.1)):
        _raises(ValueError, "scale", RefTorchBackend().forward_mqa, q_latent, q_rope, cache, meta, scale=bad)
    q = torch.randn(2, H, N + ROPE)
    kv_b = torch.randn(H * (N + V), R)
    for bad in (math.nan, math.inf, "x", -1.0, True):
        _raises(ValueError, "scale", forward_mha, q, q_latent[:, 0], q_rope[:, 0], cache, meta, kv_b, scale=bad)
    fp8 = LatentKVCache(2, BS, R, ROPE, kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32, scale=0.5)
    for bad in (torch.tensor([2.0, 3.0]), torch.tensor(math.inf), math.nan, -2.0, "2"):
        _raises(ValueError, "scale", fp8.set_scale, bad)
        _raises(ValueError, "scale", LatentKVCache, 2, BS, R, ROPE, kv_cache_dtype="fp8_e4m3", scale=bad)
    assert fp8.scale_value == 0.5 and torch.equal(cache.data, before)
    fp8.set_scale(torch.tensor([2.0]))  # a one-element tensor is fine
    assert fp8.scale_value == 2.0


def test_device_strings_are_checked_once_for_every_entry_point():
    """Class: device arguments ('bogus', 'cuda' without CUDA, an index past the last GPU, a wrong type)."""
    cuda_bad = "cuda:99" if torch.cuda.is_available() else "cuda"
    dims = MLADims(num_heads=2, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                   q_lora_rank=None, hidden_size=64, num_layers=1)
    for bad, exc in (("bogus", ValueError), (cuda_bad, ValueError), ("mps", ValueError), (1.5, TypeError)):
        _raises(exc, "device", LatentKVCache, 2, BS, R, ROPE, device=bad)
        _raises(exc, "device", BatchMetadata.build, [1], [3], [[0]], BS, device=bad)
        _raises(exc, "device", MLAAttention, dims, backend="REF_TORCH", dtype=torch.float32, device=bad)


def test_metadata_never_wraps_or_overflows(step):
    """Class: metadata values that do not fit its int32 tensors, and non-integer tables."""
    build = BatchMetadata.build
    _raises(ValueError, "block_table", build, [1], [3], torch.tensor([[2**31]]), BS)
    _raises(ValueError, "block_table", build, [1], [3], [[2**31 + 5]], BS)
    _raises(ValueError, "context_lens[0]", build, [1], [2**31 - 1], [[0]], BS)  # + 1 new token
    _raises(ValueError, "context_lens[1]", build, [1, 1], [0, 2**31], [[0], [0]], BS)
    _raises(ValueError, "block_table", build, [1], [3], torch.tensor([[1 + 0j]]), BS)
    _raises(ValueError, "block_table", build, [1], [3], torch.tensor([[True]]), BS)
    _raises(TypeError, "block_table[0][0]", build, [1], [3], [[1.7]], BS)
    _raises(TypeError, "block_table[0][0]", build, [1], [3], [[True]], BS)
    _raises(ValueError, "query_lens", build, torch.tensor([True]), [3], [[0]], BS)


def test_outputs_may_not_alias_inputs(step):
    """Class: aliasing outputs (out over the cache or the queries, lse_out over out). (Repeated top-k positions:
    tests/test_sparse_repeats.py.)"""
    cache, meta, q_latent, q_rope = step
    fwd = RefTorchBackend().forward_mqa
    before = cache.data.clone()
    in_cache = cache.data.view(-1)[: 2 * H * R].view(2, H, R)
    msg = _raises(ValueError, "out", fwd, q_latent, q_rope, cache, meta, scale=0.1, out=in_cache)
    assert "cache" in msg
    _raises(ValueError, "out", fwd, q_latent, q_rope, cache, meta, scale=0.1, out=q_latent)
    out = torch.zeros(2, H, R)
    lse_in_out = out.view(-1)[: 2 * H].view(2, H)
    _raises(ValueError, "lse_out", fwd, q_latent, q_rope, cache, meta, scale=0.1, out=out, lse_out=lse_in_out)
    assert torch.equal(cache.data, before) and not out.any()
    q = torch.randn(2, H, N + ROPE)
    kv_b = torch.randn(H * (N + V), R)
    _raises(ValueError, "out", forward_mha, q, q_latent[:, 0], q_rope[:, 0], cache, meta, kv_b, scale=0.1,
            out=cache.data.view(-1)[: 2 * H * V].view(2, H, V))
    assert torch.equal(cache.data, before)


def test_the_overlap_rule_on_views_empties_and_meta_tensors():
    """The aliasing rule itself (``require_separate``, which ``forward_mqa`` runs on every call): byte spans of
    strided views, empty and meta tensors never overlap, outputs are checked against earlier outputs first."""
    from mla_backends.core.validation import require_separate, tensors_overlap

    base = torch.zeros(4, 8)
    assert tensors_overlap(base[:, :2], base[:, 6:])  # interleaved columns: spans meet (conservative)
    assert not tensors_overlap(base[:2], base[2:])  # disjoint rows
    assert tensors_overlap(base[1:3].t(), base[2])  # a transposed view still covers its rows' bytes
    assert not tensors_overlap(base[:0], base)  # empty: no memory
    assert not tensors_overlap(torch.empty(4, device="meta"), torch.empty(4, device="meta"))
    require_separate({"out": base[:2], "lse_out": base[2:, :4]}, {"q": base[3:3], "k": None})
    msg = _raises(ValueError, "lse_out", require_separate, {"out": base[1, :2], "lse_out": base[1, 1:6]},
                  {"cache": base[1, 4:]})  # overlaps out and the cache: out is named, as the earlier output
    assert "sharing memory with out" in msg
    msg = _raises(ValueError, "out", require_separate, {"out": base[3]}, {"q": base[:1], "cache": base[2:]})
    assert "with cache" in msg


def test_loading_weights_is_all_or_nothing():
    """Class: a state dict that fails part-way (a meta tensor, say) leaves every parameter and fold as it was."""
    from mla_backends.loading.hf import StateDictError, fold_kv_b, random_hf_state_dict

    dims = MLADims(num_heads=2, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                   q_lora_rank=32, hidden_size=64, num_layers=1)
    layer = MLAAttention(dims, backend="REF_TORCH", dtype=torch.float32)
    layer.load_hf_state_dict(random_hf_state_dict(dims, seed=1))
    before = {k: v.clone() for k, v in layer.state_dict(keep_vars=False).items()}
    before.update(W_UK_T=layer.W_UK_T.clone(), W_UV=layer.W_UV.clone())
    new = random_hf_state_dict(dims, seed=2)
    last = list(new)[-1]  # everything before it would be copied one by one
    new[last] = torch.empty(new[last].shape, device="meta")
    _raises(StateDictError, last, layer.load_hf_state_dict, new)
    assert issubclass(StateDictError, ValueError)
    after = {k: v for k, v in layer.state_dict().items()}
    after.update(W_UK_T=layer.W_UK_T, W_UV=layer.W_UV)
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by a failed load"
    w_uk_t, w_uv = fold_kv_b(layer.kv_b_proj.weight, 2, 16, 16)
    assert torch.equal(layer.W_UK_T, w_uk_t) and torch.equal(layer.W_UV, w_uv)
