"""FlashInfer backend numerics on a GPU, against a float64 reference written out below.

Each test needs CUDA and the architecture its backend declares, and skips with the reason otherwise (all of
them skip on a CPU-only machine). The reference is the absorbed MLA definition, token by token: gather the
request's cached rows ``0 .. position`` (dequantised), score ``(q_latent . kv_c + q_rope . k_pe) * scale``,
softmax, weight the latent rows; LSE is the natural log-sum-exp of the scaled scores.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends import AttentionSpec, configure_backend, plan_step
from mla_backends.core.device import device_info_for
from mla_backends.core.dims import MLADims
from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
    fa_limits,
    paged,
)
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

pytestmark = pytest.mark.gpu

#: DeepSeek-V3's softmax scale (YaRN mscale applied): deliberately not cutlass's fixed 1/sqrt(192)
V3_SCALE = MLADims.preset("deepseek_v3").softmax_scale


def _require(cls) -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pytest.skip("flashinfer-python is not installed")
    dev = torch.device("cuda", torch.cuda.current_device())
    cc = torch.cuda.get_device_capability(dev)
    allowed = cls.capabilities.compute_capabilities
    if cc not in allowed:
        pytest.skip(f"{cls.name} runs on {sorted(allowed)}; this GPU is SM{cc[0]}{cc[1]}")
    return dev


def build(dev, *, q_lens, ctx, heads, block_size, dtype=torch.bfloat16, kv="auto", kv_scale=1.0, seed=0):
    """Random cache rows (written through ``LatentKVCache.write``), scattered pages, random queries."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [q + c for q, c in zip(q_lens, ctx, strict=True)]
    pages = [-(-s // block_size) for s in seqs]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    rows, k = [], 0
    width = max(pages)
    for n in pages:
        rows.append(perm[k:k + n] + [-1] * (width - n))
        k += n
    cache = LatentKVCache(num_blocks, block_size, kv_cache_dtype=kv, model_dtype=dtype, device=dev,
                          scale=kv_scale)
    slots = torch.arange(num_blocks * block_size, device=dev)
    kv_c = torch.randn(slots.numel(), 512, generator=gen).to(dev, dtype)
    k_pe = torch.randn(slots.numel(), 64, generator=gen).to(dev, dtype)
    cache.write(kv_c, k_pe, slots)
    meta = BatchMetadata.build(list(q_lens), list(ctx), torch.tensor(rows, dtype=torch.int32, device=dev),
                               block_size, num_blocks=num_blocks)
    T = meta.num_tokens
    q_latent = (torch.randn(T, heads, 512, generator=gen) * 0.5).to(dev, dtype)
    q_rope = (torch.randn(T, heads, 64, generator=gen) * 0.5).to(dev, dtype)
    return cache, meta, q_latent, q_rope


def reference(q_latent, q_rope, cache, meta, scale, kv_scale=None):
    """float64 absorbed MLA, one token at a time (processing order): ``(out [T, H, 512], lse [T, H])``.
    ``kv_scale``: the fp8 dequantisation scale to use (default the cache's own)."""
    data = cache.data.to("cpu")
    if kv_scale is None:
        kv_scale = float(cache.scale.item()) if cache.is_fp8 else 1.0
    rows = data.to(torch.float64) * kv_scale
    table = meta.block_table.to("cpu").tolist()
    req = meta.token_request.to("cpu").tolist()
    pos = meta.token_positions.to("cpu").tolist()
    ql = q_latent.to("cpu", torch.float64)
    qr = q_rope.to("cpu", torch.float64)
    T, H, r = ql.shape
    out = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    P = cache.block_size
    for t in range(T):
        b, p = req[t], pos[t]
        kv = torch.stack([rows[table[b][j // P], j % P] for j in range(p + 1)])  # [p+1, 576]
        s = (ql[t] @ kv[:, :r].T + qr[t] @ kv[:, r:].T) * scale  # [H, p+1]
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ kv[:, :r]
    return out, lse


def assert_close(got, ref, atol, rtol, what):
    got = got.to("cpu", torch.float64)
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; "
                                 f"max err {float(err.max())}")


BF16 = dict(atol=2e-2, rtol=2e-2)
FP8 = dict(atol=0.12, rtol=0.12)  # fp8_e4m3 keeps 3 mantissa bits (queries are quantised too on trtllm/xqa)


# ---- FLASHINFER_MLA (fa2 / fa3) ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_fa_varlen_matches_reference(dtype, page):
    dev = _require(FlashInferMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 3, 1, 5), ctx=(17, 0, 130, 64), heads=16, block_size=page,
                               dtype=dtype)
    backend = FlashInferMLABackend()
    out, lse = backend.forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    ref_out, ref_lse = reference(q, qr, cache, meta, V3_SCALE)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, what="out", **BF16)
    assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3, what="lse (natural log)")


def test_fa_reuses_one_plan_across_layers_and_fills_given_buffers():
    """A configured backend plans its wrapper once per step, in plan_step; every layer only runs it."""
    dev = _require(FlashInferMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 1, 1), ctx=(40, 7, 300), heads=128, block_size=64)
    spec = AttentionSpec(num_heads=128, dtype=q.dtype, kv_cache_dtype=cache.kv_cache_dtype, block_size=64,
                         device=device_info_for(dev))
    backend = configure_backend(FlashInferMLABackend, spec, V3_SCALE)
    plan = plan_step(meta, [backend])
    ((_, wrapper),) = plan.state(backend, meta).planned
    calls = []
    real_plan = wrapper.plan
    wrapper.plan = lambda *a, **k: calls.append(1) or real_plan(*a, **k)  # a re-plan would show here
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=dev)
    first, _ = backend.forward_mqa(q, qr, cache, meta, scale=V3_SCALE, plan=plan)
    got_out, got_lse = backend.forward_mqa(q, qr, cache, meta, scale=V3_SCALE, out=out, lse_out=lse, plan=plan)
    assert got_out is out and got_lse is lse and not calls
    assert torch.equal(out, first)
    ref_out, ref_lse = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **BF16)
    assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3, what="lse")


