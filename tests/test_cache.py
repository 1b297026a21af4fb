"""``LatentKVCache``: layout, dtypes, views, writes through a slot mapping, fp8 quantisation with a scale."""

from __future__ import annotations

import pytest
import torch

from mla_backends.core.dims import MLADims
from mla_backends.step.cache import LatentKVCache

STORAGE = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def _rows(n, r=512, rope=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g).to(dtype), torch.randn(n, rope, generator=g).to(dtype)


@pytest.mark.parametrize("name,storage", list(STORAGE.items()))
def test_layout_and_storage_dtype(name, storage):
    cache = LatentKVCache.allocate(MLADims.deepseek_v3(), 6, 16, name, model_dtype=torch.bfloat16)
    assert cache.data.shape == (6, 16, 576)
    assert cache.data.dtype == storage and cache.kv_cache_dtype == name
    assert cache.row_width == 576 and cache.num_slots == 96
    assert cache.bytes_per_token == 576 * torch.tensor([], dtype=storage).element_size()
    assert cache.is_fp8 == name.startswith("fp8")
    assert cache.scale.dtype == torch.float32 and cache.scale.shape == (1,)


@pytest.mark.parametrize("model_dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                              (torch.float32, "float32"), (torch.float64, "float64")])
def test_auto_follows_model_dtype(model_dtype, name):
    cache = LatentKVCache(2, 4, 8, 4, kv_cache_dtype="auto", model_dtype=model_dtype)
    assert cache.data.dtype == model_dtype
    assert cache.kv_cache_dtype == name


def test_latent_and_rope_are_views_of_one_tensor():
    cache = LatentKVCache(3, 4, 512, 64, model_dtype=torch.float32)
    assert cache.latent.shape == (3, 4, 512) and cache.rope.shape == (3, 4, 64)
    assert cache.latent.data_ptr() == cache.data.data_ptr()
    assert cache.rope.data_ptr() == cache.data.data_ptr() + 512 * cache.data.element_size()
    cache.rope[1, 2] = 7.0
    assert bool((cache.data[1, 2, 512:] == 7.0).all()) and bool((cache.data[1, 2, :512] == 0).all())


def test_write_places_rows_at_slots_and_skips_minus_one():
    cache = LatentKVCache(4, 8, 512, 64, model_dtype=torch.float32)
    kv_c, k_pe = _rows(5)
    slots = torch.tensor([17, 0, -1, 31, 9])
    cache.write(kv_c, k_pe.unsqueeze(1), slots)  # k_pe may come as [T, 1, 64]
    flat = cache.data.view(-1, 576)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        block, offset = divmod(s, 8)
        assert torch.equal(cache.data[block, offset, :512], kv_c[t])
        assert torch.equal(cache.latent[block, offset], kv_c[t])
        assert torch.equal(cache.rope[block, offset], k_pe[t])
    written = {17, 0, 31, 9}
    untouched = [s for s in range(32) if s not in written]
    assert bool((flat[untouched] == 0).all())  # the skipped token went nowhere
    torch.testing.assert_close(cache.read_slots(torch.tensor([9, 17])), torch.cat([kv_c, k_pe], -1)[[4, 0]])


def test_gather_follows_a_scattered_block_table():
    bs, n = 4, 11
    cache = LatentKVCache(8, bs, 16, 8, model_dtype=torch.float32)
    row = torch.tensor([6, 1, 3, 7], dtype=torch.int32)
    kv_c, k_pe = _rows(n, 16, 8)
    pos = torch.arange(n)
    cache.write(kv_c, k_pe, row.long()[pos // bs] * bs + pos % bs)
    torch.testing.assert_close(cache.gather(row, n), torch.cat([kv_c, k_pe], -1), rtol=0, atol=0)
    assert torch.equal(cache.data[6, 0, :16], kv_c[0]) and torch.equal(cache.data[1, 0, :16], kv_c[4])


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_same_dtype_write_is_exact(model_dtype):
    cache = LatentKVCache(2, 16, 512, 64, model_dtype=model_dtype)
    kv_c, k_pe = _rows(10, dtype=model_dtype)
    cache.write(kv_c, k_pe, torch.arange(10, 20))
    assert torch.equal(cache.read_slots(torch.arange(10, 20)), torch.cat([kv_c, k_pe], -1))


@pytest.mark.parametrize("fmt,mant,min_sub", [("fp8_e4m3", 3, 2.0**-9), ("fp8_e5m2", 2, 2.0**-16)])
@pytest.mark.parametrize("scale", [0.37, 2.5])
def test_fp8_write_quantises_with_scale(fmt, mant, min_sub, scale):
    cache = LatentKVCache(2, 16, 512, 64, kv_cache_dtype=fmt, model_dtype=torch.bfloat16, scale=scale)
    kv_c, k_pe = _rows(20, dtype=torch.bfloat16, seed=1)
    cache.write(kv_c, k_pe, torch.arange(20))
    orig = torch.cat([kv_c, k_pe], -1).double()
    stored = cache.data.view(-1, 576)[:20].double()
    # stored holds value / scale: reading it back is stored * scale
    deq = stored * scale
    assert bool(((deq - orig).abs() <= orig.abs() * 2.0 ** -(mant + 1) + min_sub * scale / 2 + 1e-12).all())
    assert (deq - orig).abs().max() > 0  # it really is fp8
    # a value written without the scale (stored = value) would be off by the factor `scale`
    assert (stored - orig).abs().max() > 0.2
    torch.testing.assert_close(cache.read_slots(torch.arange(20), torch.float64), deq, rtol=0, atol=1e-6)
    assert cache.read_slots(torch.arange(3)).dtype == torch.bfloat16  # the model dtype by default


def test_fp8_write_saturates_instead_of_overflowing():
    cache = LatentKVCache(1, 4, 8, 4, kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32, scale=0.5)
    big = torch.full((1, 8), 1e6)
    cache.write(big, -torch.full((1, 4), 1e6), torch.tensor([0]))
    row = cache.read_slots(torch.tensor([0]), torch.float32)[0]
    assert torch.isfinite(row).all()
    assert torch.equal(row[:8], torch.full((8,), 448.0 * 0.5))  # e4m3's largest finite value, times scale
    assert torch.equal(row[8:], torch.full((4,), -224.0))


def test_scale_rules():
    cache = LatentKVCache(1, 4, 8, 4, kv_cache_dtype="fp8_e5m2", scale=0.25)
    address = cache.scale.data_ptr()
    cache.set_scale(3.0)
    assert cache.scale_value == 3.0 and cache.scale.data_ptr() == address  # in place
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            cache.set_scale(bad)
    with pytest.raises(ValueError, match="scale"):
        LatentKVCache(1, 4, 8, 4, kv_cache_dtype="bfloat16", scale=2.0)  # scales are fp8-only


def test_cache_dtype_names_and_aliases():
    assert LatentKVCache(1, 4, 8, 4, kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert LatentKVCache(1, 4, 8, 4, kv_cache_dtype=torch.float8_e5m2).kv_cache_dtype == "fp8_e5m2"
    assert LatentKVCache(1, 4, 8, 4, kv_cache_dtype="bf16").data.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LatentKVCache(1, 4, 8, 4, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="dtype"):
        LatentKVCache(1, 4, 8, 4, model_dtype="int8")
