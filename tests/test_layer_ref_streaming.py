"""REF_TORCH's streamed dense path (sequences >= stream_min_rows, split-K over page chunks whose partials are
folded every STREAM_FOLD_CHUNKS chunks), which the layer's decode benchmark relies on, against a plain float64
absorbed reference: decode and multi-token queries, long and short requests mixed, pages that do not divide
the lengths, fp8 and bf16 caches, default and tiny chunks (many folds, chunks a short request sees nothing in).

The tiny rows here (24 wide) would never reach STREAM_MIN_BYTES: the module sets it to 0, so the row floor
STREAM_MIN_ROWS alone decides what streams."""

from __future__ import annotations

import pytest
import torch

from mla_backends.core.attention_math import padded_groups
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.ref_torch import backend as ref_backend
from mla_backends.ref_torch.backend import STREAM_MAX_CHUNK_ROWS, STREAM_MIN_ROWS, stream_chunk_pages, stream_min_rows
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

pytestmark = pytest.mark.usefixtures("one_thread", "stream_by_rows")


@pytest.fixture
def stream_by_rows(monkeypatch):
    monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 0)

H, r, R = 2, 16, 8


def _reference(q, rows, ctx, n, scale):
    """Per token: softmax over visible rows of ``[q_latent | q_rope] . row``, output = weights @ latent."""
    S = ctx + n
    outs, lses = [], []
    for j in range(n):
        vis = rows[: ctx + j + 1]
        s = (q[j] @ vis.T) * scale  # [H, visible]
        outs.append(torch.softmax(s, -1) @ vis[:, :r])
        lses.append(torch.logsumexp(s, -1))
    assert S == rows.shape[0]
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("kv_cache_dtype, dtype, tol", [
    ("auto", torch.float64, 1e-10),
    ("auto", torch.float32, 2e-5),
    ("bfloat16", torch.float32, 2e-5),  # the reference reads the same bf16 rows back
    ("fp8_e4m3", torch.float32, 2e-5),
    ("fp8_e4m3", torch.float64, 1e-10),  # the scale applied in float64, as LatentKVCache.dequantize does
])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("chunking", ["default", "tiny", "fold-each"])
def test_streamed_requests_match_reference(kv_cache_dtype, dtype, tol, block_size, chunking, monkeypatch):
    assert STREAM_MIN_ROWS > 40
    if chunking == "tiny":  # ~50 rows per request per chunk, partials folded every 3 chunks
        monkeypatch.setattr(ref_backend, "STREAM_CHUNK_BYTES", 2 * (r + R) * 8 * 50)
        monkeypatch.setattr(ref_backend, "STREAM_FOLD_CHUNKS", 3)
    if chunking == "fold-each":  # partials over the element budget: every chunk folded as it comes
        monkeypatch.setattr(ref_backend, "STREAM_CHUNK_BYTES", 2 * (r + R) * 8 * 200)
        monkeypatch.setattr(ref_backend, "STREAM_PARTIAL_ELEMENTS", 1)
    g = torch.Generator().manual_seed(block_size)
    # runs: two long decodes of different lengths streamed together, a short request, then two long
    # 4-token extends (the first becomes long only with its new tokens)
    long = STREAM_MIN_ROWS + STREAM_MAX_CHUNK_ROWS + 500  # still running where the second request's edge is
    ctx = [long, STREAM_MIN_ROWS + 40, 7, STREAM_MIN_ROWS - 1, STREAM_MIN_ROWS + 5]
    new = [1, 1, 3, 4, 4]
    pages = -(-max(c + n for c, n in zip(ctx, new, strict=True)) // block_size)
    nb = len(ctx) * pages + 2
    bt = torch.randperm(nb, generator=g)[: len(ctx) * pages].view(len(ctx), pages).int()
    cache = LatentKVCache(nb, block_size, r, R, kv_cache_dtype=kv_cache_dtype, model_dtype=dtype, scale=0.5
                          if kv_cache_dtype.startswith("fp8") else 1.0)
    meta = BatchMetadata.build(new, ctx, bt, block_size, decode_threshold=0, reorder=False)
    for b, (c, n) in enumerate(zip(ctx, new, strict=True)):
        pos = torch.arange(c + n)
        rows = torch.randn(c + n, r + R, generator=g, dtype=torch.float64).to(dtype)
        cache.write(rows[:, :r], rows[:, r:], bt[b, pos // block_size].long() * block_size + pos % block_size)
    T = sum(new)
    q = torch.randn(T, H, r + R, generator=g, dtype=torch.float64).to(dtype)
    out, lse = RefTorchBackend().forward_mqa(q[..., :r].contiguous(), q[..., r:].contiguous(), cache, meta,
                                             scale=0.2)
    t = 0
    for b, (c, n) in enumerate(zip(ctx, new, strict=True)):
        rows = cache.gather(meta.block_table[b], c + n, torch.float64)  # what the cache holds, dequantised
        ref_o, ref_l = _reference(q[t: t + n].double(), rows, c, n, 0.2)
        torch.testing.assert_close(out[t: t + n].double(), ref_o, rtol=tol, atol=tol)
        # the LSE is float32 by contract
        torch.testing.assert_close(lse[t: t + n].double(), ref_l, rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
        t += n


def test_stream_chunk_pages_splits_the_byte_budget():
    row = 576 * 4
    assert stream_chunk_pages(8, row, 64) == ref_backend.stream_chunk_bytes() // (8 * row) // 64
    assert stream_chunk_pages(1, row, 16) * 16 == STREAM_MAX_CHUNK_ROWS  # capped in rows
    assert stream_chunk_pages(32, row, 256) == 1  # never less than one page
    assert stream_chunk_pages(2, row, 64) > stream_chunk_pages(8, row, 64)

    with pytest.raises(ValueError, match="block_size: got 0; supported >= 1"):
        stream_chunk_pages(2, row, 0)
    with pytest.raises(TypeError, match="num_requests: got float"):
        stream_chunk_pages(2.0, row, 16)


def test_stream_min_rows_splits_the_byte_budget(monkeypatch):
    monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 24 << 20)
    row = 576 * 4
    assert stream_min_rows(8, row) == -(-(24 << 20) // (8 * row)) == 1366  # V2-Lite decode, 8 requests
    assert stream_min_rows(4, row) == 2 * stream_min_rows(8, row) - 1  # rounded up
    assert stream_min_rows(1024, row) == STREAM_MIN_ROWS  # never below the row floor
    with pytest.raises(ValueError, match="num_requests: got 0; supported >= 1"):
        stream_min_rows(0, row)
    with pytest.raises(TypeError, match="row_bytes: got float"):
        stream_min_rows(8, 2.0)


def test_batch_size_decides_what_streams(monkeypatch):
    """The same sequence is streamed in a big batch and padded in a small one: the byte budget covers the
    whole batch's rows."""
    monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 4 * 300 * (r + R) * 8)  # 4 requests of 300 float64 rows
    seen = []
    inner = RefTorchBackend._stream

    def spy(q, cache_, block_rows, context_lens, seq_lens, *rest):
        seen.append(tuple(seq_lens))
        return inner(q, cache_, block_rows, context_lens, seq_lens, *rest)

    monkeypatch.setattr(RefTorchBackend, "_stream", staticmethod(spy))
    g = torch.Generator().manual_seed(5)
    bs = 16
    for n_req, streamed in ((2, False), (4, True)):
        ctx = [299] * n_req
        pages = -(-300 // bs)
        nb = n_req * pages + 1
        bt = torch.randperm(nb, generator=g)[: n_req * pages].view(n_req, pages).int()
        cache = LatentKVCache(nb, bs, r, R, model_dtype=torch.float64)
        cache.data.copy_(torch.randn(cache.data.shape, generator=g, dtype=torch.float64))
        meta = BatchMetadata.build([1] * n_req, ctx, bt, bs)
        q = torch.randn(n_req, H, r + R, generator=g, dtype=torch.float64)
        seen.clear()
        out, lse = RefTorchBackend().forward_mqa(q[..., :r].contiguous(), q[..., r:].contiguous(), cache, meta,
                                                 scale=0.2)
        assert seen == ([(300,) * n_req] if streamed else [])
        for b in range(n_req):
            ref_o, ref_l = _reference(q[b: b + 1], cache.gather(meta.block_table[b], 300, torch.float64), 299, 1, 0.2)
            torch.testing.assert_close(out[b: b + 1], ref_o, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[b: b + 1], ref_l, rtol=1e-10, atol=1e-10)


def test_streamed_groups_hold_requests_of_similar_length(monkeypatch):
    """A long request does not drag short ones through all its chunks: groups are cut where the longest would
    exceed STREAM_LENGTH_RATIO x the shortest (and at a change of query length)."""
    g = torch.Generator().manual_seed(11)
    bs, L = 64, STREAM_MIN_ROWS
    ctx = [5 * L, L + 76, L + 76, 2 * L, L + 76, L + 300, L + 300]
    new = [1, 1, 1, 1, 1, 1, 2]
    pages = -(-max(c + n for c, n in zip(ctx, new, strict=True)) // bs)
    nb = len(ctx) * pages + 1
    bt = torch.randperm(nb, generator=g)[: len(ctx) * pages].view(len(ctx), pages).int()
    cache = LatentKVCache(nb, bs, r, R, model_dtype=torch.float64)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g, dtype=torch.float64))
    meta = BatchMetadata.build(new, ctx, bt, bs, decode_threshold=0, reorder=False)
    groups = []
    inner = RefTorchBackend._stream

    def spy(q, cache_, block_rows, context_lens, seq_lens, *rest):
        groups.append(tuple(seq_lens))
        return inner(q, cache_, block_rows, context_lens, seq_lens, *rest)

    monkeypatch.setattr(RefTorchBackend, "_stream", staticmethod(spy))
    T = sum(new)
    q = torch.randn(T, H, r + R, generator=g, dtype=torch.float64)
    out, lse = RefTorchBackend().forward_mqa(q[..., :r].contiguous(), q[..., r:].contiguous(), cache, meta,
                                             scale=0.2)
    seq = [c + n for c, n in zip(ctx, new, strict=True)]
    assert groups == [(seq[0],), tuple(seq[1:6]), (seq[6],)]
    t = 0
    for b, (c, n) in enumerate(zip(ctx, new, strict=True)):
        ref_o, ref_l = _reference(q[t: t + n], cache.gather(meta.block_table[b], c + n, torch.float64), c, n, 0.2)
        torch.testing.assert_close(out[t: t + n], ref_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[t: t + n].double(), ref_l, rtol=1e-6, atol=1e-6)
        t += n


def test_padded_groups_match_reference(monkeypatch):
    """Short sequences in several padded groups (a tiny GROUP_ELEMENT_BUDGET): uniform and mixed query lengths,
    a zero-length request, each group's tokens found at its own offset."""
    g = torch.Generator().manual_seed(12)
    bs = 4
    ctx = [9, 3, 14, 0, 6, 11, 2, 5]
    new = [2, 2, 3, 1, 0, 4, 1, 1]
    W = r + R
    seq = [c + n for c, n in zip(ctx, new, strict=True)]
    budget = 2 * max(seq) * (W + max(new) * H)  # about two requests per group
    monkeypatch.setattr(ref_backend, "GROUP_ELEMENT_BUDGET", budget)
    groups = padded_groups(seq, new, W, H, budget)
    assert len(groups) >= 3 and groups[0] == (0, 2)  # the first group is uniform (2 + 2), later ones mixed
    pages = -(-max(seq) // bs)
    nb = len(ctx) * pages + 1
    bt = torch.randperm(nb, generator=g)[: len(ctx) * pages].view(len(ctx), pages).int()
    cache = LatentKVCache(nb, bs, r, R, model_dtype=torch.float64)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g, dtype=torch.float64))
    meta = BatchMetadata.build(new, ctx, bt, bs, decode_threshold=0, reorder=False)
    q = torch.randn(sum(new), H, W, generator=g, dtype=torch.float64)
    out, lse = RefTorchBackend().forward_mqa(q[..., :r].contiguous(), q[..., r:].contiguous(), cache, meta,
                                             scale=0.2)
    t = 0
    for b, (c, n) in enumerate(zip(ctx, new, strict=True)):
        if n:
            rows = cache.gather(meta.block_table[b], c + n, torch.float64)
            ref_o, ref_l = _reference(q[t: t + n], rows, c, n, 0.2)
            torch.testing.assert_close(out[t: t + n], ref_o, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[t: t + n].double(), ref_l, rtol=1e-6, atol=1e-6)
        t += n


def _fake_cache_dir(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_cpu_l2_bytes_reads_the_level_2_cache(tmp_path):
    """The L2 size from a sysfs-shaped folder: level-1 and instruction caches skipped, K/M suffixes read,
    None when the folder or its sizes cannot be read."""
    root = _fake_cache_dir(tmp_path / "a", [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                            (3, "Unified", "266240K")])
    assert ref_backend.cpu_l2_bytes(root) == 2 << 20
    assert ref_backend.cpu_l2_bytes(_fake_cache_dir(tmp_path / "b", [(2, "Unified", "1M")])) == 1 << 20
    assert ref_backend.cpu_l2_bytes(_fake_cache_dir(tmp_path / "c", [(2, "Instruction", "1M")])) is None
    assert ref_backend.cpu_l2_bytes(_fake_cache_dir(tmp_path / "d", [(2, "Unified", "big")])) is None
    assert ref_backend.cpu_l2_bytes(str(tmp_path / "missing")) is None


def test_chunk_bytes_follow_the_l2():
    """Large chunks only where each core has at least LARGE_L2_BYTES of L2; unknown or smaller: the small ones."""
    small, large = ref_backend.SMALL_L2_CHUNK_BYTES, ref_backend.LARGE_L2_CHUNK_BYTES
    assert small < large
    assert ref_backend.default_chunk_bytes(None) == small
    assert ref_backend.default_chunk_bytes(1 << 20) == small
    assert ref_backend.default_chunk_bytes(ref_backend.LARGE_L2_BYTES) == large
    assert ref_backend.STREAM_CHUNK_BYTES is None  # by default: this machine's, read on first use
    assert ref_backend.stream_chunk_bytes() == ref_backend.default_chunk_bytes(ref_backend.cpu_l2_bytes())
