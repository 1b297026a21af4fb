"""The prefill kernel choice (:mod:`mla_backends.layer.prefill_kernels`), on the CPU.

* the choice by device, compute capability, dtype, head widths and mask, with the reason shown (CUDA
  devices are described, not present: the capability is passed, or ``torch.cuda`` is faked);
* the CUDA kernels' plumbing (rope key broadcast, value padding, LSE slicing, blocks and chunks merged by
  LSE, the causal diagonal) with stand-ins for the torch ops that compute the attention exactly and return
  what the real ops return (shapes, padded LSE) -- the real ops run in tests/test_prefill_gpu.py;
* ``prefill_attention`` routes to the chosen kernel, ``fused=True`` refuses with the reason, and the choice
  is logged once.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mla_backends.layer import prefill, prefill_kernels
from mla_backends.layer.prefill_kernels import KernelChoice, PrefillKernel, choose_prefill_kernel, kernel_problem

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
H, N, P, V = 4, 16, 8, 12


def choice(device=CUDA, dtype=torch.bfloat16, *, qk=192, v=128, n=64, m=64, causal=True, cc=(9, 0)):
    return choose_prefill_kernel(device, dtype, head_dim_qk=qk, head_dim_v=v, n=n, m=m, causal=causal,
                                 capability=cc if device.type == "cuda" else None)


# ---- the choice ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_cuda_half_precision_takes_torch_flash_with_the_value_padded(dtype, cc):
    got = choice(dtype=dtype, cc=cc)
    assert got.kernel == PrefillKernel.CUDA_FLASH and got.fused
    assert got.reason.startswith(f"aten::_scaled_dot_product_flash_attention on SM{cc[0]}{cc[1]}, ")
    assert str(got).startswith("cuda_flash: ")


def test_cuda_float32_and_old_gpus_take_the_efficient_kernel_and_say_why():
    got = choice(dtype=torch.float32)
    assert got.kernel == PrefillKernel.CUDA_EFFICIENT
    assert got.reason == ("aten::_scaled_dot_product_efficient_attention on SM90, float32; "
                          "not cuda_flash: dtype float32; it takes bfloat16, float16")
    got = choice(cc=(7, 5))
    assert got.kernel == PrefillKernel.CUDA_EFFICIENT and "cuda_flash: SM75; it needs SM80 or newer" in got.reason
    wide = choice(qk=320, v=256)  # wider than flash takes
    assert wide.kernel == PrefillKernel.CUDA_EFFICIENT and "head width 320" in wide.reason
    wider_value = choice(qk=64, v=128)  # flash pads the value, never the key
    assert wider_value.kernel == PrefillKernel.CUDA_EFFICIENT and "value width 128 > key width 64" in wider_value.reason


def test_cuda_falls_back_to_plain_with_every_obstacle():
    f64 = choice(dtype=torch.float64)
    assert f64.kernel == PrefillKernel.PLAIN and not f64.fused
    assert f64.reason == ("cuda_flash: dtype float64; it takes bfloat16, float16; "
                          "cuda_efficient: dtype float64; it takes bfloat16, float16, float32")
    bottom_right = choice(n=3, m=8)  # causal with n != m: both kernels align the mask top-left
    assert bottom_right.kernel == PrefillKernel.PLAIN and "causal with 3 queries over 8 keys" in bottom_right.reason
    assert choice(n=3, m=8, causal=False).kernel == PrefillKernel.CUDA_FLASH  # a context chunk: no mask
    assert choice(n=0, m=8, causal=False).kernel == PrefillKernel.PLAIN
    assert choice(cc=(3, 7)).kernel == PrefillKernel.PLAIN
    assert choice(dtype=torch.float32, qk=190, v=128).kernel == PrefillKernel.PLAIN  # 190 is not 4-aligned


def test_cpu_choices_are_the_cpu_flash_kernel_or_plain():
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert choice(CPU, dt).kernel == PrefillKernel.CPU_FLASH
    f64 = choice(CPU, torch.float64)
    assert f64.kernel == PrefillKernel.PLAIN and "dtype float64" in f64.reason
    meta = choice(torch.device("meta"))
    assert meta.kernel == PrefillKernel.PLAIN and "device meta" in meta.reason
    assert "runs on CUDA only" in kernel_problem(PrefillKernel.CUDA_FLASH, device_type="cpu", capability=None,
                                                 dtype=torch.bfloat16, head_dim_qk=192, head_dim_v=128, n=1,
                                                 m=1, causal=False)


def test_the_capability_is_read_from_torch_cuda_when_not_given(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: asked.append(dev) or (8, 6))
    got = choose_prefill_kernel(CUDA, torch.bfloat16, head_dim_qk=192, head_dim_v=128, n=5, m=5, causal=True)
    assert asked == [CUDA] and got.kernel == PrefillKernel.CUDA_FLASH and "SM86" in got.reason


def test_a_torch_without_the_op_is_a_reason(monkeypatch):
    monkeypatch.setattr(prefill_kernels, "TORCH_OPS", {**prefill_kernels.TORCH_OPS,
                                                       PrefillKernel.CUDA_FLASH: "_no_such_op"})
    got = choice()
    assert got.kernel == PrefillKernel.CUDA_EFFICIENT and "has no aten::_no_such_op" in got.reason


def test_the_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(prefill_kernels, "_LOGGED", set())
    with caplog.at_level(logging.DEBUG, logger="mla_backends.layer.prefill_kernels"):
        choice(n=7, m=7)
        choice(n=7, m=7)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["prefill attention (7 x 7, causal=True): cuda_flash: "
                     "aten::_scaled_dot_product_flash_attention on SM90, bfloat16"]


# ---- the CUDA kernels' plumbing, with exact stand-ins -------------------------------------------------------
def _exact(q, k, v, causal, scale):
    """``[1, H, n, D]`` attention in float64 with a top-left causal mask: ``(out, lse [1, H, n])``."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).to(q.dtype), torch.logsumexp(s, -1).float()


