"""REF_TORCH's padded dense path (batches whose rows stay under STREAM_MIN_BYTES: one ``index_select`` of every
group's pages, two batched matmuls, a length and causal mask; index and mask tensors made once per step)
against a float64 absorbed reference written plainly here, one token and one visible position at a time.

Covered: ragged decode lengths (1, a page - 1, a page, a page + 1, several pages), a scattered block table
whose entries past each request's last page are -1 or stale ids, model dtypes and cache formats (fp8 with a
scale != 1), mixed query lengths with an empty request, the LSE, the per-step plan being built once and
reused, and no host sync once the step is prepared.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends import AttentionSpec, configure_backend
from mla_backends.ref_torch import RefTorchBackend, plans
from mla_backends.ref_torch import backend as ref_backend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step
from mla_backends.testing import no_host_sync

pytestmark = pytest.mark.usefixtures("one_thread")

H, r, R, BS = 3, 32, 8, 16
SCALE = 0.3


def naive(q, rows, context_len):
    """float64, one token and one position at a time: ``q [n, H, r + R]``, ``rows [S, r + R]`` (the request's
    positions in order). Token ``j`` sees positions ``0 .. context_len + j``; the latent (first ``r``
    columns) is the value. Returns ``(out [n, H, r], lse [n, H])``."""
    n = q.shape[0]
    out = torch.zeros(n, H, r, dtype=torch.float64)
    lse = torch.zeros(n, H, dtype=torch.float64)
    for j in range(n):
        for h in range(H):
            scores = [float(q[j, h] @ rows[p]) * SCALE for p in range(context_len + j + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for p, w in enumerate(weights):
                out[j, h] += w / total * rows[p, :r]
            lse[j, h] = top + math.log(total)
    return out, lse


def stored_rows(cache, block_row, length):
    """The rows the cache holds for one sequence, read at ``page * BS + offset`` and times the scale, float64."""
    pos = torch.arange(length)
    slots = block_row.long()[pos // BS] * BS + pos % BS
    return cache.data.reshape(-1, r + R)[slots].double() * float(cache.scale.item())


def configured(model_dtype=torch.float32, kv_cache_dtype="auto"):
    """REF_TORCH configured for this file's shapes (what a layer or an engine hands ``plan_step``)."""
    spec = AttentionSpec(num_heads=H, kv_lora_rank=r, qk_rope_head_dim=R, dtype=model_dtype,
                         kv_cache_dtype=kv_cache_dtype, block_size=BS)
    return configure_backend(RefTorchBackend, spec, SCALE)


