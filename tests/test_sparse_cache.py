"""The DeepSeek-V3.2 indexer key cache: 132 bytes per token, blockwise fp8 vs float references, paging."""

from __future__ import annotations

import pytest
import torch

from mla_backends import LatentKVCache, MLADims
from mla_backends.layer.sparse import IndexerKeyCache, dequantize_fp8_blockwise, quantize_fp8_blockwise
from mla_backends.layer.sparse.indexer_cache import indexer_bytes_per_token, pack_rows, unpack_rows

E4M3_MAX = 448.0


pytestmark = pytest.mark.usefixtures("one_thread")


def _ref_scales(x: torch.Tensor) -> torch.Tensor:
    """Float64 reference: one scale per 128 values, max |x| / 448."""
    return x.double().reshape(*x.shape[:-1], -1, 128).abs().amax(-1) / E4M3_MAX


def test_v32_cache_is_132_bytes_per_token_uint8_rows():
    cache = IndexerKeyCache.allocate(MLADims.deepseek_v32(), num_blocks=3, block_size=64)
    assert cache.bytes_per_token == 132
    assert cache.data.dtype == torch.uint8
    assert tuple(cache.data.shape) == (3, 64, 132)
    assert indexer_bytes_per_token(128) == 132
    assert indexer_bytes_per_token(256) == 264  # one more block: 128 values + 4 scale bytes


def test_cost_model_agrees_on_132_bytes_and_counts_only_indexing_layers():
    costs = pytest.importorskip("mla_backends.planning.costs",
                                reason="the cost model (mla_backends/planning/costs.py) is absent")
    dims = MLADims.deepseek_v32()
    cache = IndexerKeyCache.allocate(dims, 1, 16)
    assert costs.indexer_bytes_per_token_per_layer(dims) == cache.bytes_per_token == 132
    assert costs.indexer_bytes_per_token(dims) == 132 * 61
    skipping = MLADims.from_hf_config({
        "num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "hidden_size": 7168, "num_hidden_layers": 12, "index_topk": 2048,
        "index_topk_freq": 4, "index_skip_topk_offset": 3,
    })
    indexing = [i for i in range(12) if skipping.indexer.indexes(i)]
    assert indexing == [0, 1, 2, 6, 10]
    assert costs.indexing_layers(skipping) == len(indexing)
    assert costs.indexer_bytes_per_token(skipping) == 132 * len(indexing)


@pytest.mark.parametrize("shape", [(7, 128), (3, 2, 256)])
def test_quantize_matches_float_reference(shape):
    g = torch.Generator().manual_seed(1)
    spread = torch.logspace(-3, 2, shape[-1], dtype=torch.float64)  # magnitudes over five decades
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * spread
    values, scales = quantize_fp8_blockwise(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    ref_scale = _ref_scales(x)
    torch.testing.assert_close(scales.double(), ref_scale, rtol=1e-6, atol=0)
    # every code is the float reference x / scale rounded to e4m3 (ties may land one code either side)
    per_value_scale = scales.double().repeat_interleave(128, dim=-1)
    ideal = x / per_value_scale
    got = values.double()
    assert got.abs().max() <= E4M3_MAX
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4 for normals, absolute 2**-10 below 2**-6
    bound = torch.maximum(ideal.abs() * 2.0**-4, torch.full_like(ideal, 2.0**-10)) * (1 + 1e-6)
    assert bool(((got - ideal).abs() <= bound).all())
    deq = dequantize_fp8_blockwise(values, scales, torch.float64)
    assert bool(((deq - x).abs() <= bound * per_value_scale).all())
    # the largest value of each block is exactly representable (x / scale = +-448)
    blocks = x.reshape(*x.shape[:-1], -1, 128)
    idx = blocks.abs().argmax(-1, keepdim=True)
    top_deq = deq.reshape(blocks.shape).gather(-1, idx)
    torch.testing.assert_close(top_deq, blocks.gather(-1, idx), rtol=1e-6, atol=0)


def test_ue8m0_scales_are_powers_of_two_at_least_amax_over_448():
    x = torch.randn(5, 256, dtype=torch.float32, generator=torch.Generator().manual_seed(2)) * 3
    _, scales = quantize_fp8_blockwise(x, scale_fmt="ue8m0")
    ref = _ref_scales(x)
    log2 = torch.log2(scales.double())
    torch.testing.assert_close(log2, log2.round(), rtol=0, atol=0)
    assert bool((scales.double() >= ref * (1 - 1e-6)).all()) and bool((scales.double() < 2 * ref).all())


def test_zero_block_round_trips_to_zero():
    values, scales = quantize_fp8_blockwise(torch.zeros(2, 128))
    assert bool((scales > 0).all())
    assert bool((dequantize_fp8_blockwise(values, scales) == 0).all())


def test_row_layout_is_values_then_float32_scale():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    values, scales = quantize_fp8_blockwise(x)
    rows = pack_rows(values, scales)
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (4, 132)
    assert torch.equal(rows[:, :128], values.view(torch.uint8))
    assert torch.equal(rows[:, 128:].contiguous().view(torch.float32), scales)
    v2, s2 = unpack_rows(rows, 128)
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s2, scales)


