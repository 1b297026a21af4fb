"""Bad input to the foundation's entry points raises ``ValueError``/``TypeError`` naming the argument, before
anything runs: ``forward_mqa`` (through ``check_mqa_inputs``), ``LatentKVCache.write`` (which must leave the
cache untouched) and the constructors. Wrong-device cases use PyTorch's ``meta`` device, so they run on a
CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

R, ROPE, H, BS = 512, 64, 4, 16


def _table():
    return torch.tensor([[3, 6], [1, -1]], dtype=torch.int32)


@pytest.fixture
def setup():
    """Two decode requests (contexts 20 and 5) on an 8-page fp32 cache holding random rows."""
    cache = LatentKVCache(8, BS, R, ROPE, model_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 1], [20, 5], _table(), BS, num_blocks=8)
    q_latent = torch.randn(2, H, R, generator=g)
    q_rope = torch.randn(2, H, ROPE, generator=g)
    return cache, meta, q_latent, q_rope


def _raises(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"message does not name {name!r}: {info.value}"
    assert "got" in str(info.value) and "supported" in str(info.value), str(info.value)


def test_good_input_runs(setup):
    cache, meta, q_latent, q_rope = setup
    out, lse = RefTorchBackend().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)
    assert out.shape == (2, H, R) and torch.isfinite(lse).all()


def test_forward_mqa_wrong_ranks_and_widths(setup):
    cache, meta, q_latent, q_rope = setup
    fwd = RefTorchBackend().forward_mqa
    _raises(ValueError, "q_latent", fwd, q_latent[:, 0], q_rope, cache, meta, scale=0.1)  # rank 2
    _raises(ValueError, "q_latent", fwd, q_latent[..., :256], q_rope, cache, meta, scale=0.1)  # width 256
    _raises(ValueError, "q_latent", fwd, q_latent[:1], q_rope[:1], cache, meta, scale=0.1)  # 1 of 2 tokens
    _raises(ValueError, "q_rope", fwd, q_latent, q_rope[..., :32], cache, meta, scale=0.1)
    _raises(ValueError, "q_rope", fwd, q_latent, q_rope[:, :2], cache, meta, scale=0.1)  # heads disagree
    _raises(ValueError, "q_rope", fwd, q_latent, q_rope.unsqueeze(0), cache, meta, scale=0.1)


def test_forward_mqa_dtypes(setup):
    cache, meta, q_latent, q_rope = setup
    fwd = RefTorchBackend().forward_mqa
    _raises(TypeError, "q_rope", fwd, q_latent, q_rope.half(), cache, meta, scale=0.1)  # mismatched
    q_int, rope_int = q_latent.to(torch.int32), q_rope.to(torch.int32)
    _raises(TypeError, "q_latent", fwd, q_int, rope_int, cache, meta, scale=0.1)
    _raises(TypeError, "q_latent", fwd, q_latent.tolist(), q_rope, cache, meta, scale=0.1)
    _raises(TypeError, "out", fwd, q_latent, q_rope, cache, meta, scale=0.1, out=torch.empty(2, H, R).half())
    _raises(ValueError, "out", fwd, q_latent, q_rope, cache, meta, scale=0.1, out=torch.empty(2, H, ROPE))
    _raises(TypeError, "lse_out", fwd, q_latent, q_rope, cache, meta, scale=0.1,
            lse_out=torch.empty(2, H, dtype=torch.float64))


def test_forward_mqa_scale_and_objects(setup):
    cache, meta, q_latent, q_rope = setup
    fwd = RefTorchBackend().forward_mqa
    for bad in (0.0, -0.1, True, "0.1", None):
        _raises(ValueError, "scale", fwd, q_latent, q_rope, cache, meta, scale=bad)
    _raises(TypeError, "cache", fwd, q_latent, q_rope, cache.data, meta, scale=0.1)
    _raises(TypeError, "meta", fwd, q_latent, q_rope, cache, {"seq_lens": [21, 6]}, scale=0.1)


def test_forward_mqa_block_ids_outside_the_cache(setup):
    cache, _, q_latent, q_rope = setup
    small = LatentKVCache(4, BS, R, ROPE, model_dtype=torch.float32)
    fwd = RefTorchBackend().forward_mqa
    meta = BatchMetadata.build([1, 1], [20, 5], _table(), BS)
    _raises(ValueError, "block_table", fwd, q_latent, q_rope, small, meta, scale=0.1)  # block 6 of 4
    meta8 = BatchMetadata.build([1, 1], [20, 5], _table(), BS, num_blocks=8)
    _raises(ValueError, "num_blocks", fwd, q_latent, q_rope, small, meta8, scale=0.1)


def test_block_ids_are_checked_on_the_host_against_every_cache(setup):
    """The step's largest live block id is worked out once, when the step is planned (from build's host maxima;
    hand-made metadata has its table read there, once); every cache is then checked against it on the host,
    a smaller cache included, and the call reads nothing from the device."""
    from dataclasses import replace

    from mla_backends.core.host_sync import no_host_sync
    from mla_backends.step.plan import plan_step

    cache, _, q_latent, q_rope = setup
    backend = RefTorchBackend()
    meta = BatchMetadata.build([1, 1], [20, 5], _table(), BS)  # no num_blocks: build() could not check ids
    plan = plan_step(meta, [backend])
    assert plan.max_block_id == 6
    small = LatentKVCache(4, BS, R, ROPE, model_dtype=torch.float32)
    _raises(ValueError, "block_table", backend.forward_mqa, q_latent, q_rope, small, meta, scale=0.1, plan=plan)
    hand_made = replace(meta, verified_block_table=None, max_block_ids=None)  # no host maxima to trust
    hand_plan = plan_step(hand_made, [backend])  # reads the table once, here
    assert hand_plan.max_block_id == 6
    with no_host_sync():
        backend.forward_mqa(q_latent, q_rope, cache, hand_made, scale=0.1, plan=hand_plan)
    _raises(ValueError, "block_table", backend.forward_mqa, q_latent, q_rope, small, hand_made, scale=0.1,
            plan=hand_plan)


def test_forward_mqa_page_size_mismatch(setup):
    cache, _, q_latent, q_rope = setup
    meta = BatchMetadata.build([1, 1], [20, 5], torch.tensor([[3, 6, 2], [1, -1, -1]], dtype=torch.int32), 8)
    _raises(ValueError, "block_size", RefTorchBackend().forward_mqa, q_latent, q_rope, cache, meta, scale=0.1)


def test_forward_mqa_wrong_device(setup):
    cache, meta, q_latent, q_rope = setup
    fwd = RefTorchBackend().forward_mqa
    _raises(ValueError, "q_latent", fwd, q_latent.to("meta"), q_rope.to("meta"), cache, meta, scale=0.1)
    meta_elsewhere = BatchMetadata.build([1, 1], [20, 5], _table(), BS, device="meta")
    _raises(ValueError, "block_table", fwd, q_latent, q_rope, cache, meta_elsewhere, scale=0.1)
    _raises(ValueError, "out", fwd, q_latent, q_rope, cache, meta, scale=0.1,
            out=torch.empty(2, H, R, device="meta"))
    _raises(ValueError, "lse_out", fwd, q_latent, q_rope, cache, meta, scale=0.1,
            lse_out=torch.empty(2, H, device="meta"))
    _raises(ValueError, "topk_indices", fwd, q_latent, q_rope, cache, meta, scale=0.1,
            topk_indices=torch.zeros(2, 1, dtype=torch.int64, device="meta"))


def test_forward_mqa_does_not_touch_out_on_bad_input(setup):
    cache, meta, q_latent, q_rope = setup
    out = torch.full((2, H, R), 7.0)
    with pytest.raises(TypeError):
        RefTorchBackend().forward_mqa(q_latent, q_rope.half(), cache, meta, scale=0.1, out=out)
    assert bool((out == 7.0).all())


# ---- LatentKVCache.write: errors name the argument and nothing is written --------------------------------
WRITE_CASES = [
    # (label, exception, name in message, kv_c, k_pe, slot_mapping) -- each built from good pieces
    ("kv_c rank", ValueError, "kv_c", lambda c, p, s: (c[0], p, s)),
    ("kv_c width", ValueError, "kv_c", lambda c, p, s: (c[:, :500], p, s)),
    ("k_pe width", ValueError, "k_pe", lambda c, p, s: (c, p[:, :32], s)),
    ("k_pe tokens", ValueError, "k_pe", lambda c, p, s: (c, p[:2], s)),
    ("slots length", ValueError, "slot_mapping", lambda c, p, s: (c, p, s[:2])),
    ("slots float", TypeError, "slot_mapping", lambda c, p, s: (c, p, s.float())),
    ("slot too big", ValueError, "slot_mapping", lambda c, p, s: (c, p, torch.tensor([0, 1, 128]))),
    ("slot below -1", ValueError, "slot_mapping", lambda c, p, s: (c, p, torch.tensor([0, -2, 5]))),
    ("kv_c ints", TypeError, "kv_c", lambda c, p, s: (c.to(torch.int32), p, s)),
    ("kv_c list", TypeError, "kv_c", lambda c, p, s: (c.tolist(), p, s)),
    ("k_pe list", TypeError, "k_pe", lambda c, p, s: (c, p.tolist(), s)),
    ("slots list", TypeError, "slot_mapping", lambda c, p, s: (c, p, s.tolist())),
    ("kv_c device", ValueError, "kv_c", lambda c, p, s: (c.to("meta"), p.to("meta"), s.to("meta"))),
    ("slots device", ValueError, "slot_mapping", lambda c, p, s: (c, p, s.to("meta"))),
]


@pytest.mark.parametrize("label,exc,name,make", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("fmt", ["float32", "fp8_e4m3"])
def test_write_rejects_and_writes_nothing(label, exc, name, make, fmt):
    cache = LatentKVCache(8, BS, R, ROPE, kv_cache_dtype=fmt, model_dtype=torch.float32,
                          scale=0.5 if fmt.startswith("fp8") else 1.0)
    g = torch.Generator().manual_seed(1)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(cache.data.dtype))
    before = cache.data.clone()
    kv_c, k_pe = torch.randn(3, R, generator=g), torch.randn(3, ROPE, generator=g)
    slots = torch.tensor([4, 70, 9])
    _raises(exc, name, cache.write, *make(kv_c, k_pe, slots))
    assert torch.equal(cache.data.view(torch.uint8), before.view(torch.uint8)), f"{label}: the cache changed"
    cache.write(kv_c, k_pe, slots)  # the good pieces do write
    assert not torch.equal(cache.data.view(torch.uint8), before.view(torch.uint8))


# ---- constructors: non-int and out-of-range sizes ------------------------------------------------------
def test_cache_constructor_arguments():
    _raises(TypeError, "num_blocks", LatentKVCache, 4.0, 16)
    _raises(ValueError, "num_blocks", LatentKVCache, 0, 16)
    _raises(TypeError, "block_size", LatentKVCache, 4, True)
    _raises(ValueError, "block_size", LatentKVCache, 4, -16)
    _raises(TypeError, "kv_lora_rank", LatentKVCache, 4, 16, "512")
    _raises(ValueError, "kv_cache_dtype", LatentKVCache, 4, 16, kv_cache_dtype="fp4")
    _raises(TypeError, "dims", LatentKVCache.allocate, {"kv_lora_rank": 512}, 4, 16)


def test_metadata_non_int_and_negative():
    bt = torch.zeros(2, 2, dtype=torch.int32)
    _raises(TypeError, "context_lens", BatchMetadata.build, [1, 1], [3, "4"], bt, 4)
    _raises(TypeError, "query_lens", BatchMetadata.build, 3, [3], bt, 4)
    _raises(ValueError, "context_lens", BatchMetadata.build, [1, 1], [3, -4], bt, 4)
    _raises(TypeError, "decode_threshold", BatchMetadata.build, [1, 1], [3, 4], bt, 4, decode_threshold=1.0)
    _raises(TypeError, "num_blocks", BatchMetadata.build, [1, 1], [3, 4], bt, 4, num_blocks="8")