def make_step(query_lens, context_lens, *, model_dtype=torch.float32, kv_cache_dtype="auto", scale=1.0,
              past_last_page=-1, seed=0):
    """A filled cache, a scattered block table (one spare column holding ``past_last_page`` on every row,
    and every unused entry too) and the step's queries, in processing order (``reorder=False``)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    pages = [-(-s // BS) for s in seqs]
    nb = sum(pages) + 3
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((len(seqs), max(pages) + 1), past_last_page, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[used: used + n]
        used += n
    cache = LatentKVCache(nb, BS, r, R, kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, scale=scale)
    for b, s in enumerate(seqs):
        rows = torch.randn(s, r + R, generator=g, dtype=torch.float64).to(model_dtype)
        pos = torch.arange(s)
        cache.write(rows[:, :r], rows[:, r:], bt[b].long()[pos // BS] * BS + pos % BS)
    meta = BatchMetadata.build(query_lens, context_lens, bt, BS, decode_threshold=0, reorder=False,
                               num_blocks=nb)
    q = torch.randn(sum(query_lens), H, r + R, generator=g, dtype=torch.float64).to(model_dtype)
    return cache, meta, q


def check(cache, meta, q, tol, lse_tol):
    out, lse = RefTorchBackend().forward_mqa(q[..., :r].contiguous(), q[..., r:].contiguous(), cache, meta,
                                             scale=SCALE)
    t = 0
    for b, (n, c) in enumerate(zip(meta.query_lens_list, meta.context_lens_list, strict=True)):
        if n:
            ref_o, ref_l = naive(q[t: t + n].double(), stored_rows(cache, meta.block_table[b], c + n), c)
            torch.testing.assert_close(out[t: t + n].double(), ref_o, rtol=tol, atol=tol)
            torch.testing.assert_close(lse[t: t + n].double(), ref_l, rtol=lse_tol, atol=lse_tol)
        t += n
    return out, lse


RAGGED = [0, BS - 2, BS - 1, BS, 3 * BS + 4, 40]  # contexts: sequences of 1, a page - 1, a page, a page + 1, ...


@pytest.mark.parametrize("model_dtype, kv_cache_dtype, scale, tol", [
    (torch.float32, "auto", 1.0, 2e-5),
    (torch.float64, "auto", 1.0, 1e-10),
    (torch.bfloat16, "auto", 1.0, 1e-2),  # bf16 output rounding; the math runs in float32
    (torch.float32, "fp8_e4m3", 0.37, 2e-5),  # the reference reads the stored fp8 values times the scale
    (torch.float64, "fp8_e5m2", 1.9, 1e-10),  # the scale applied in float64 (LatentKVCache.dequantize)
])
@pytest.mark.parametrize("past_last_page", [-1, 10**6])  # entries past the last page: padding or stale ids
def test_ragged_decode_matches_naive(model_dtype, kv_cache_dtype, scale, tol, past_last_page):
    cache, meta, q = make_step([1] * len(RAGGED), RAGGED, model_dtype=model_dtype, kv_cache_dtype=kv_cache_dtype,
                               scale=scale, past_last_page=past_last_page)
    assert max(meta.seq_lens_list) < ref_backend.stream_min_rows(meta.num_requests, (r + R) * 4)  # padded path
    check(cache, meta, q, tol, max(tol, 1e-6))


def test_mixed_query_lengths_and_an_empty_request():
    """Queries of 1, 3, 0 and 2 tokens in one padded group: padded token rows are dropped, each token lands
    at its own offset, and token j sees only positions up to context + j."""
    cache, meta, q = make_step([1, 3, 0, 2], [BS, BS - 3, 5, 2 * BS + 1], model_dtype=torch.float64)
    check(cache, meta, q, 1e-10, 1e-10)


def test_plan_is_made_once_per_step_and_reused(monkeypatch):
    """Every layer of a step reuses the step's groups (page ids, masks): built once, when the step is planned,
    never in a layer call, and the second call computes exactly the same numbers. An unconfigured backend
    prepares inside each call instead."""
    built = []
    inner = plans.dense_groups

    def spy(*args):
        built.append(args[1:])
        return inner(*args)

    monkeypatch.setattr(plans, "dense_groups", spy)
    cache, meta, q = make_step([1] * 4, [3, BS, 2 * BS - 1, 7])
    ql, qr = q[..., :r].contiguous(), q[..., r:].contiguous()
    layers = [configured(), configured()]  # two layers configured alike: one configured backend, one state
    assert layers[0] is layers[1]
    plan = plan_step(meta, layers)
    assert built == [(r + R, H, ref_backend.GROUP_ELEMENT_BUDGET)]  # at plan time
    first, lse1 = layers[0].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    second, lse2 = layers[1].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    assert len(built) == 1  # the layers only read the plan
    assert torch.equal(first, second) and torch.equal(lse1, lse2)
    check(cache, meta, q, 2e-5, 1e-6)  # and they are right
    next_step = BatchMetadata.build([1] * 4, [3, BS, 2 * BS - 1, 7], meta.block_table, BS)
    layers[0].forward_mqa(ql, qr, cache, next_step, scale=SCALE, plan=plan_step(next_step, layers))
    assert len(built) >= 3  # a new step builds its own (check() above ran a step of its own too)
    bare = RefTorchBackend()
    bare_plan = plan_step(meta, [bare])
    before = len(built)
    bare.forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=bare_plan)
    bare.forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=bare_plan)
    assert len(built) == before + 2  # unconfigured: nothing to prepare with when planned, so each call does


def test_group_page_ids_replace_entries_past_the_last_page():
    table = torch.tensor([[5, 9, -1], [7, 11, 123456], [4, 8, 6]], dtype=torch.int32)
    ids = plans.group_page_ids(table, (BS, BS + 1, 3 * BS), BS)
    assert ids.tolist() == [5, 0, 0, 7, 11, 0, 4, 8, 6]


@pytest.mark.parametrize("make", [configured, RefTorchBackend], ids=["configured", "unconfigured"])
def test_prepared_step_makes_no_host_sync(make):
    cache, meta, q = make_step([1, 2, 1], [BS + 1, 4, 30])
    backend = make()
    plan = plan_step(meta, [backend])  # the engine's once-per-step call
    ql, qr = q[..., :r].contiguous(), q[..., r:].contiguous()
    with no_host_sync():
        backend.forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)  # every layer reads the plan
        backend.forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)


@pytest.mark.parametrize("model_dtype, kv_cache_dtype, scale, tol", [
    (torch.float32, "auto", 1.0, 2e-5),
    (torch.bfloat16, "auto", 1.0, 1e-2),
    (torch.float32, "fp8_e4m3", 0.37, 2e-5),
])
def test_step_buffers_are_shared_by_the_layers_of_a_step(model_dtype, kv_cache_dtype, scale, tol):
    """The gathered rows and scores live in the configured backend's buffers of the calling thread: made by
    the plan or the first layer's call (under inference_mode: still normal tensors), every later call reuses
    them (outside inference_mode too), and the results are the same numbers, right against the float64
    reference."""
    cache, meta, q = make_step([1] * len(RAGGED), RAGGED, model_dtype=model_dtype, kv_cache_dtype=kv_cache_dtype,
                               scale=scale)
    ql, qr = q[..., :r].contiguous(), q[..., r:].contiguous()
    layers = [configured(model_dtype, kv_cache_dtype), configured(model_dtype, kv_cache_dtype)]
    with torch.inference_mode():
        plan = plan_step(meta, layers)
        first, lse1 = layers[0].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    state = plan.state(layers[0], meta)
    made = dict(state.buffers)
    assert made and not any(t.is_inference() for t in made.values())
    second, lse2 = layers[1].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    assert state.buffers.keys() == made.keys() and all(state.buffers[k] is v for k, v in made.items())
    assert torch.equal(first, second) and torch.equal(lse1, lse2)
    out = torch.full_like(first, float("nan"))
    layers[0].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan, out=out)
    assert torch.equal(out, first)  # written in place, every row
    t = 0
    for b, c in enumerate(meta.context_lens_list):
        ref_o, ref_l = naive(q[t: t + 1].double(), stored_rows(cache, meta.block_table[b], c + 1), c)
        torch.testing.assert_close(first[t: t + 1].double(), ref_o, rtol=tol, atol=tol)
        torch.testing.assert_close(lse1[t: t + 1].double(), ref_l, rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
        t += 1


def test_strided_out_is_filled_through_a_copy():
    """An ``out`` that is not contiguous (a column slice of a wider buffer) cannot take the matmul's result in
    place: it is filled through a copy, and the columns around it are left alone."""
    cache, meta, q = make_step([1] * 4, [2, BS - 1, BS, BS + 1])
    ql, qr = q[..., :r].contiguous(), q[..., r:].contiguous()
    wide = torch.zeros(4, H, r + 5)
    out, _ = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=SCALE, out=wide[..., 5:])
    expect, _ = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=SCALE)
    assert torch.equal(wide[..., 5:], expect) and wide[..., :5].eq(0).all()


def test_streamed_buffers_are_shared_by_the_layers_of_a_step(monkeypatch):
    """The streamed path's chunk buffers and partials also come from the step: two layers sharing a plan
    compute the same numbers (the running max / sum / accumulator are reset for each call), right against the
    float64 reference, ragged lengths (1, a page - 1, a page, a page + 1, several pages) and an fp8 scale."""
    monkeypatch.setattr(ref_backend, "STREAM_MIN_ROWS", 1)
    monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(ref_backend, "STREAM_CHUNK_BYTES", 2 * BS * (r + R) * 4)  # several chunks per request
    monkeypatch.setattr(ref_backend, "STREAM_LENGTH_RATIO", 1e9)  # one streamed run
    ctxs = [0, BS - 2, BS - 1, BS, 5 * BS + 3]
    cache, meta, q = make_step([1] * len(ctxs), ctxs, kv_cache_dtype="fp8_e4m3", scale=0.37)
    ql, qr = q[..., :r].contiguous(), q[..., r:].contiguous()
    layers = [configured(kv_cache_dtype="fp8_e4m3"), configured(kv_cache_dtype="fp8_e4m3")]
    plan = plan_step(meta, layers)
    assert layers[0].dense_parts(meta, (r + R) * 4) == [(True, 0, len(ctxs))]
    first, lse1 = layers[0].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    assert any(k[0] == "stream_acc" for k in plan.state(layers[0], meta).buffers)
    second, lse2 = layers[1].forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    assert torch.equal(first, second) and torch.equal(lse1, lse2)
    for b, c in enumerate(ctxs):
        ref_o, ref_l = naive(q[b: b + 1].double(), stored_rows(cache, meta.block_table[b], c + 1), c)
        torch.testing.assert_close(first[b: b + 1].double(), ref_o, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse1[b: b + 1].double(), ref_l, rtol=1e-5, atol=1e-5)


def test_step_buffers_are_one_per_name_grown_to_the_largest_request():
    """However many groups or runs ask, a thread keeps one buffer per name (and dtype): a larger request grows
    it, a smaller one gets a view of its start; shapes are what was asked."""
    step = plans.RefStep()
    a = step.buffer("x", (2, 3), torch.float32, torch.device("cpu"))
    b = step.buffer("x", (4, 5), torch.float32, torch.device("cpu"))
    c = step.buffer("x", (3,), torch.float32, torch.device("cpu"))
    assert a.shape == (2, 3) and b.shape == (4, 5) and c.shape == (3,)
    assert len(step.buffers) == 1 and c.data_ptr() == b.data_ptr()
    step.buffer("x", (3,), torch.float64, torch.device("cpu"))
    assert len(step.buffers) == 2


def fill_unused_rows(cache, meta, value):
    """Every cache row that holds no position of ``meta``'s sequences set to ``value`` (what a stale page or
    the tail of a last page may hold), the sequences' own rows untouched."""
    rows = cache.data.view(-1, r + R)
    keep = torch.zeros(rows.shape[0], dtype=torch.bool)
    for b, s in enumerate(meta.seq_lens_list):
        pos = torch.arange(s)
        keep[meta.block_table[b].long()[pos // BS] * BS + pos % BS] = True
    rows[~keep] = value


@pytest.mark.parametrize("streamed", [False, True])
def test_hidden_rows_add_exactly_nothing(streamed, monkeypatch):
    """Hidden positions get a weight of exactly 0, not the tiny ``exp(EXP_FLOOR)`` the clamp before the
    ``exp`` leaves: rows past every sequence hold 1e38 (their scores overflow), and the output still matches
    the float64 reference (a weight of 1.8e-35 on those rows would add about 1e3). Queries far from every
    row but one make visible weights fall below the floor too. Padded and streamed paths, decode and a
    query of 3 tokens (causal positions hidden)."""
    if streamed:
        monkeypatch.setattr(ref_backend, "STREAM_MIN_ROWS", 1)
        monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(ref_backend, "STREAM_CHUNK_BYTES", 2 * BS * (r + R) * 4)
    for qlens, ctxs in (([1] * len(RAGGED), RAGGED), ([3, 3], [BS - 1, 2 * BS + 2])):
        cache, meta, q = make_step(qlens, ctxs)
        fill_unused_rows(cache, meta, 1e38)
        q[0] *= 40.0  # the first token's weights span more than exp(EXP_FLOOR)
        assert RefTorchBackend().dense_parts(meta, (r + R) * 4)[0][0] is streamed
        out, _ = check(cache, meta, q, 2e-5, 2e-5)
        assert torch.isfinite(out).all()
