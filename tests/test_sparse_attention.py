"""Sparse ``forward_mqa`` (REF_TORCH): a random, -1 padded top-k against a float64 reference that gathers the
selected rows, and equality with dense attention when the top-k covers the whole context."""

from __future__ import annotations

import pytest
import torch

from mla_backends import BatchMetadata, LatentKVCache
from mla_backends.ref_torch import RefTorchBackend

R, ROPE, H, BS = 32, 8, 3, 4
QLENS, CTXS = [1, 1, 6, 0, 3], [13, 4, 0, 7, 9]  # decodes, a fresh prefill, an idle request, an extend


pytestmark = pytest.mark.usefixtures("one_thread")


def setup_batch(dtype: torch.dtype, kv_cache_dtype: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = [q + c for q, c in zip(QLENS, CTXS, strict=True)]
    pages = [-(-s // BS) for s in seqs]
    perm = torch.randperm(sum(pages) + 3, generator=g).tolist()
    table, i = [], 0
    for n in pages:
        table.append(perm[i:i + n] + [-1] * (max(pages) - n))
        i += n
    cache = LatentKVCache(sum(pages) + 3, BS, R, ROPE, kv_cache_dtype=kv_cache_dtype, model_dtype=dtype)
    meta = BatchMetadata.build(QLENS, CTXS, table, BS)
    for b, s in enumerate(meta.seq_lens_list):  # every position of every request, context and new tokens
        pos = torch.arange(s)
        slots = meta.block_table[b].long()[pos // BS] * BS + pos % BS
        kv_c, k_pe = torch.randn(s, R, generator=g), torch.randn(s, ROPE, generator=g)
        cache.write(kv_c.to(dtype), k_pe.to(dtype), slots)
    T = meta.num_tokens
    q_lat = torch.randn(T, H, R, generator=g).to(dtype)
    q_rope = torch.randn(T, H, ROPE, generator=g).to(dtype)
    return cache, meta, q_lat, q_rope, g


def reference(q_lat, q_rope, cache, meta, topk, scale):
    """Float64, one token at a time: softmax over the selected rows only (-1 entries ignored)."""
    T = meta.num_tokens
    out = torch.zeros(T, H, R, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        b = int(meta.token_request[t])
        sel = [int(v) for v in topk[t] if v >= 0]
        rows = cache.gather(meta.block_table[b], int(meta.seq_lens[b]), torch.float64)[sel]  # [k, R + ROPE]
        q = torch.cat([q_lat[t], q_rope[t]], dim=-1).double()  # [H, R + ROPE]
        s = q @ rows.T * scale
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ rows[:, :R]
    return out, lse


@pytest.mark.parametrize(("dtype", "kv", "tol"), [(torch.float64, "auto", 1e-12),
                                                   (torch.float32, "auto", 1e-5),
                                                   (torch.bfloat16, "fp8_e4m3", 2e-2)])
def test_random_padded_topk_matches_float64_gather_reference(dtype, kv, tol):
    cache, meta, q_lat, q_rope, g = setup_batch(dtype, kv)
    K = 6
    topk = torch.full((meta.num_tokens, K), -1, dtype=torch.int32)
    for t, p in enumerate(meta.token_positions.tolist()):
        n = int(torch.randint(1, min(K, p + 1) + 1, (1,), generator=g))
        chosen = torch.randperm(p + 1, generator=g)[:n]
        slots = torch.randperm(K, generator=g)[:n]  # valid entries scattered among -1 padding
        topk[t, slots] = chosen.to(torch.int32)
    scale = 0.3
    out, lse = RefTorchBackend().forward_mqa(q_lat, q_rope, cache, meta, scale=scale, topk_indices=topk)
    ref_out, ref_lse = reference(q_lat, q_rope, cache, meta, topk, scale)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    lse_tol = max(tol, 1e-6)  # the LSE is float32 by contract
    torch.testing.assert_close(lse.double(), ref_lse, rtol=lse_tol, atol=lse_tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_covering_the_context_equals_dense(dtype):
    cache, meta, q_lat, q_rope, g = setup_batch(dtype, "auto", seed=1)
    K = max(meta.seq_lens_list) + 2
    topk = torch.full((meta.num_tokens, K), -1, dtype=torch.int32)
    for t, p in enumerate(meta.token_positions.tolist()):
        topk[t, : p + 1] = torch.randperm(p + 1, generator=g).to(torch.int32)  # every visible row, any order
    be = RefTorchBackend()
    sparse, sparse_lse = be.forward_mqa(q_lat, q_rope, cache, meta, scale=0.25, topk_indices=topk)
    dense, dense_lse = be.forward_mqa(q_lat, q_rope, cache, meta, scale=0.25)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(sparse, dense, rtol=tol, atol=tol)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=tol, atol=tol)


def test_future_positions_in_topk_are_rejected():
    cache, meta, q_lat, q_rope, _ = setup_batch(torch.float32, "auto")
    topk = torch.zeros(meta.num_tokens, 2, dtype=torch.int32)
    topk[0, 1] = int(meta.token_positions[0]) + 1
    with pytest.raises(ValueError, match="topk_indices: token 0 selects position"):
        RefTorchBackend().forward_mqa(q_lat, q_rope, cache, meta, scale=0.3, topk_indices=topk)
