"""DeepSeek's fp8 cache records (``fp8_ds_mla``): V4's 584-byte and V3.2's 656-byte rows written byte for byte as
the plain writer of ``tests/fp8_records.py`` (vLLM's writers' rules) writes them, read back exactly, attended by
REF_TORCH and TRITON_MLA (interpreted) as a float64 reference over the stored values says, and their decode error
against bf16 rows (``benchmarks/v4_fp8_records_error.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_records import decode_dsmla_record, decode_v4_row, dsmla_record, v4_page_bytes

from mla_backends import BatchMetadata, LatentKVCache, RefTorchBackend
from mla_backends.backends.capabilities import AttentionSpec
from mla_backends.backends.v4_inputs import CompressedKeys
from mla_backends.layer.v4 import RowFormat
from mla_backends.plugins.loading import get_backend
from mla_backends.step.records import DSMLA_RECORD, V4_RECORD, RecordCache
from mla_backends.triton_mla import TritonMLABackend

ROOT = Path(__file__).resolve().parent.parent


def _rows(n: int, width: int, seed: int = 0) -> torch.Tensor:
    """bf16 rows with magnitudes from 1e-6 to 1e3, a zero row, a group whose maximum is exactly 448 * 2**-3 (a
    power-of-two ratio: the exponent's boundary) and values small enough to be fp8 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.logspace(-6, 3, n)[:, None]
    x[1] = 0.0
    x[2, :64] = torch.linspace(-56.0, 56.0, 64)
    x[3, 64:128] = 1e-3
    x[3, 64] = 1.0
    return x.to(torch.bfloat16)


SLOTS = [5, 0, 9, 3, 14, 7, -1, 2]  # scattered over pages of 4 (page 3 unused, slot -1 skipped)


def test_v4_records_are_the_plain_writers_bytes_and_read_back_exactly():
    bs = 4
    cache = RecordCache(4, bs, 512, 0)
    rows = _rows(len(SLOTS), 512)
    cache.write(rows, rows[:, :0], torch.tensor(SLOTS))
    assert cache.data.shape == (4, V4_RECORD.page_bytes(bs)) == (4, 2880) and cache.row_width == 584
    for page in range(4):
        want = v4_page_bytes({s % bs: rows[i] for i, s in enumerate(SLOTS) if s >= 0 and s // bs == page}, bs)
        assert bytes(cache.data[page].tolist()) == want, f"page {page}"
    got = cache.read_slots(torch.tensor([s for s in SLOTS if s >= 0]), torch.float64)
    for k, s in enumerate(s for s in SLOTS if s >= 0):
        page = bytes(cache.data[s // bs].tolist())
        assert torch.equal(got[k], decode_v4_row(page, s % bs, bs))  # fp8 * 2**e is exact in float32
    # the bf16 tail is kept exactly; the fp8 part is within e4m3's half-ulp of the group's scale
    kept = [i for i, s in enumerate(SLOTS) if s >= 0]
    torch.testing.assert_close(got[:, 448:], rows[kept, 448:].double(), rtol=0, atol=0)
    assert bool((got[1] == 0).all())  # the zero row


def test_v32_records_are_the_plain_writers_bytes_and_read_back():
    cache = RecordCache(4, 4, 512, 64)
    rows = _rows(len(SLOTS), 576, seed=1)
    cache.write(rows[:, :512], rows[:, 512:], torch.tensor(SLOTS))
    assert cache.data.shape == (4, 4, 656) and cache.layout is DSMLA_RECORD
    for i, s in enumerate(SLOTS):
        if s >= 0:
            assert bytes(cache.data[s // 4, s % 4].tolist()) == dsmla_record(rows[i]), f"slot {s}"
    untouched = [s for s in range(16) if s not in SLOTS]
    assert all(not cache.data[s // 4, s % 4].any() for s in untouched)
    got = cache.read_slots(torch.tensor([0, 9]), torch.float64)
    for k, s in enumerate((0, 9)):
        want = decode_dsmla_record(bytes(cache.data[s // 4, s % 4].tolist()))
        torch.testing.assert_close(got[k], want, rtol=2e-7, atol=0)  # fp8 * float32 scale rounded to float32


def _v4_record_case(backend_cls, seed=0):
    """A V4 call over record caches (window 3, compressed picks, sinks) and its float64 reference over the values
    the records hold (decoded plainly from the bytes)."""
    from v4_forward_inputs import v4_reference

    g = torch.Generator().manual_seed(seed)
    query, context, bs, H = [1, 4, 2], [9, 0, 5], 4, 4
    seq = [q + c for q, c in zip(query, context, strict=True)]
    table = torch.tensor([[7, 1, 4], [2, -1, -1], [0, 6, -1]], dtype=torch.int32)
    meta = BatchMetadata.build(query, context, table, bs, num_blocks=9)
    cache, ccache = RecordCache(9, bs, 512, 0), RecordCache(4, 2, 512, 0)
    rows, crows = {}, {}
    for b in range(3):
        r = torch.randn(seq[b], 512, generator=g).to(torch.bfloat16)
        cache.write(r, r[:, :0], torch.tensor([int(table[b, p // bs]) * bs + p % bs for p in range(seq[b])]))
        pages = {int(table[b, p // bs]) for p in range(seq[b])}
        rows[b] = torch.stack([decode_v4_row(bytes(cache.data[int(table[b, p // bs])].tolist()), p % bs, bs)
                               for p in range(seq[b])])
        assert len(pages) == -(-seq[b] // bs)
    ctable = torch.tensor([[3, 0], [1, -1], [2, -1]], dtype=torch.int32)
    n_entries = [4, 2, 2]
    for b in range(3):
        e = torch.randn(n_entries[b], 512, generator=g).to(torch.bfloat16)
        cslots = torch.tensor([int(ctable[b, i // 2]) * 2 + i % 2 for i in range(n_entries[b])])
        ccache.write(e, e[:, :0], cslots)
        crows[b] = torch.stack([decode_v4_row(bytes(ccache.data[int(s) // 2].tolist()), int(s) % 2, 2)
                                for s in cslots])
    picks = torch.tensor([[0, 3, 3, -1], [1, 0, -1, -1], [1, -1, -1, -1], [0, 1, 1, 0], [0, -1, -1, -1],
                          [1, 0, -1, -1], [0, 1, -1, -1]])
    q = torch.randn(meta.num_tokens, H, 512, generator=g).to(torch.bfloat16)
    sinks = torch.randn(H, generator=g)
    be = backend_cls()
    out, lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=512 ** -0.5, sinks=sinks, window=3,
                              compressed=CompressedKeys(ccache, ctable[meta.order], picks))
    ref, ref_lse = v4_reference(meta, rows, crows, picks, q.double(), sinks.double(), 3, 512 ** -0.5)
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("backend_cls", [RefTorchBackend, TritonMLABackend])
def test_v4_attention_over_records_matches_the_float64_reference_of_the_stored_values(backend_cls):
    out, lse, ref, ref_lse = _v4_record_case(backend_cls)
    # bf16 output: within a few bf16 ulps of the largest value (the interpreter also truncates its stores)
    assert (out.double() - ref).abs().max() <= 4 * 2.0 ** -8 * ref.abs().max()
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_cls", [RefTorchBackend, TritonMLABackend])
def test_v32_dense_and_sparse_over_records_match_the_float64_reference(backend_cls):
    g = torch.Generator().manual_seed(3)
    query, context, bs, H = [1, 3], [6, 2], 4, 4
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    meta = BatchMetadata.build(query, context, table, bs, num_blocks=4)
    cache = RecordCache(4, bs, 512, 64)
    cache.data.fill_(0xFF)  # unowned records: NaN fp8 bytes and a NaN-pattern tail
    rows = {}
    for b, s in enumerate([7, 5]):
        r = torch.randn(s, 576, generator=g).to(torch.bfloat16)
        slots = [int(table[b, p // bs]) * bs + p % bs for p in range(s)]
        cache.write(r[:, :512], r[:, 512:], torch.tensor(slots))
        rows[b] = torch.stack([decode_dsmla_record(bytes(cache.data[x // bs, x % bs].tolist())) for x in slots])
    ql = torch.randn(meta.num_tokens, H, 512, generator=g).to(torch.bfloat16)
    qr = torch.randn(meta.num_tokens, H, 64, generator=g).to(torch.bfloat16)
    topk = torch.tensor([[6, 0, 2, -1], [0, 2, -1, -1], [3, 1, 0, 3], [4, -1, 0, -1]])
    be = backend_cls()
    scale = 576 ** -0.5
    for sparse in (False, True):
        out, _ = be.forward_mqa(ql, qr, cache, meta, scale=scale, topk_indices=topk if sparse else None)
        q = torch.cat([ql, qr], -1).double()
        for t in range(meta.num_tokens):
            b, p = int(meta.order[int(meta.token_request[t])]), int(meta.token_positions[t])
            keys = [int(k) for k in topk[t] if k >= 0] if sparse else list(range(p + 1))
            k = rows[b][keys]  # a repeated top-k position counts once per repeat
            w = torch.softmax(q[t] @ k.T * scale, dim=-1)
            want = w @ k[:, :512]
            assert (out[t].double() - want).abs().max() <= 4 * 2.0 ** -8 * want.abs().max(), (sparse, t)


def test_records_through_the_v4_layer_and_their_error_against_bf16():
    from v4_models import small_v4_layers

    # a layer is configured for one cache: the same weights twice (one seed), once for each cache dtype
    layers = small_v4_layers(dtype=torch.bfloat16, head_dim=512, rope=64)[:3]  # records hold rows of 512
    twins = small_v4_layers(dtype=torch.bfloat16, head_dim=512, rope=64)[:3]
    fp8 = [layer.allocate_cache(20, 8, "fp8_ds_mla") for layer in layers]
    assert isinstance(fp8[1].window, RecordCache) and isinstance(fp8[1].compressed, RecordCache)
    bf16 = [layer.allocate_cache(20, 8) for layer in twins]
    table = torch.tensor([[3, 9, 4], [0, 5, -1]], dtype=torch.int32)
    from mla_backends import plan_step

    meta = BatchMetadata.build([17, 9], [0, 0], table, 8)
    plan_a, plan_b = plan_step(meta, layers), plan_step(meta, twins)
    x = torch.randn(meta.num_tokens, layers[0].dims.hidden_size, dtype=torch.float64).to(torch.bfloat16)
    for layer, twin, a, b in zip(layers, twins, fp8, bf16, strict=True):
        ya, yb = layer(x, None, a, plan_a).double(), twin(x, None, b, plan_b).double()
        assert torch.isfinite(ya).all() and (ya - yb).norm() <= 0.1 * yb.norm()  # a few percent, measured below


def test_the_recorded_decode_error_of_records_against_bf16_rows():
    """``benchmarks/v4_fp8_records_error.py``: the figures docs/v4.md quotes, recomputed."""
    from bench_scripts import load_benchmark

    recorded = json.loads((ROOT / "benchmarks" / "results" / "v4-fp8-records-error.json").read_text())
    live = load_benchmark("v4_fp8_records_error").measure(False)
    assert live == pytest.approx(recorded["cases"]["plain"], rel=1e-6)
    assert live["fp8_ds_mla_frobenius"] < 0.05 and live["bfloat16_frobenius"] < 0.005


def test_record_caches_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="kv_lora_rank/qk_rope_head_dim: got 256/64 for an fp8_ds_mla cache"):
        RecordCache(2, 4, 256, 64)
    with pytest.raises(ValueError, match="kv_cache_dtype: got 'fp8_ds_mla', a record layout"):
        LatentKVCache(2, 4, 512, 0, kv_cache_dtype="fp8_ds_mla")
    cache = RecordCache(2, 4, 512, 0)
    with pytest.raises(ValueError, match="scale: got 2.0 for an fp8_ds_mla cache"):
        cache.set_scale(2.0)
    with pytest.raises(TypeError, match="RecordCache.latent"):
        _ = cache.latent
    assert RowFormat("fp8_ds_mla").bytes_per_row(512, torch.bfloat16) == 584
    spec = AttentionSpec(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dtype="fp8_ds_mla")
    reasons = [str(r) for r in get_backend("FLASHINFER_MLA").not_supported_reasons(spec)]
    assert any(r.startswith("kv cache dtype: got fp8_ds_mla") for r in reasons)
    assert not [r for r in RefTorchBackend.not_supported_reasons(spec)]


def test_an_engines_record_tensor_is_wrapped_without_a_copy():
    own = RecordCache(3, 4, 512, 0)
    rows = _rows(4, 512)[1:]
    own.write(rows, rows[:, :0], torch.tensor([0, 5, 11]))
    engine = torch.zeros(3, own.data.shape[1] + 64, dtype=torch.uint8)  # pages padded apart, as an engine may
    engine[:, : own.data.shape[1]] = own.data
    wrapped = RecordCache.from_tensor(engine, block_size=4)
    torch.testing.assert_close(wrapped.read_slots(torch.tensor([0, 5, 11])), own.read_slots(torch.tensor([0, 5, 11])))
    more = _rows(4, 512, seed=4)[:2]
    wrapped.write(more, more[:, :0], torch.tensor([2, -1]))  # into the engine's tensor itself
    own.write(more[:1], more[:1, :0], torch.tensor([2]))
    assert torch.equal(engine[:, : own.data.shape[1]], own.data) and not engine[:, own.data.shape[1]:].any()
