"""The shared expanded prefill path: forward_mha against a plain float64 expanded reference, context chunking,
the LSE merge and the workspace."""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends.layer.prefill import context_chunks, forward_mha, merge_attention_states
from mla_backends.layer.workspace import PrefillWorkspace, default_workspace_rows
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

pytestmark = pytest.mark.usefixtures("one_thread")

H, P, R, V, r = 3, 8, 4, 6, 10


def _reference(q, kv_b, rows_per_req, new_counts, scale):
    """Naive expanded MLA per request: up-project every visible latent, causal softmax, weighted sum."""
    outs = []
    w = kv_b.view(H, P + V, r)
    t = 0
    for rows, n in zip(rows_per_req, new_counts, strict=True):
        S = rows.shape[0]
        c, kpe = rows[:, :r], rows[:, r:]
        for j in range(n):
            visible = S - n + j + 1
            out_h = []
            for h in range(H):
                k = torch.cat([c[:visible] @ w[h, :P].T, kpe[:visible]], dim=1)  # [S, P + R]
                v = c[:visible] @ w[h, P:].T  # [S, V]
                s = (k @ q[t, h]) * scale
                p = torch.softmax(s, dim=0)
                out_h.append(p @ v)
            outs.append(torch.stack(out_h))
            t += 1
    return torch.stack(outs)


