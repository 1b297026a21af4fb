"""The Hopper ``rows`` configuration of ``TRITON_MLA`` (64 rows of heads x query tokens a program), forced
with ``kernel="rows"`` so it runs under the CPU interpreter, against the float64 reference of
``test_triton_mla.py``; and the conformance suite's quick matrix on it (bf16 queries, and ``fp8_qk``).

Cases: heads 16/64/128 (plus 20 and 96: padded head blocks), query lengths 1-4 in one request, ragged lengths,
pages 1/16/64 with scattered tables, splits by length whose boundaries fall inside a page, requests with one
split (written directly, merge skipped) next to requests with several.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_mla import SCALE, make_case, reference_mqa, run_case

from mla_backends.testing import BackendConformance
from mla_backends.triton_mla import TritonMLABackend
from mla_backends.triton_mla.backend import FP8_QK_TOLERANCES


def _rows(**kw) -> TritonMLABackend:
    b = TritonMLABackend(kernel="rows", **kw)
    assert b.launch_config(torch.bfloat16, torch.bfloat16, 512, 64, 16, torch.device("cpu"),
                           interpret=True).kernel == "rows"
    return b


@pytest.mark.parametrize(
    "heads,query_lens,context_lens,page,kv",
    [
        (16, [1, 2, 4, 3], [40, 9, 100, 0], 16, "bfloat16"),
        (128, [1, 2], [70, 3], 64, "bfloat16"),
        (64, [4, 1], [130, 0], 1, "fp8_e4m3"),
        (20, [3, 1], [50, 7], 16, "bfloat16"),
        # 96 heads: two 64-head blocks, the second half padding (one token a program: no per-row limit)
        (96, [2, 1], [65, 130], 16, "bfloat16"),
        (16, [1, 1, 4], [300, 5, 61], 64, "fp8_e5m2"),
    ],
)
def test_rows_kernel_matches_reference(heads, query_lens, context_lens, page, kv):
    cache, meta, ql, qr = make_case(query_lens, context_lens, page=page, heads=heads, kv_cache_dtype=kv,
                                    fp8_scale=2.5 if kv.startswith("fp8") else 1.0, seed=heads + page)
    # min_split_len 24: long requests get several splits (tile-aligned, inside pages of 64), short ones one
    run_case(_rows(num_kv_splits=4, min_split_len=24), cache, meta, ql, qr)


def test_rows_kernel_fp8_qk_within_declared_tolerance():
    tol = FP8_QK_TOLERANCES["bfloat16/fp8_e4m3"]
    for heads in (16, 128):
        cache, meta, ql, qr = make_case([1, 3], [300, 40], page=64, heads=heads, kv_cache_dtype="fp8_e4m3",
                                        fp8_scale=2.5, seed=5)
        b = TritonMLABackend(num_kv_splits=2, kernel="rows", min_split_len=64, fp8_qk=True)
        assert b.launch_config(ql.dtype, cache.data.dtype, 512, 64, heads, cache.device, interpret=True).qk_fp8
        out, lse = b.forward_mqa(ql, qr, cache, meta, scale=SCALE)
        ref, ref_lse = reference_mqa(ql, qr, cache, meta, SCALE)
        assert bool(((out.double() - ref).abs() <= tol.atol + tol.rtol * ref.abs()).all())
        assert bool(((lse.double() - ref_lse).abs() <= tol.atol + tol.rtol * ref_lse.abs()).all())
        # and it is not the bf16 path: quantised queries move the result
        exact, _ = TritonMLABackend(num_kv_splits=2, kernel="rows", min_split_len=64).forward_mqa(
            ql, qr, cache, meta, scale=SCALE)
        assert not torch.equal(out, exact)


def test_variant_declares_the_fp8_qk_tolerance():
    cls = TritonMLABackend.variant(kernel="rows", fp8_qk=True)
    assert cls.capabilities.tolerances["bfloat16/fp8_e4m3"] == FP8_QK_TOLERANCES["bfloat16/fp8_e4m3"]
    assert "bfloat16/fp8_e4m3" not in TritonMLABackend.capabilities.tolerances
    b = cls()
    assert b.kernel == "rows" and b.fp8_qk and isinstance(b, TritonMLABackend)


class TestTritonRowsQuickConformance(BackendConformance):
    backend = TritonMLABackend.variant(kernel="rows", min_split_len=32)
    quick = True


class TestTritonRowsFp8QKQuickConformance(BackendConformance):
    backend = TritonMLABackend.variant(kernel="rows", fp8_qk=True, min_split_len=32)
    quick = True
    # DeepSeek-V4 calls take the V4 kernel, which reads neither `kernel` nor `fp8_qk` (only min_split_len, through
    # the split sizes): its launches here are those of TestTritonRowsQuickConformance, which runs every V4 case
    test_v4_case = None


def test_rows_split_sizes_spread_the_step_work():
    from mla_backends.triton_mla.splits import MAX_KV_SPLITS, rows_split_sizes

    # 64 requests of 4k and one of 64k at 128 heads (2 head blocks, one token a program) on 132 SMs: the
    # long request is cut into pieces of about an average program's share (~2.5k rows), not 4 of 16k
    seq = [4096] * 64 + [65536]
    splits, split_len = rows_split_sizes(seq, [1] * 65, 1, 2, 132, 512, 32)
    work = 2 * sum(seq)
    assert split_len % 32 == 0 and work / 264 <= split_len < work / 264 + 32
    assert splits == -(-65536 // split_len) == 27
    # a small step keeps the floor: one 16k request, 16 heads (4 tokens a program), 132 SMs
    assert rows_split_sizes([16384], [1], 4, 1, 132, 512, 32) == (32, 512)
    # 4-token queries at 16 heads are one group a request; at 128 heads four (one token a program)
    assert rows_split_sizes([8192] * 8, [4] * 8, 4, 1, 4, 512, 32)[1] == 8192
    assert rows_split_sizes([8192] * 8, [4] * 8, 1, 2, 4, 512, 32)[1] == 8 * 8192
    # the cap, and an empty step
    assert rows_split_sizes([10**7], [1], 1, 1, 10**4, 16, 16)[0] == MAX_KV_SPLITS
    assert rows_split_sizes([], [], 1, 1, 132, 512, 32) == (1, 512)


def test_rows_backend_sizes_splits_by_work_unless_pinned():
    cache, meta, ql, qr = make_case([1, 1, 1, 2], [900, 10, 3, 40], page=16, heads=16, seed=3)
    cfg = _rows().launch_config(ql.dtype, cache.data.dtype, 512, 64, 16, cache.device, interpret=True)
    # CPU: a nominal 4 SMs, so 8 programs share the work: ~120 rows each, the floor 24 below it
    assert _rows(min_split_len=24).rows_splits_for(meta, 16, cache.device, cfg) == (8, 128)
    assert _rows(min_split_len=24, num_kv_splits=4).rows_splits_for(meta, 16, cache.device, cfg) == (4, 24)
    # unpinned: the long request gets 8 splits of 128 positions (split ends inside 16-row pages)
    run_case(_rows(min_split_len=24), cache, meta, ql, qr)
