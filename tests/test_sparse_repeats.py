"""Issue 48 class 5: a position repeated in a sparse top-k list counts once per repeat, as in FlashMLA's sparse
kernels (its reference gathers one row per entry) and so in vLLM's and SGLang's DeepSeek-V3.2 paths, which hand the
indexer's list to them. Every CPU-runnable sparse backend agrees with a float64 reference written that way, a
caller who wants each position once passes ``distinct_topk(topk)``, and the indexer never repeats a position (so
on the indexer's own lists both readings agree, transformers' mask included)."""

from __future__ import annotations

import pytest
import torch
from test_sparse_attention import BS, ROPE, H, R, reference  # one row gathered per entry, -1 skipped

from mla_backends import BatchMetadata, LatentKVCache
from mla_backends.core.attention_math import distinct_topk
from mla_backends.layer.sparse.indexer import causal_topk
from mla_backends.layer.sparse.indexer_cache import IndexerKeyCache
from mla_backends.ref_torch import RefTorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.3


def _backends():
    out = [pytest.param(RefTorchBackend, torch.float64, 1e-12, id="REF_TORCH-float64"),
           pytest.param(RefTorchBackend, torch.float32, 2e-5, id="REF_TORCH-float32")]
    try:
        from mla_backends.triton_mla import TritonMLABackend
    except ImportError:  # pragma: no cover - triton is part of the main environment
        return out
    return out + [pytest.param(lambda: TritonMLABackend(num_kv_splits=2), torch.float32, 2e-5,
                               id="TRITON_MLA-float32")]


def _batch(dtype: torch.dtype):
    """Two decodes and a 3-token extend over scattered pages, every position written."""
    g = torch.Generator().manual_seed(7)
    qlens, ctxs = [1, 1, 3], [9, 5, 6]
    table = [[5, 2, 7], [0, 3, -1], [6, 1, 4]]
    meta = BatchMetadata.build(qlens, ctxs, table, BS)
    cache = LatentKVCache(8, BS, R, ROPE, model_dtype=dtype)
    for b, s in enumerate(meta.seq_lens_list):
        pos = torch.arange(s)
        slots = meta.block_table[b].long()[pos // BS] * BS + pos % BS
        cache.write(torch.randn(s, R, generator=g).to(dtype), torch.randn(s, ROPE, generator=g).to(dtype), slots)
    T = meta.num_tokens
    return cache, meta, torch.randn(T, H, R, generator=g).to(dtype), torch.randn(T, H, ROPE, generator=g).to(dtype)


#: per token: positions with repeats, -1 padding among them (tokens 2..4 belong to the extend, positions 6..8)
TOPK = torch.tensor([[4, 4, 0, 8, 4, -1], [1, -1, 1, 1, 3, 0], [2, 6, 2, -1, 5, 5],
                     [7, 7, 7, 7, 7, 7], [0, 8, 8, -1, -1, 3]], dtype=torch.int32)


@pytest.mark.parametrize("make, dtype, tol", _backends())
def test_a_repeated_position_counts_once_per_repeat_on_every_backend(make, dtype, tol):
    cache, meta, q_latent, q_rope = _batch(dtype)
    out, lse = make().forward_mqa(q_latent, q_rope, cache, meta, scale=SCALE, topk_indices=TOPK)
    want, want_lse = reference(q_latent, q_rope, cache, meta, TOPK, SCALE)
    once, _ = reference(q_latent, q_rope, cache, meta, distinct_topk(TOPK), SCALE)
    assert (want - once).abs().max() > 100 * tol  # the two readings differ on this case
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
    got_once, _ = make().forward_mqa(q_latent, q_rope, cache, meta, scale=SCALE, topk_indices=distinct_topk(TOPK))
    torch.testing.assert_close(got_once.double(), once, rtol=tol, atol=tol)


def test_the_indexer_never_repeats_a_position_even_among_ties():
    """Equal keys make every score a tie: the top-k still lists each visible position at most once."""
    meta = BatchMetadata.build([1, 4, 2], [7, 0, 3], [[0, 1], [2, -1], [3, 4]], BS)
    cache = IndexerKeyCache(5, BS, 128, storage="float32")
    cache.data[..., :] = 0.25  # every key alike
    g = torch.Generator().manual_seed(3)
    q = torch.randn(meta.num_tokens, 2, 128, generator=g)
    topk = causal_topk(q, torch.ones(meta.num_tokens, 2), cache, meta, topk=4)
    for t, row in enumerate(topk.tolist()):
        kept = [p for p in row if p >= 0]
        visible = int(meta.token_positions[t]) + 1
        assert len(kept) == len(set(kept)) == min(4, visible), (t, row)