def _setup(ctx, new, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    pages = -(-max(c + n for c, n in zip(ctx, new, strict=True)) // block_size)
    nb = B * pages + 3
    bt = torch.randperm(nb, generator=g)[: B * pages].view(B, pages).int()
    cache = LatentKVCache(nb, block_size, r, R, model_dtype=torch.float64)
    rows = [torch.randn(c + n, r + R, generator=g, dtype=torch.float64)
            for c, n in zip(ctx, new, strict=True)]
    for b, rw in enumerate(rows):  # context rows of every request
        pos = torch.arange(ctx[b])
        slots = bt[b, pos // block_size].long() * block_size + pos % block_size
        cache.write(rw[: ctx[b], :r], rw[: ctx[b], r:], slots)
    meta = BatchMetadata.build(new, ctx, bt, block_size, decode_threshold=0)
    cache.write(torch.cat([rw[c:, :r] for rw, c in zip(rows, ctx, strict=True)]),
                torch.cat([rw[c:, r:] for rw, c in zip(rows, ctx, strict=True)]), meta.slot_mapping)
    new_rows = torch.cat([rw[c:] for rw, c in zip(rows, ctx, strict=True)])
    q = torch.randn(meta.num_tokens, H, P + R, generator=g, dtype=torch.float64)
    kv_b = torch.randn(H * (P + V), r, generator=g, dtype=torch.float64) * 0.5
    return cache, meta, rows, new_rows, q, kv_b


@pytest.mark.parametrize("workspace_rows", [3, 64, 100000])
def test_forward_mha_matches_expanded_reference(workspace_rows):
    ctx, new = [0, 9, 23], [5, 4, 3]
    cache, meta, rows, new_rows, q, kv_b = _setup(ctx, new)
    scale = (P + R) ** -0.5
    out = forward_mha(q, new_rows[:, :r], new_rows[:, r:], cache, meta, kv_b, scale=scale,
                      workspace_rows=workspace_rows)
    ref = _reference(q, kv_b, rows, new, scale)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11)


def test_chunked_context_equals_unchunked_and_workspace_is_reused():
    ctx, new = [150, 90, 0, 70], [5, 9, 4, 3]
    cache, meta, rows, new_rows, q, kv_b = _setup(ctx, new, block_size=16, seed=3)
    args = (q, new_rows[:, :r], new_rows[:, r:], cache, meta, kv_b)
    assert len(context_chunks(meta.context_lens_list, 64)) == 5  # 310 rows in chunks of 64, requests split
    whole = forward_mha(*args, scale=0.3, workspace_rows=1 << 16)
    ws = PrefillWorkspace(64)
    first = forward_mha(*args, scale=0.3, workspace=ws)
    ptr = ws.kv.data_ptr()
    second = forward_mha(*args, scale=0.3, workspace=ws)
    torch.testing.assert_close(first, whole, rtol=1e-12, atol=1e-12)
    assert torch.equal(first, second)
    assert ws.allocations == 1 and ws.kv.data_ptr() == ptr and ws.kv.shape[0] == 64


def test_fp8_context_is_dequantised():
    # the context read from an fp8 cache must be scaled back: compare against the reference on the
    # dequantised rows (the new tokens are attended at full precision, as written)
    ctx, new = [12, 7], [3, 2]
    cache, meta, rows, new_rows, q, kv_b = _setup(ctx, new)
    fp8 = LatentKVCache(cache.num_blocks, cache.block_size, r, R, kv_cache_dtype="fp8_e4m3",
                        model_dtype=torch.float64, scale=0.05)
    fp8.write(cache.data.view(-1, r + R)[:, :r], cache.data.view(-1, r + R)[:, r:],
              torch.arange(cache.num_slots))
    deq = fp8.read_slots(torch.arange(cache.num_slots)).view_as(cache.data)
    cache.data.copy_(deq)
    rows_deq = [torch.cat([cache.gather(meta.block_table[b], c), rw[c:]]) for b, (rw, c) in
                enumerate(zip(rows, ctx, strict=True))]
    out = forward_mha(q, new_rows[:, :r], new_rows[:, r:], fp8, meta, kv_b, scale=0.3, workspace_rows=5)
    torch.testing.assert_close(out, _reference(q, kv_b, rows_deq, new, 0.3), rtol=1e-10, atol=1e-10)


def test_context_chunks_split_requests():
    assert context_chunks([5, 0, 7], 4) == [[(0, 0, 4)], [(0, 4, 5), (2, 0, 3)], [(2, 3, 7)]]
    assert context_chunks([0, 0], 4) == []
    assert context_chunks([3, 1], 64) == [[(0, 0, 3), (1, 0, 1)]]
    with pytest.raises(ValueError, match="workspace_rows"):
        context_chunks([3], 0)


def test_merge_handles_empty_parts():
    o = torch.randn(2, 3, 4, dtype=torch.float64)
    lse = torch.randn(2, 3, dtype=torch.float64)
    empty_o = torch.zeros_like(o)
    empty_lse = torch.full_like(lse, -math.inf)
    mo, ml = merge_attention_states(o, lse, empty_o, empty_lse)
    torch.testing.assert_close(mo, o)
    torch.testing.assert_close(ml, lse)
    mo, ml = merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.isfinite(mo).all() and (mo == 0).all() and (ml == -math.inf).all()
    # two halves of one softmax merge into the whole
    s = torch.randn(6, dtype=torch.float64)
    v = torch.randn(6, 4, dtype=torch.float64)
    halves = [(torch.softmax(s[i:i + 3], 0) @ v[i:i + 3], torch.logsumexp(s[i:i + 3], 0)) for i in (0, 3)]
    mo, ml = merge_attention_states(halves[0][0][None, None], halves[0][1][None, None],
                                    halves[1][0][None, None], halves[1][1][None, None])
    torch.testing.assert_close(mo[0, 0], torch.softmax(s, 0) @ v)
    torch.testing.assert_close(ml[0, 0], torch.logsumexp(s, 0))


def test_default_workspace_rows():
    assert default_workspace_rows(163840, 256, 16) == 65536  # capped at 64k rows
    assert default_workspace_rows(2048, 256, 16) == 16384
    assert default_workspace_rows(100, 64, 16) == 4096  # four pages per request beats eight full requests
    assert default_workspace_rows(1000, 8, 16) == 8000
    with pytest.raises(ValueError, match="max_model_len"):
        default_workspace_rows(0, 8, 16)


def test_forward_mha_rejects_bad_inputs():
    cache, meta, rows, new_rows, q, kv_b = _setup([2], [3])
    with pytest.raises(ValueError, match="q: got shape"):
        forward_mha(q[:2], new_rows[:, :r], new_rows[:, r:], cache, meta, kv_b, scale=0.3)
    with pytest.raises(ValueError, match="kv_b_weight"):
        forward_mha(q, new_rows[:, :r], new_rows[:, r:], cache, meta, kv_b[:-1], scale=0.3)
    with pytest.raises(TypeError, match="kv_c: got dtype"):
        forward_mha(q, new_rows[:, :r].float(), new_rows[:, r:], cache, meta, kv_b, scale=0.3)
    with pytest.raises(TypeError, match="cache"):
        forward_mha(q, new_rows[:, :r], new_rows[:, r:], None, meta, kv_b, scale=0.3)


def test_context_chunks_fill_every_chunk_but_the_last():
    # a chunk closes only when exactly full: the second request tops up the first chunk
    assert context_chunks([3, 2], 4) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 2)]]
    assert context_chunks([1, 1, 1], 1) == [[(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1)]]
    chunks = context_chunks([7, 5, 9], 6)
    assert [sum(z - a for _, a, z in c) for c in chunks] == [6, 6, 6, 3]