def test_write_uses_the_latent_cache_slots_and_skips_minus_one():
    latent = LatentKVCache(num_blocks=4, block_size=4, kv_lora_rank=16, qk_rope_head_dim=8,
                           model_dtype=torch.float32)
    cache = IndexerKeyCache.like(latent)
    assert (cache.num_blocks, cache.block_size, cache.device) == (4, 4, latent.device)
    k = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([13, 0, -1, 7, 5])
    cache.write(k, slots)
    keep = slots >= 0
    ref = dequantize_fp8_blockwise(*quantize_fp8_blockwise(k[keep]))
    torch.testing.assert_close(cache.read_slots(slots[keep]), ref, rtol=0, atol=0)
    flat = cache.data.view(-1, 132)
    written = set(slots[keep].tolist())
    untouched = [i for i in range(16) if i not in written]
    assert bool((flat[untouched] == 0).all())
    # gather follows a block-table row: positions 0..5 of a sequence on pages [1, 3]
    bt_row = torch.tensor([1, 3])
    got = cache.gather(bt_row, 6)
    pos_slots = torch.tensor([4, 5, 6, 7, 12, 13])
    torch.testing.assert_close(got, cache.read_slots(pos_slots), rtol=0, atol=0)


def test_float_storage_stores_keys_exactly():
    cache = IndexerKeyCache(2, 4, 64, storage="float64")
    assert cache.bytes_per_token == 64 * 8
    k = torch.randn(3, 64, dtype=torch.float64)
    cache.write(k, torch.tensor([1, 2, 6]))
    assert torch.equal(cache.read_slots(torch.tensor([1, 2, 6]), torch.float64), k)


def test_fp8_keys_are_close_to_float_keys():
    k = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    fp8 = IndexerKeyCache(16, 4)
    exact = IndexerKeyCache(16, 4, storage="float32")
    slots = torch.arange(64)
    fp8.write(k, slots)
    exact.write(k, slots)
    err = (fp8.read_slots(slots) - exact.read_slots(slots)).abs()
    amax = k.abs().amax(-1, keepdim=True)
    # at most half an ulp of the top binade [256, 448]: 16 units of the scale amax / 448
    assert bool((err <= amax / 448 * 16 + 1e-7).all())


@pytest.mark.parametrize("alias, canonical", [("fp8", "fp8_e4m3"), (torch.float8_e4m3fn, "fp8_e4m3"),
                                              ("bf16", "bfloat16"), ("fp32", "float32"), (torch.float16, "float16")])
def test_storage_takes_the_latent_cache_aliases(alias, canonical):
    assert IndexerKeyCache(2, 4, storage=alias).storage == canonical


@pytest.mark.parametrize(
    ("kwargs", "exc", "text"),
    [
        ({"storage": "int8"}, ValueError, "storage: got 'int8'"),
        ({"storage": "fp8_e5m2"}, ValueError, "storage: got 'fp8_e5m2'; supported fp8_e4m3 (132 bytes/token"),
        ({"storage": "auto"}, ValueError, "storage: got 'auto'"),
        ({"head_dim": 96}, ValueError, "head_dim: got 96"),
        ({"scale_fmt": "e8m0"}, ValueError, "scale_fmt: got 'e8m0'"),
        ({"num_blocks": 0}, ValueError, "num_blocks: got 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, exc, text):
    args = {"num_blocks": 2, "block_size": 4, **kwargs}
    with pytest.raises(exc, match=text.replace("(", r"\(")):
        IndexerKeyCache(**args)


def test_write_and_allocate_validate_inputs():
    cache = IndexerKeyCache(2, 4)
    with pytest.raises(ValueError, match=r"k: got shape \[3, 64\]"):
        cache.write(torch.zeros(3, 64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"slot_mapping: got values in \[0, 8\]"):
        cache.write(torch.zeros(2, 128), torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="slot_mapping: got dtype float32"):
        cache.write(torch.zeros(2, 128), torch.zeros(2))
    with pytest.raises(ValueError, match="without an indexer"):
        IndexerKeyCache.allocate(MLADims.deepseek_v3(), 2, 4)
