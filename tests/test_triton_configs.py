"""``TRITON_MLA``'s configuration table, grids and index widths (issue 15 item 5, issue 16's table).

No kernel compiles here; the launches are built as data (``launch.build_launches``) and the choice of
configuration is a pure function (``configs.choose_config``). One case runs a kernel (interpreted) on a
head-strided view whose ``(H - 1) * stride`` passes ``2**31``, in a subprocess because an int32 overflow
there reads outside the tensor (a segfault with the old kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.triton_mla import TritonMLABackend
from mla_backends.triton_mla.configs import (
    CONFIG_TABLE,
    GRID_AXIS12_MAX,
    choose_config,
    fitting_configs,
    rows_layout,
    shared_bytes_estimate,
    stage1_grid,
    table_rows,
)
from mla_backends.triton_mla.launch import build_launches, quantize_queries_fp8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16, FP8, FP32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
SMEM_99K, SMEM_SM80, SMEM_SM90 = 101_376, 166_912, 232_448


def _choose(cc, heads, q, kv, *, smem, sparse=False, **kw):
    return choose_config(cc, heads, q, kv, sparse=sparse, rank_pad=512, rope_pad=64, smem_limit=smem, **kw)


# ---- more than 65,535 tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["heads", "rows"])
def test_grids_take_more_than_65535_tokens(kernel):
    T = 70_001
    cache = LatentKVCache(T, 1, 16, 0, kv_cache_dtype="bfloat16", model_dtype=BF16, device="cpu")
    bt = torch.arange(T, dtype=torch.int32)[:, None]  # one page of one row each: no two tokens share a slot
    meta = BatchMetadata.build([1] * T, [0] * T, bt, 1, num_blocks=T)
    q = torch.zeros(T, 1, 16, dtype=BF16)
    qr = torch.zeros(T, 1, 0, dtype=BF16)
    cfg = _choose((9, 0), 16, BF16, BF16, smem=SMEM_SM90, kernel=kernel)
    assert cfg.kernel == kernel
    launches = build_launches(q, qr, cache, meta, scale=1.0, topk_indices=None, out=torch.empty_like(q),
                              lse_out=torch.empty(T, 1), cfg=cfg, splits=4, interpret=True)
    for launch in launches:
        assert launch.grid[0] >= T, launch.grid
        assert all(n <= GRID_AXIS12_MAX for n in launch.grid[1:]), launch.grid
    assert stage1_grid(T, 4, 64) == (4 * T, 64)
    with pytest.raises(ValueError, match="num_tokens"):
        stage1_grid(2**30, 4, 1)


# ---- int64 head offsets ---------------------------------------------------------------------------------
STRIDED = textwrap.dedent(
    r"""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    import torch
    from test_triton_mla import SCALE, assert_matches, make_case, reference_mqa
    from mla_backends.triton_mla import SCRATCH, TritonMLABackend
    H = 16
    cache, meta, ql, qr = make_case([1], [40], page=16, heads=H, rank=16, rope=0, seed=1,
                                    q_dtype=torch.float32, kv_cache_dtype="float32")
    stride = 2**31 // (H - 1) + 64  # fits int32, but (H - 1) * stride >= 2**31
    big = torch.empty(ql.shape[0] * H * stride, dtype=torch.float32)  # only the touched pages get memory
    view = big.as_strided(ql.shape, (H * stride, stride, 1))
    view.copy_(ql)
    for kernel in sys.argv[2:]:
        b = TritonMLABackend(num_kv_splits=2, kernel=kernel, min_split_len=8)
        got, lse = b.forward_mqa(view, qr, cache, meta, scale=SCALE)
        assert_matches(got, lse, *reference_mqa(ql, qr, cache, meta, SCALE), torch.float32)
    print("OK")
    """
)


def test_head_strided_views_past_2_31_elements():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", STRIDED, ROOT, "heads"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, (res.returncode, res.stderr[-2000:])


# ---- the configuration table ----------------------------------------------------------------------------
def test_fp32_falls_back_to_a_smaller_block_on_99k_parts():
    for heads in (17, 32, 128):
        big = _choose((8, 0), heads, FP32, FP32, smem=SMEM_SM80)
        small = _choose((8, 9), heads, FP32, FP32, smem=SMEM_99K)
        assert big.block_h == 32 and small.block_h == 16, (big, small)
        assert shared_bytes_estimate(small, 4, 512, 64) <= SMEM_99K < shared_bytes_estimate(big, 4, 512, 64)
        mixed = _choose((12, 0), heads, torch.float16, BF16, smem=SMEM_99K)  # a 16-bit mix: float32 dots
        assert mixed.fp32_dots and shared_bytes_estimate(mixed, 4, 512, 64) <= SMEM_99K
    # a limit no candidate fits still gives the smallest one
    assert _choose((8, 9), 128, FP32, FP32, smem=1024).block_h == 16


def test_sm90_rows_config_and_fallbacks():
    rows = _choose((9, 0), 128, BF16, BF16, smem=SMEM_SM90)
    assert rows.kernel == "rows" and rows.block_h * 1 == 64
    # pipelined: 3 tile buffers of 32 rows (ptxas: no spills under Triton 3.6 and 3.9), within SM90's 227 KiB
    assert rows.num_stages == 3 and rows.block_n == 32
    assert shared_bytes_estimate(rows, 2, 512, 64) <= SMEM_SM90
    fp8qk = _choose((9, 0), 128, BF16, FP8, smem=SMEM_SM90, fp8_qk=True)
    assert fp8qk.num_stages == 4 and fp8qk.block_n == 32 and fp8qk.kernel == "rows" and fp8qk.qk_fp8
    # fp8 tiles and queries take one byte an element: 110,592 bytes measured (ptxas), estimated within 5%
    assert 110_592 <= shared_bytes_estimate(fp8qk, 2, 512, 64) <= 1.05 * 110_592 + 1
    # smaller shared-memory limits fall back to 16-row tiles at 4 stages, then at 2
    assert (_choose((9, 0), 128, BF16, BF16, smem=180 * 1024).block_n,
            _choose((9, 0), 128, BF16, BF16, smem=180 * 1024).num_stages) == (16, 4)
    assert _choose((9, 0), 128, BF16, BF16, smem=128 * 1024).num_stages == 2
    # every fitting candidate, in the table's order (what the compile report compiles)
    names = [c.name for c in fitting_configs((9, 0), 128, BF16, BF16, sparse=False, rank_pad=512, rope_pad=64,
                                             smem_limit=SMEM_SM90)]
    assert names[:3] == ["sm90-rows64-n32-s3", "sm90-rows64-n16-s4", "sm90-rows64-n16"], names
    assert all(n.startswith("heads32") or n.startswith("heads16") for n in names[3:]), names
    # 16 heads fall back to 16 heads a program, not 32 (half the rows of a 32-head program would be padding)
    names16 = [c.name for c in fitting_configs((9, 0), 16, BF16, BF16, sparse=False, rank_pad=512, rope_pad=64,
                                               smem_limit=SMEM_SM90)]
    assert names16[3:] == ["heads16-n32", "heads16-n16"], names16
    assert rows_layout(128) == (64, 1, 2) and rows_layout(16) == (16, 4, 1) and rows_layout(20) == (32, 2, 1)
    # bf16 queries stay the default: an fp8 cache without fp8_qk keeps the portable kernel (the rows kernel's
    # dequantisation in registers spills), unless forced
    assert _choose((9, 0), 128, BF16, FP8, smem=SMEM_SM90).kernel == "heads"
    assert _choose((9, 0), 128, BF16, FP8, smem=SMEM_SM90, kernel="rows").kernel == "rows"
    assert _choose((9, 0), 128, BF16, FP8, smem=SMEM_SM90, fp8_qk=True).qk_fp8
    assert not _choose((8, 9), 128, BF16, FP8, smem=SMEM_99K, fp8_qk=True).qk_fp8  # SM89 keeps today's
    for cc, smem in (((8, 0), SMEM_SM80), ((8, 9), SMEM_99K), ((12, 0), SMEM_99K)):
        assert _choose(cc, 128, BF16, BF16, smem=smem).kernel == "heads"
    assert _choose((9, 0), 128, BF16, BF16, smem=SMEM_SM90, sparse=True).kernel == "heads"
    assert _choose((9, 0), 8, BF16, BF16, smem=SMEM_SM90).kernel == "heads"  # too few heads for 64 rows
    assert _choose((9, 0), 128, FP32, FP32, smem=SMEM_SM90).kernel == "heads"
    assert _choose(None, 128, BF16, BF16, smem=SMEM_SM90).kernel == "heads"  # interpreter: portable
    assert _choose(None, 128, BF16, BF16, smem=SMEM_SM90, kernel="rows").kernel == "rows"  # forced
    with pytest.raises(ValueError, match="kernel"):
        _choose((9, 0), 16, BF16, BF16, smem=SMEM_SM90, kernel="fast")
    assert len(table_rows()) == len(CONFIG_TABLE) and any("rows" in r["candidates"][0] for r in table_rows())


def test_backend_options_are_validated():
    with pytest.raises(ValueError, match="kernel"):
        TritonMLABackend(kernel="wgmma")
    with pytest.raises(TypeError, match="fp8_qk"):
        TritonMLABackend(fp8_qk=1)
    with pytest.raises(ValueError, match="min_split_len"):
        TritonMLABackend(min_split_len=0)


def test_query_fp8_quantisation_per_token_and_head():
    g = torch.Generator().manual_seed(0)
    ql = torch.randn(3, 4, 32, generator=g) * torch.tensor([1.0, 10.0, 0.01, 100.0])[None, :, None]
    qr = torch.randn(3, 4, 16, generator=g)
    q8, r8, scale = quantize_queries_fp8(ql.bfloat16(), qr.bfloat16())
    assert q8.dtype == FP8 and scale.shape == (3, 4)
    back = q8.float() * scale[..., None]
    assert torch.allclose(back, ql.bfloat16().float(), rtol=0.07, atol=1e-3 * scale.max().item())
    amax = torch.maximum(q8.float().abs().amax(-1), r8.float().abs().amax(-1))
    assert torch.allclose(amax, torch.full_like(amax, 448.0))
