"""The fused CUDA prefill kernels against the plain path, on a GPU (every test skips without CUDA).

``prefill_attention`` with the kernel :func:`mla_backends.layer.prefill.prefill_kernel_for` picks (torch's flash
SDPA for bf16/fp16 on SM80+, the memory-efficient one for float32) is compared with ``fused=False`` (plain
matmuls in float32) at DeepSeek's widths (192-wide keys, 128-wide values), causal and over a context chunk;
then ``forward_mha`` end to end, new tokens plus cached context in several workspace chunks.
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.layer.prefill import forward_mha, prefill_attention, prefill_kernel_for
from mla_backends.layer.prefill_kernels import PrefillKernel
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

pytestmark = pytest.mark.gpu

H, N, P, V, R = 16, 128, 64, 128, 512
#: output / LSE tolerances against the float32 plain path: the fused kernels round each part's output to
#: the input dtype (bf16 keeps 8 significant bits, fp16 11) and accumulate in another order
TOL = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 2e-3), torch.float32: (2e-4, 2e-4)}
EXPECTED = {torch.bfloat16: PrefillKernel.CUDA_FLASH, torch.float16: PrefillKernel.CUDA_FLASH,
            torch.float32: PrefillKernel.CUDA_EFFICIENT}


def _device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def _expected(dev: torch.device, dtype: torch.dtype) -> PrefillKernel:
    if torch.cuda.get_device_capability(dev) < (8, 0):
        return PrefillKernel.CUDA_EFFICIENT
    return EXPECTED[dtype]


def _inputs(dev, n, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dev, dtype)

    return t(n, H, N, s=0.5), t(n, H, P, s=0.5), t(m, H, N), t(m, P), t(m, H, V)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n, m, causal", [(1, 1, True), (77, 77, True), (1000, 1000, True), (33, 700, False),
                                          (1, 4096, False)])
def test_fused_cuda_kernel_matches_the_plain_path(dtype, n, m, causal):
    dev = _device()
    args = _inputs(dev, n, m, dtype, seed=n + m)
    choice = prefill_kernel_for(args[0], args[1], args[4], m, causal)
    assert choice.kernel == _expected(dev, dtype), str(choice)
    scale = (N + P) ** -0.5
    o, lse = prefill_attention(*args, scale, causal=causal, fused=True)
    o_ref, lse_ref = prefill_attention(*args, scale, causal=causal, fused=False)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == (n, H, V) and lse.shape == (n, H)
    out_tol, lse_tol = TOL[dtype]
    torch.testing.assert_close(o, o_ref, rtol=out_tol, atol=out_tol)
    torch.testing.assert_close(lse, lse_ref, rtol=lse_tol, atol=lse_tol)


def test_causal_with_more_keys_than_queries_keeps_the_plain_path():
    dev = _device()
    args = _inputs(dev, 5, 9, torch.bfloat16)
    choice = prefill_kernel_for(args[0], args[1], args[4], 9, True)
    assert choice.kernel == PrefillKernel.PLAIN and "n == m" in choice.reason
    with pytest.raises(ValueError, match="fused: got True"):
        prefill_attention(*args, 0.1, causal=True, fused=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_mha_fused_matches_plain_end_to_end(dtype):
    dev = _device()
    g = torch.Generator().manual_seed(1)
    ctx, new, block = [0, 300, 1200], [64, 17, 200], 64
    pages = -(-max(c + n for c, n in zip(ctx, new, strict=True)) // block)
    nb = len(ctx) * pages + 2
    table = torch.randperm(nb, generator=g)[: len(ctx) * pages].view(len(ctx), pages).int().to(dev)
    cache = LatentKVCache(nb, block, R, P, model_dtype=dtype, device=dev)
    slots = torch.arange(nb * block, device=dev)
    cache.write(torch.randn(slots.numel(), R, generator=g).to(dev, dtype),
                torch.randn(slots.numel(), P, generator=g).to(dev, dtype), slots)
    meta = BatchMetadata.build(new, ctx, table, block, num_blocks=nb, decode_threshold=0)
    T = meta.num_tokens
    q = (torch.randn(T, H, N + P, generator=g) * 0.5).to(dev, dtype)
    kv_c = torch.randn(T, R, generator=g).to(dev, dtype)
    k_pe = torch.randn(T, P, generator=g).to(dev, dtype)
    kv_b = (torch.randn(H * (N + V), R, generator=g) * R ** -0.5).to(dev, dtype)
    scale = (N + P) ** -0.5
    kw = dict(scale=scale, workspace_rows=500)  # the 1,500 cached rows take three chunks
    fused = forward_mha(q, kv_c, k_pe, cache, meta, kv_b, fused=True, **kw)
    plain = forward_mha(q, kv_c, k_pe, cache, meta, kv_b, fused=False, **kw)
    tol = TOL[dtype][0]
    torch.testing.assert_close(fused.float(), plain.float(), rtol=tol, atol=tol)
