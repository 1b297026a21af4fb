"""``REF_TORCH`` ``forward_mqa`` against an independent float64 naive *expanded* MLA written in this file.

The reference never absorbs anything: it up-projects every cached latent row to per-head ``k_nope`` and ``v``
with random ``W_UK [H, 128, r]`` / ``W_UV [H, r, 128]``, concatenates the shared ``k_pe`` to every head's key,
applies the unabsorbed scale ``(128 + 64) ** -0.5``, a causal mask (new token ``j`` of a request sees
positions ``0 .. context_len + j``), a softmax and the weighted sum of values. The backend gets the absorbed
query ``q_nope @ W_UK`` and its latent-space output is folded with ``W_UV`` here. Both the value-space output
and the latent-space output / LSE are compared.

The cache rows the reference reads are the cache's stored values, dequantised here (``stored * scale``),
read at slots computed here from the block table: cache quantisation is an input to attention, not its error.
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

R_LAT, R_ROPE, P_NOPE, V_DIM = 512, 64, 128, 128
SCALE = (P_NOPE + R_ROPE) ** -0.5  # the unabsorbed scale, as a DeepSeek model computes it (no YaRN here)


# ---- the independent float64 reference ------------------------------------------------------------------
def expanded_mla(q_nope, q_pe, w_uk, w_uv, rows, context_len, scale):
    """Naive expanded MLA for one request, float64.

    q_nope ``[Q, H, 128]``, q_pe ``[Q, H, 64]``, w_uk ``[H, 128, r]``, w_uv ``[H, r, 128]``,
    rows ``[S, r + 64]`` (the request's cache rows in position order, S = context_len + Q).
    Returns ``(out_v [Q, H, 128], out_latent [Q, H, r], lse [Q, H])``.
    """
    q_nope, q_pe, w_uk, w_uv, rows = (t.double() for t in (q_nope, q_pe, w_uk, w_uv, rows))
    c, k_pe = rows[:, :R_LAT], rows[:, R_LAT:]
    k_nope = torch.einsum("sr,hpr->hsp", c, w_uk)  # [H, S, 128]  per-head keys
    v = torch.einsum("sr,hrv->hsv", c, w_uv)  # [H, S, 128]  per-head values
    H, S = k_nope.shape[0], k_nope.shape[1]
    keys = torch.cat([k_nope, k_pe.unsqueeze(0).expand(H, S, R_ROPE)], dim=-1)  # [H, S, 192]
    outs_v, outs_l, lses = [], [], []
    for j in range(q_nope.shape[0]):
        n = context_len + j + 1  # visible positions for new token j
        qj = torch.cat([q_nope[j], q_pe[j]], dim=-1)  # [H, 192]
        scores = torch.einsum("hd,hsd->hs", qj, keys[:, :n]) * scale
        m = scores.max(dim=-1, keepdim=True).values
        e = torch.exp(scores - m)
        total = e.sum(dim=-1, keepdim=True)
        p = e / total
        outs_v.append(torch.einsum("hs,hsv->hv", p, v[:, :n]))
        outs_l.append(p @ c[:n])  # latent-space output: probabilities (from expanded scores) times kv_c
        lses.append((m + torch.log(total)).squeeze(-1))
    return torch.stack(outs_v), torch.stack(outs_l), torch.stack(lses)


def dequantised_rows(cache, block_row, length):
    """The cache's stored rows of one sequence, read here: slot = page * block_size + offset, times scale."""
    pos = torch.arange(length)
    slots = block_row.long()[pos // cache.block_size] * cache.block_size + pos % cache.block_size
    stored = cache.data.reshape(-1, cache.data.shape[-1])[slots]
    return stored.double() * float(cache.scale.item())


# ---- building a scenario ----------------------------------------------------------------------------------
class Scenario:
    """Requests given in caller order, a scrambled block table, a filled cache and per-request queries."""

    def __init__(self, query_lens, context_lens, *, heads, block_size, model_dtype=torch.float32,
                 kv_cache_dtype="auto", scale=1.0, seed=0, spare_blocks=5, pad_with=-1):
        g = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens = list(query_lens), list(context_lens)
        self.heads, self.block_size, self.model_dtype = heads, block_size, model_dtype
        B = len(query_lens)
        pages = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens, strict=True)]
        num_blocks = sum(pages) + spare_blocks
        perm = torch.randperm(num_blocks, generator=g)  # scattered, non-monotonic page ids
        width = max(pages) + 1  # one spare column: entries past a sequence's pages must be ignored
        bt = torch.full((B, width), pad_with, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages):
            bt[b, :n] = perm[used: used + n]
            used += n
        self.block_table = bt
        self.cache = LatentKVCache(num_blocks, block_size, R_LAT, R_ROPE, kv_cache_dtype=kv_cache_dtype,
                                   model_dtype=model_dtype, scale=scale)
        self.meta = BatchMetadata.build(query_lens, context_lens, bt, block_size, num_blocks=num_blocks)

        def rnd(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(model_dtype)

        # whole sequences in model dtype (latent ~ N(0, 1), k_pe ~ N(0, 1) keep scores O(1))
        self.kv_c = [rnd(q + c, R_LAT) for q, c in zip(query_lens, context_lens, strict=True)]
        self.k_pe = [rnd(q + c, R_ROPE) for q, c in zip(query_lens, context_lens, strict=True)]
        self.q_nope = [rnd(q, heads, P_NOPE) for q in query_lens]
        self.q_pe = [rnd(q, heads, R_ROPE) for q in query_lens]
        # float32 draws (cheaper at 128 heads), used as float64 weights
        self.w_uk = torch.randn(heads, P_NOPE, R_LAT, generator=g).double() * R_LAT**-0.5
        self.w_uv = torch.randn(heads, R_LAT, V_DIM, generator=g).double() * R_LAT**-0.5

        # cached context rows, written at slots computed here (the engine's earlier steps)
        for b, c in enumerate(context_lens):
            if c:
                pos = torch.arange(c)
                slots = bt[b].long()[pos // block_size] * block_size + pos % block_size
                self.cache.write(self.kv_c[b][:c], self.k_pe[b][:c], slots)
        # this step's new rows, written through the metadata's slot mapping (processing order)
        new_c = torch.cat([self.kv_c[b][c:] for b, c in enumerate(context_lens)])
        new_pe = torch.cat([self.k_pe[b][c:] for b, c in enumerate(context_lens)])
        self.cache.write(self.meta.to_processing_order(new_c), self.meta.to_processing_order(new_pe),
                         self.meta.slot_mapping)

    def run(self, backend=None):
        """Absorbed path: q_latent = q_nope @ W_UK (rounded to the model dtype), forward_mqa, caller order."""
        q_nope = torch.cat(self.q_nope)  # caller order [T, H, 128]
        q_latent = torch.einsum("thp,hpr->thr", q_nope.double(), self.w_uk).to(self.model_dtype)
        q_pe = torch.cat(self.q_pe)
        meta = self.meta
        out, lse = (backend or RefTorchBackend()).forward_mqa(
            meta.to_processing_order(q_latent), meta.to_processing_order(q_pe), self.cache, meta, scale=SCALE)
        assert out.shape == q_latent.shape and out.dtype == self.model_dtype
        assert lse.shape == q_latent.shape[:2] and lse.dtype == torch.float32
        return meta.to_caller_order(out), meta.to_caller_order(lse)

    def reference(self, b):
        rows = dequantised_rows(self.cache, self.block_table[b], self.query_lens[b] + self.context_lens[b])
        # the rows really are this request's (context written here, new tokens via meta.slot_mapping)
        orig = torch.cat([self.kv_c[b], self.k_pe[b]], dim=-1).double()
        if self.cache.is_fp8:  # within fp8 rounding (half an ulp of e5m2, the coarser format)
            assert bool(((rows - orig).abs() <= 0.13 * orig.abs() + 1e-2).all()), f"request {b}: wrong rows"
        else:  # a cache narrower than the model dtype rounds once on write
            stored = orig.to(self.cache.data.dtype).double()
            assert torch.equal(rows, stored), f"request {b}: the cache does not hold its rows"
        return expanded_mla(self.q_nope[b], self.q_pe[b], self.w_uk, self.w_uv, rows, self.context_lens[b],
                            SCALE)

    def check(self, tol_v, tol_latent, tol_lse, backend=None):
        """Compare every request (caller order) with the reference; errors relative to the output's size.
        ``backend``: the instance under test (REF_TORCH by default; tests/test_cpu_fused.py passes CPU_FUSED)."""
        out, lse = self.run(backend)
        t0 = 0
        for b, q in enumerate(self.query_lens):
            if q == 0:  # nothing to attend for a request with no new tokens
                continue
            ref_v, ref_l, ref_lse = self.reference(b)
            got_l = out[t0: t0 + q].double()
            got_v = torch.einsum("thr,hrv->thv", got_l, self.w_uv)  # fold W_UV after attention
            got_lse = lse[t0: t0 + q].double()
            for what, got, ref, tol in (("value-space output", got_v, ref_v, tol_v),
                                        ("latent output", got_l, ref_l, tol_latent)):
                err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                where = f"request {b} (context {self.context_lens[b]}, query {q})"
                assert err <= tol, f"{where}: {what} rel err {err:.2e}"
            err = (got_lse - ref_lse).abs().max().item()
            assert err <= tol_lse, f"request {b}: LSE abs err {err:.2e}"
            t0 += q
        return out, lse


# ---- coverage -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("query_len", [1, 4])
def test_page_boundaries_fp32(block_size, heads, query_len):
    """Contexts 1, page-1, page and page+1 in one scrambled batch, fp32."""
    contexts = [1, max(block_size - 1, 0), block_size, block_size + 1]
    sc = Scenario([query_len] * 4, contexts, heads=heads, block_size=block_size,
                  seed=block_size * heads + query_len)
    sc.check(tol_v=1e-5, tol_latent=1e-5, tol_lse=1e-5)


@pytest.mark.parametrize("model_dtype,tol", [
    (torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("query_len", [1, 4])
def test_model_dtypes(model_dtype, tol, query_len):
    sc = Scenario([query_len] * 3, [5, 40, 97], heads=16, block_size=16, model_dtype=model_dtype, seed=7)
    sc.check(tol_v=tol, tol_latent=tol, tol_lse=tol * 2)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [0.37, 2.5])
def test_fp8_cache_with_scale(fmt, scale):
    """fp8 caches: attention reads ``stored * scale``; the quantisation itself stays within fp8 rounding."""
    sc = Scenario([1, 4, 1], [30, 17, 64], heads=16, block_size=16, model_dtype=torch.bfloat16,
                  kv_cache_dtype=fmt, scale=scale, seed=11)
    assert sc.cache.data.dtype == (torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2)
    sc.check(tol_v=3e-2, tol_latent=3e-2, tol_lse=6e-2)
    # bounded quantisation error against the unquantised rows: half an ulp relative, plus subnormal spacing
    mant, min_sub = (3, 2.0**-9) if fmt == "fp8_e4m3" else (2, 2.0**-16)
    for b, (q, c) in enumerate(zip(sc.query_lens, sc.context_lens, strict=True)):
        orig = torch.cat([sc.kv_c[b], sc.k_pe[b]], dim=-1).double()
        got = dequantised_rows(sc.cache, sc.block_table[b], q + c)
        bound = orig.abs() * 2.0 ** -(mant + 1) + min_sub * scale / 2
        assert bool(((got - orig).abs() <= bound * 1.0001).all()), f"request {b}: fp8 error beyond rounding"
        # and the rounding is real (a float cache would be exact): something differs
        assert bool((got != orig).any())


@pytest.mark.parametrize("model_dtype,block_size,query_lens,tol", [
    (torch.float32, 64, [1, 1], 1e-5),
    (torch.bfloat16, 16, [4], 3e-2),
])
def test_long_context(model_dtype, block_size, query_lens, tol):
    """A few thousand cached tokens (V3 at TP=8: 16 heads)."""
    contexts = [3001, 2048][: len(query_lens)]
    sc = Scenario(query_lens, contexts, heads=16, block_size=block_size, model_dtype=model_dtype, seed=3)
    sc.check(tol_v=tol, tol_latent=tol, tol_lse=tol * 2)


def test_ragged_mixed_batch_in_scrambled_order():
    """Decodes and prefills interleaved in the caller's order; results come back in that order."""
    qlens = [3, 1, 0, 7, 1, 2, 1]
    ctxs = [20, 65, 9, 0, 1, 33, 130]
    sc = Scenario(qlens, ctxs, heads=16, block_size=16, seed=5, pad_with=0)
    meta = sc.meta
    # decodes first, stable; the permutation is kept
    assert meta.order.tolist() == [1, 4, 6, 0, 2, 3, 5]
    assert meta.query_lens_list == (1, 1, 1, 3, 0, 7, 2)
    x = torch.arange(sum(qlens) * 2, dtype=torch.float32).view(-1, 2)
    assert torch.equal(meta.to_caller_order(meta.to_processing_order(x)), x)
    assert not torch.equal(meta.to_processing_order(x), x)
    sc.check(tol_v=1e-5, tol_latent=1e-5, tol_lse=1e-5)


def test_out_buffers_are_filled_in_place():
    sc = Scenario([1, 2], [10, 3], heads=4, block_size=16, seed=9)
    expected_out, expected_lse = sc.run()
    q_nope = torch.cat(sc.q_nope)
    q_latent = torch.einsum("thp,hpr->thr", q_nope.double(), sc.w_uk).float()
    q_pe = torch.cat(sc.q_pe)
    out = torch.full_like(q_latent, float("nan"))
    lse_out = torch.full(q_latent.shape[:2], float("nan"))
    o, lse = RefTorchBackend().forward_mqa(sc.meta.to_processing_order(q_latent),
                                           sc.meta.to_processing_order(q_pe), sc.cache, sc.meta,
                                           scale=SCALE, out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    assert torch.equal(sc.meta.to_caller_order(out), expected_out)
    assert torch.equal(sc.meta.to_caller_order(lse_out), expected_lse)


def test_scale_is_the_unabsorbed_one():
    """Using the latent width's scale (576 ** -0.5) changes the function: the reference would catch it."""
    sc = Scenario([1], [50], heads=4, block_size=16, seed=13)
    q_latent = torch.einsum("thp,hpr->thr", sc.q_nope[0].double(), sc.w_uk).float()
    out_wrong, _ = RefTorchBackend().forward_mqa(q_latent, sc.q_pe[0], sc.cache, sc.meta,
                                                 scale=(R_LAT + R_ROPE) ** -0.5)
    _, ref_l, _ = sc.reference(0)
    assert (out_wrong.double() - ref_l).abs().max().item() > 1e-3