class FakeOps:
    """Stand-ins for ``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` on CPU tensors."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, tuple, bool]] = []

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        self.calls.append(("flash", tuple(k.shape), tuple(v.shape), is_causal))
        o, lse = _exact(q, k, v, is_causal, scale)
        return o, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def efficient(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        assert attn_bias is None and compute_log_sumexp and q.shape[-1] == k.shape[-1]
        self.calls.append(("efficient", tuple(k.shape), tuple(v.shape), is_causal))
        o, lse = _exact(q, k, v, is_causal, scale)
        rows = q.shape[2]
        padded = torch.full((1, q.shape[1], math.ceil(rows / 32) * 32), float("nan"))  # the op pads to 32
        padded[..., :rows] = lse
        return o, padded, None, None


@pytest.fixture
def fake_ops(monkeypatch):
    ops = FakeOps()
    table = {PrefillKernel.CUDA_FLASH: ops.flash, PrefillKernel.CUDA_EFFICIENT: ops.efficient}
    real = prefill_kernels.torch_op
    monkeypatch.setattr(prefill_kernels, "torch_op", lambda k: table.get(k) or real(k))
    return ops


def _inputs(n, m, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return t(n, H, N), t(n, H, P), t(m, H, N), t(m, P), t(m, H, V)


def _naive(q_nope, q_pe, k_nope, k_pe, v, scale, causal):
    """float64 bottom-right causal attention: ``(o [n, H, V], lse [n, H])``."""
    s = torch.einsum("nhd,mhd->hnm", q_nope.double(), k_nope.double())
    s += torch.einsum("nhd,md->hnm", q_pe.double(), k_pe.double())
    s *= scale
    n, m = q_nope.shape[0], k_nope.shape[0]
    if causal:
        s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n), float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1).t()


@pytest.mark.parametrize("kernel", [PrefillKernel.CUDA_FLASH, PrefillKernel.CUDA_EFFICIENT])
@pytest.mark.parametrize("n, m, causal", [(9, 9, True), (5, 37, False), (1, 1, True)])
def test_cuda_kernels_pad_slice_and_match_the_naive_attention(kernel, n, m, causal, fake_ops):
    args = _inputs(n, m, seed=n + m)
    o, lse = prefill_kernels.cuda_fused_attention(kernel, *args, 0.3, causal)
    ref_o, ref_lse = _naive(*args, 0.3, causal)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == (n, H, V) and lse.shape == (n, H)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    (name, k_shape, v_shape, masked), = fake_ops.calls
    assert k_shape == (1, H, m, N + P) and masked == causal
    assert v_shape == ((1, H, m, N + P) if kernel == PrefillKernel.CUDA_FLASH else (1, H, m, V))


def test_cuda_kernels_block_queries_and_keys_and_merge_by_lse(monkeypatch, fake_ops):
    monkeypatch.setattr(prefill_kernels, "CUDA_FUSED_BYTES", H * (N + P) * 4 * 40)  # 40 rows per block
    args = _inputs(100, 100, seed=3)
    o, lse = prefill_kernels.cuda_fused_attention(PrefillKernel.CUDA_FLASH, *args, 0.2, True)
    keys = [(c[1][2], c[3]) for c in fake_ops.calls]
    assert keys == [(40, True), (40, False), (40, True), (40, False), (40, False), (20, True)]
    ref_o, ref_lse = _naive(*args, 0.2, True)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_prefill_attention_routes_to_the_chosen_cuda_kernel(monkeypatch, fake_ops):
    picked = KernelChoice(PrefillKernel.CUDA_EFFICIENT, "described for the test")
    monkeypatch.setattr(prefill, "prefill_kernel_for", lambda *a, **k: picked)
    args = _inputs(6, 6, seed=1)
    o, lse = prefill.prefill_attention(*args, 0.3, causal=True)
    assert [c[0] for c in fake_ops.calls] == ["efficient"]
    torch.testing.assert_close(o.double(), _naive(*args, 0.3, True)[0], rtol=1e-5, atol=1e-5)
    fake_ops.calls.clear()
    prefill.prefill_attention(*args, 0.3, causal=True, fused=False)
    assert fake_ops.calls == []
    monkeypatch.setattr(prefill, "prefill_kernel_for",
                        lambda *a, **k: KernelChoice(PrefillKernel.PLAIN, "cuda_flash: SM75; it needs SM80"))
    with pytest.raises(ValueError, match="fused: got True; .*cuda_flash: SM75; it needs SM80"):
        prefill.prefill_attention(*args, 0.3, causal=True, fused=True)


def test_prefill_kernel_for_reads_the_widths_from_the_tensors():
    q_nope, q_pe, _, _, v = _inputs(3, 3)
    got = prefill.prefill_kernel_for(q_nope, q_pe, v, 3, True)
    assert got.kernel == PrefillKernel.CPU_FLASH
    assert prefill.fused_applies(q_nope.double(), 3, 3, True).startswith("dtype float64")