def test_fa3_fp8_cache_on_sm90():
    dev = _require(FlashInferMLABackend)
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("FlashInfer reads fp8 MLA caches on SM90 only")
    cache, meta, q, qr = build(dev, q_lens=(1, 2, 1), ctx=(33, 100, 5), heads=16, block_size=64,
                               kv="fp8_e4m3", kv_scale=0.5)
    out, lse = FlashInferMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    ref_out, ref_lse = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **FP8)
    assert_close(lse, ref_lse, atol=5e-2, rtol=1e-2, what="lse")


def test_fa3_fp8_scale_that_bf16_cannot_represent():
    """FlashInfer's fa3 applies the fp8 scale rounded to bf16 (0.37 -> 0.369140625, -2.3e-3 relative).

    Against a reference dequantised with that applied scale the error is the kernel's own (the bf16
    tolerance). Against the exact scale every score and value is also off by the rounding: the tolerance is
    the backend's declared ``bfloat16/fp8_e4m3`` one, which adds room for that bias (its comment says how
    much), and the LSE's grows by ``FA_FP8_SCALE_MAX_BIAS`` (2**-8) relative.
    """
    dev = _require(FlashInferMLABackend)
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("FlashInfer reads fp8 MLA caches on SM90 only")
    cache, meta, q, qr = build(dev, q_lens=(1, 2, 1), ctx=(33, 100, 5), heads=16, block_size=64,
                               kv="fp8_e4m3", kv_scale=0.37)
    stored = float(cache.scale.item())
    applied = fa_limits.fa_applied_fp8_scale(stored)
    assert applied != stored and abs(applied / stored - 1) <= fa_limits.FA_FP8_SCALE_MAX_BIAS
    out, lse = FlashInferMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    as_applied, lse_applied = reference(q, qr, cache, meta, V3_SCALE, kv_scale=applied)
    assert_close(out, as_applied, what="out vs the applied-scale reference", **BF16)
    assert_close(lse, lse_applied, atol=5e-2, rtol=1e-2, what="lse vs the applied-scale reference")
    exact, exact_lse = reference(q, qr, cache, meta, V3_SCALE)
    tol = FlashInferMLABackend.capabilities.tolerances["bfloat16/fp8_e4m3"]
    assert_close(out, exact, atol=tol.atol, rtol=tol.rtol, what="out vs the exact-scale reference")
    assert_close(lse, exact_lse, atol=5e-2, rtol=1e-2 + fa_limits.FA_FP8_SCALE_MAX_BIAS,
                 what="lse vs the exact-scale reference")


# ---- FLASHINFER_MLA_CUTLASS ----------------------------------------------------------------------
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [32, 128])
def test_cutlass_matches_reference(heads, page):
    dev = _require(FlashInferCutlassMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 1, 1, 1), ctx=(0, 31, 200, 700), heads=heads, block_size=page)
    out, lse = FlashInferCutlassMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    assert lse is None and out.shape == q.shape
    ref_out, _ = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **BF16)
    assert not math.isclose(V3_SCALE, paged.cutlass_fixed_scale(64))  # the scale folding was exercised


# ---- FLASHINFER_MLA_TRTLLM -----------------------------------------------------------------------
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2])
def test_trtllm_matches_reference(heads, q_len):
    dev = _require(FlashInferTrtllmMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(q_len,) * 3, ctx=(5, 64, 333), heads=heads, block_size=64)
    out, lse = FlashInferTrtllmMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    ref_out, ref_lse = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **BF16)
    assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3, what="lse (natural log)")


def test_trtllm_fp8_cache():
    dev = _require(FlashInferTrtllmMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 1), ctx=(70, 500), heads=128, block_size=32, kv="fp8_e4m3",
                               kv_scale=0.25)
    out, lse = FlashInferTrtllmMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    ref_out, ref_lse = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **FP8)
    assert_close(lse, ref_lse, atol=0.1, rtol=2e-2, what="lse")


# ---- FLASHINFER_MLA_XQA --------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [32, 64])
def test_xqa_matches_reference(heads, page):
    dev = _require(FlashInferXqaMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 1, 1), ctx=(3, 90, 400), heads=heads, block_size=page)
    out, lse = FlashInferXqaMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    assert lse is None
    ref_out, _ = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **BF16)


def test_xqa_fp8_cache():
    dev = _require(FlashInferXqaMLABackend)
    cache, meta, q, qr = build(dev, q_lens=(1, 1), ctx=(50, 260), heads=16, block_size=64, kv="fp8_e4m3",
                               kv_scale=0.5)
    out, _ = FlashInferXqaMLABackend().forward_mqa(q, qr, cache, meta, scale=V3_SCALE)
    ref_out, _ = reference(q, qr, cache, meta, V3_SCALE)
    assert_close(out, ref_out, what="out", **FP8)