# ---- the prefill kernel: torch's fused CPU flash attention and the plain path ------------------------------

def _naive_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal):
    """float64, one head and one query at a time: 192-wide key = [k_nope_h | k_pe], softmax, weighted sum."""
    n, heads, _ = q_nope.shape
    m = k_nope.shape[0]
    o = torch.zeros(n, heads, v.shape[2], dtype=torch.float64)
    lse = torch.zeros(n, heads, dtype=torch.float64)
    for i in range(n):
        seen = i + (m - n) + 1 if causal else m
        for h in range(heads):
            k = torch.cat([k_nope[:seen, h].double(), k_pe[:seen].double()], dim=1)
            s = (k @ torch.cat([q_nope[i, h], q_pe[i, h]]).double()) * scale
            o[i, h] = torch.softmax(s, 0) @ v[:seen, h].double()
            lse[i, h] = torch.logsumexp(s, 0)
    return o, lse


def _attention_inputs(n, m, dtype, v_width=V, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return t(n, H, P), t(n, H, R), t(m, H, P), t(m, R), t(m, H, v_width)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls into torch's fused CPU kernel (the test fails if the fused path stops being taken)."""
    from mla_backends.layer import prefill

    kernel = prefill.fused_prefill_kernel()
    if kernel is None:
        pytest.skip(f"torch {torch.__version__} has no fused CPU flash attention kernel")
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])  # keys in this call
        return kernel(*args, **kwargs)

    monkeypatch.setattr(prefill, "fused_prefill_kernel", lambda: spy)
    return calls


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n, m, causal, v_width", [
    (1, 1, True, V), (7, 7, True, V), (64, 64, True, V),  # new tokens among themselves
    (5, 1, False, V), (5, 37, False, V), (3, 300, False, V),  # queries over a context chunk
    (9, 9, True, 2 * (P + R)), (4, 20, False, 2 * (P + R)),  # value wider than the key: q/k padded instead
])
def test_fused_cpu_kernel_matches_naive_float64(n, m, causal, v_width, dtype, tol, fused_calls):
    from mla_backends.layer.prefill import prefill_attention

    args = _attention_inputs(n, m, dtype, v_width, seed=n * 1000 + m)
    o, lse = prefill_attention(*args, 0.3, causal=causal)
    ref_o, ref_lse = _naive_attention(*args, 0.3, causal)
    assert fused_calls == [m]
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.shape == (n, H, v_width)
    torch.testing.assert_close(o.double(), ref_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_fused_kernel_blocks_queries_and_keys_and_merges_them(monkeypatch, fused_calls):
    from mla_backends.layer import prefill

    monkeypatch.setattr(prefill, "FUSED_KV_BYTES", 2 * H * (P + R) * 4 * 50)  # 50 rows per block / chunk
    args = _attention_inputs(6, 173, torch.float32, seed=4)
    o, lse = prefill.prefill_attention(*args, 0.25, causal=False)
    assert fused_calls == [50, 50, 50, 23]  # one query block, four key chunks
    ref_o, ref_lse = _naive_attention(*args, 0.25, False)
    torch.testing.assert_close(o.double(), ref_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)
    fused_calls.clear()
    args = _attention_inputs(120, 70, torch.float32, seed=6)
    o, lse = prefill.prefill_attention(*args, 0.25, causal=False)
    assert fused_calls == [50, 20] * 3  # three query blocks, each over two key chunks
    torch.testing.assert_close(o.double(), _naive_attention(*args, 0.25, False)[0], rtol=2e-5, atol=2e-5)
    # causal: each query block sees the blocks before it unmasked, then its own diagonal block masked
    fused_calls.clear()
    args = _attention_inputs(120, 120, torch.float32, seed=5)
    o, lse = prefill.prefill_attention(*args, 0.25, causal=True)
    assert fused_calls == [50, 50, 50, 50, 50, 20]
    ref_o, ref_lse = _naive_attention(*args, 0.25, True)
    torch.testing.assert_close(o.double(), ref_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


def test_fused_kernel_dispatch_rules(fused_calls):
    from mla_backends.layer.prefill import fused_applies, prefill_attention

    f64 = _attention_inputs(4, 4, torch.float64)
    o, _ = prefill_attention(*f64, 0.3, causal=True)  # float64 keeps the plain path, exactly
    assert fused_calls == []
    torch.testing.assert_close(o, _naive_attention(*f64, 0.3, True)[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="fused: got True; .*dtype float64"):
        prefill_attention(*f64, 0.3, causal=True, fused=True)
    f32 = _attention_inputs(3, 8, torch.float32)
    with pytest.raises(ValueError, match="causal with 3 queries over 8 keys"):
        prefill_attention(*f32, 0.3, causal=True, fused=True)
    with pytest.raises(TypeError, match="fused: got int; supported None, True or False"):
        prefill_attention(*f32, 0.3, causal=False, fused=0)
    o_plain, _ = prefill_attention(*f32, 0.3, causal=True, fused=False)
    o_auto, _ = prefill_attention(*f32, 0.3, causal=True)  # bottom-right causal, n != m: plain
    assert fused_calls == [] and torch.equal(o_plain, o_auto)
    torch.testing.assert_close(o_auto.double(), _naive_attention(*f32, 0.3, True)[0], rtol=2e-5, atol=2e-5)
    assert "device meta" in fused_applies(torch.empty(1, device="meta"), 1, 1, False)


def test_forward_mha_float32_runs_the_fused_kernel_and_matches_the_reference(fused_calls):
    ctx, new = [0, 9, 23], [5, 4, 3]
    cache, meta, rows, new_rows, q, kv_b = _setup(ctx, new, seed=7)
    c32 = LatentKVCache(cache.num_blocks, cache.block_size, r, R, model_dtype=torch.float32)
    c32.data.copy_(cache.data)
    out = forward_mha(q.float(), new_rows[:, :r].float(), new_rows[:, r:].float(), c32, meta, kv_b.float(),
                      scale=0.3, workspace_rows=10)
    assert sorted(fused_calls) == sorted([5, 4, 3] + [9, 1, 10, 10, 2])  # causal parts, 10-row context chunks
    ref = _reference(q, kv_b, [rw.float().double() for rw in rows], new, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, m", [(7, 7), (5, 12)])
def test_plain_attention_in_query_slices_matches_the_reference(causal, n, m):
    """A ``budget`` of two queries' scores: every slice after the first keeps its causal offset."""
    from mla_backends.layer.prefill import prefill_attention

    args = _attention_inputs(n, m, torch.float64, seed=n * 100 + m)
    o, lse = prefill_attention(*args, 0.3, causal=causal, fused=False, budget=2 * H * m)  # slices of 2 queries
    ref_o, ref_lse = _naive_attention(*args, 0.3, causal)
    torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_a_workspace_first_filled_under_inference_mode_serves_later_calls_outside_it():
    """mla-backends tune runs under torch.inference_mode(); the shared workspace it grows must stay usable by a
    layer called afterwards outside that mode (an inference tensor cannot be written there)."""
    ws = PrefillWorkspace(8)
    with torch.inference_mode():
        lat, kv = ws.buffers(4, 6, torch.float32, torch.device("cpu"))
    assert not lat.is_inference() and not kv.is_inference()
    lat2, kv2 = ws.buffers(4, 6, torch.float32, torch.device("cpu"))
    lat2.zero_()
    kv2.copy_(torch.ones_like(kv2))
