"""DeepSeek-V4 attention through ``forward_mqa``: window keys, compressed keys and the per-head sink in one
softmax (REF_TORCH), against a float64 reference written out below; the declarations that refuse it elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends import BatchMetadata, LatentKVCache, RefTorchBackend, plan_step
from mla_backends.backends.capabilities import AttentionSpec
from mla_backends.backends.contract import Capabilities, MLABackend
from mla_backends.backends.v4_inputs import CompressedKeys
from mla_backends.plugins.loading import get_backend

W, H, BS, CBS = 32, 4, 4, 2  # row width, heads, token page, entries a compressed page
QUERY, CONTEXT = [1, 5, 3, 2], [9, 0, 20, 6]
ENTRIES = [3, 1, 6, 0]  # compressed entries each request holds


def _setup(dtype=torch.float64, seed=0, poison=True):
    g = torch.Generator().manual_seed(seed)
    B = len(QUERY)
    seq = [q + c for q, c in zip(QUERY, CONTEXT, strict=True)]
    pages = [-(-s // BS) for s in seq]
    nb = sum(pages) + 3
    perm = torch.randperm(nb, generator=g)  # scattered pages
    table = torch.full((B, max(pages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[k:k + n]
        k += n
    meta = BatchMetadata.build(QUERY, CONTEXT, table, BS, num_blocks=nb)
    cache = LatentKVCache(nb, BS, W, 0, model_dtype=dtype)
    cache.data.fill_(float("nan") if poison else 0.0)  # every slot no request owns stays NaN
    rows = {}
    for b in range(B):  # in the caller's order, then mapped to the processing order below
        r = torch.randn(seq[b], W, generator=g, dtype=torch.float64)
        rows[b] = r
        for p in range(seq[b]):
            cache.data[table[b, p // BS], p % BS] = r[p].to(dtype)
    cpages = [max(1, -(-e // CBS)) for e in ENTRIES]
    cnb = sum(cpages) + 2
    cperm = torch.randperm(cnb, generator=g)
    ctable = torch.full((B, max(cpages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(cpages):
        ctable[b, :n] = cperm[k:k + n]
        k += n
    ccache = LatentKVCache(cnb, CBS, W, 0, model_dtype=dtype)
    ccache.data.fill_(float("nan"))
    crows = {}
    for b in range(B):
        r = torch.randn(ENTRIES[b], W, generator=g, dtype=torch.float64)
        crows[b] = r
        for e in range(ENTRIES[b]):
            ccache.data[ctable[b, e // CBS], e % CBS] = r[e].to(dtype)
    # per token (processing order) the selected entries: some, repeated, -1 padded
    picks = []
    for tok in range(meta.num_tokens):
        b = int(meta.order[int(meta.token_request[tok])])
        e = ENTRIES[b]
        sel = [int(v) for v in torch.randint(0, e, (3,), generator=g)] if e else []
        sel = (sel + [-1] * 4)[:4]
        picks.append(sel)
    indices = torch.tensor(picks, dtype=torch.long)
    ctable_proc = ctable[meta.order]
    q = torch.randn(meta.num_tokens, H, W, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return meta, cache, ccache, ctable_proc, indices, q, sinks, rows, crows


def _reference(meta, rows, crows, indices, q, sinks, window, scale):
    """Plainly: per token, the keys it sees and one softmax with the sink in the denominator."""
    T = meta.num_tokens
    out = torch.zeros(T, H, W, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        b = int(meta.order[int(meta.token_request[t])])
        p = int(meta.token_positions[t])
        lo = 0 if window is None else max(0, p - window + 1)
        keys = [rows[b][j] for j in range(lo, p + 1)]
        keys += [crows[b][e] for e in sorted({int(v) for v in indices[t] if v >= 0})]
        k = torch.stack(keys)
        for h in range(H):
            s = (k @ q[t, h]) * scale
            z = torch.logsumexp(torch.cat([s, sinks[h:h + 1]]), 0)
            out[t, h] = torch.exp(s - z) @ k
            lse[t, h] = z
    return out, lse


@pytest.mark.parametrize("window", [1, 3, 8, None])
def test_window_compressed_and_sinks_match_the_reference(window):
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup()
    be = RefTorchBackend()
    comp = CompressedKeys(ccache, ctable, idx)
    scale = W ** -0.5
    out, lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale, sinks=sinks, window=window, compressed=comp,
                              plan=plan_step(meta, [be]))
    ref_out, ref_lse = _reference(meta, rows, crows, idx, q, sinks, window, scale)
    assert torch.isfinite(out).all()  # the NaN in unowned slots never reached it
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_without_compressed_keys_or_sinks_and_a_whole_window_it_is_dense_attention():
    meta, cache, _, _, _, q, _, _, _ = _setup(poison=False)  # the dense path's NaN rows are another issue's
    be = RefTorchBackend()
    scale = W ** -0.5
    dense, dense_lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale)
    windowed, w_lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale, window=meta.max_seq_len)
    torch.testing.assert_close(windowed, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w_lse, dense_lse, rtol=1e-12, atol=1e-12)


def test_a_sink_alone_gives_zero_output_and_its_own_lse():
    meta, cache, ccache, ctable, idx, q, sinks, _, _ = _setup()
    # a sink far above every score takes all the weight: the output goes to 0, the LSE to the sink
    big = torch.full((H,), 1e4, dtype=torch.float64)
    out, lse = RefTorchBackend().forward_mqa(q, q[..., :0], cache, meta, scale=W ** -0.5, sinks=big, window=2)
    assert out.abs().max() < 1e-300 and torch.allclose(lse, big.expand_as(lse))


def test_bfloat16_within_tolerance_of_the_float64_reference():
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup(torch.bfloat16)
    qb = q.to(torch.bfloat16)
    out, _ = RefTorchBackend().forward_mqa(qb, qb[..., :0], cache, meta, scale=W ** -0.5, sinks=sinks.float(),
                                           window=4, compressed=CompressedKeys(ccache, ctable, idx))
    rows = {b: r.to(torch.bfloat16).double() for b, r in rows.items()}
    crows = {b: r.to(torch.bfloat16).double() for b, r in crows.items()}
    ref, _ = _reference(meta, rows, crows, idx, qb.double(), sinks.float().double(), 4, W ** -0.5)
    assert (out.double() - ref).abs().max() <= 8 * 2.0 ** -7 * ref.abs().max()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sinks": torch.zeros(H + 1, dtype=torch.float64)}, "sinks: got shape"),
    ({"sinks": torch.zeros(H, dtype=torch.int64)}, "sinks: got dtype"),
    ({"window": 0}, "window: got 0"),
    ({"topk_indices": torch.zeros(11, 2, dtype=torch.long), "window": 4}, "topk_indices: got a tensor"),
])
def test_bad_v4_inputs_are_refused_by_name(kwargs, match):
    meta, cache, _, _, _, q, _, _, _ = _setup()
    with pytest.raises((TypeError, ValueError), match=match):
        RefTorchBackend().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, **kwargs)


def test_bad_compressed_keys_are_refused_before_anything_runs():
    meta, cache, ccache, ctable, idx, q, sinks, _, _ = _setup()
    be = RefTorchBackend()
    narrow = LatentKVCache(4, CBS, W - 8, 8, model_dtype=torch.float64)
    with pytest.raises(ValueError, match="compressed.cache: got rows of 24\\+8"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(narrow, ctable, idx))
    far = idx.clone()
    far[0, 0] = ctable.shape[1] * CBS  # past the request's table
    with pytest.raises(ValueError, match="compressed.indices: got entries outside"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(ccache, ctable, far))
    with pytest.raises(ValueError, match="compressed.indices: got shape"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(ccache, ctable, idx[1:]))


V4_SPEC = AttentionSpec(num_heads=64, kv_lora_rank=512, qk_rope_head_dim=0, max_query_len=2, uniform_query_len=False,
                        sinks=True, window=True, compressed=True)


@pytest.mark.parametrize("name", ["TRITON_MLA", "FLASHINFER_MLA"])
def test_backends_without_v4_say_why(name):
    reasons = [str(r) for r in get_backend(name).not_supported_reasons(V4_SPEC)]
    for want in ("sinks: got required; supported none", "sliding window: got required; supported none",
                 "compressed keys: got required; supported none"):
        assert want in reasons
    assert not RefTorchBackend.not_supported_reasons(V4_SPEC)


class _DenseOnly(MLABackend):
    """A third-party backend declaring none of V4's features (its kernel must never see V4 inputs)."""

    name = "DENSE_ONLY"
    capabilities = Capabilities(dtypes=frozenset({torch.float64}), kv_cache_dtypes=frozenset({"float64"}), cpu=True)

    def forward_mqa_kernel(self, *args, **kwargs):  # pragma: no cover - refused before it runs
        raise AssertionError("the kernel ran")


def test_forward_mqa_refuses_v4_inputs_a_backend_does_not_declare():
    meta, cache, _, _, _, q, sinks, _, _ = _setup()
    with pytest.raises(ValueError, match="sinks: got required; supported none"):
        _DenseOnly().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, sinks=sinks)
    with pytest.raises(ValueError, match="sliding window: got required"):
        _DenseOnly().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, window=4)


def test_scale_and_window_reach_the_kernel():
    """A sanity check of the reference itself: doubling the scale changes the result (the test means it)."""
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup()
    a, _ = _reference(meta, rows, crows, idx, q, sinks, 3, W ** -0.5)
    b, _ = _reference(meta, rows, crows, idx, q, sinks, 4, W ** -0.5)
    assert not torch.allclose(a, b) and math.isfinite(float(a.abs().max()))
