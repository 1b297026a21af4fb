"""TRITON_MLA's DeepSeek-V4 kernel (``mla_backends/triton_mla/kernels_v4.py``) under ``TRITON_INTERPRET=1``, tiny
shapes: window keys, compressed keys (picks repeated and ``-1`` padded) and per-head sinks in one softmax, against
the float64 reference of ``tests/v4_forward_inputs.py`` (NaN in every slot no request owns, scattered pages,
ragged lengths: a decode, a prefill, an extend and a short request); splits merged with the sink counted once; the
layer running on it."""

from __future__ import annotations

import pytest
import torch
from v4_forward_inputs import CBS, H, W, v4_reference, v4_setup

from mla_backends import plan_step
from mla_backends.backends.v4_inputs import CompressedKeys
from mla_backends.triton_mla import TritonMLABackend
from mla_backends.triton_mla.interpreter import launch_guard

triton = pytest.importorskip("triton")  # the kernels are Triton's (run by its interpreter on a CPU)
tl = pytest.importorskip("triton.language")
from mla_backends.triton_mla.kernels_v4 import decode_e4m3  # noqa: E402

SCALE = W ** -0.5


def _call(backend, dtype, window, *, sinks=True, compressed=True, seed=0):
    meta, cache, ccache, ctable, idx, q, s, rows, crows = v4_setup(dtype, seed=seed)
    qd = q.to(dtype)
    comp = CompressedKeys(ccache, ctable, idx) if compressed else None
    sk = s.float() if sinks else None
    out, lse = backend.forward_mqa(qd, qd[..., :0], cache, meta, scale=SCALE, sinks=sk, window=window,
                                   compressed=comp)
    if dtype != torch.float32:
        rows = {b: r.to(dtype).double() for b, r in rows.items()}
        crows = {b: r.to(dtype).double() for b, r in crows.items()}
    ref_idx = idx if compressed else torch.full_like(idx, -1)
    ref_sinks = s.float().double() if sinks else torch.full_like(s, float("-inf"))
    ref, ref_lse = v4_reference(meta, rows, crows, ref_idx, qd.double(), ref_sinks, window, SCALE)
    return out, lse, ref, ref_lse


@pytest.mark.parametrize(("window", "splits"), [(3, None), (None, 3), (1, 2)])
def test_v4_kernel_matches_the_float64_reference_float32(window, splits):
    out, lse, ref, ref_lse = _call(TritonMLABackend(num_kv_splits=splits), torch.float32, window)
    assert torch.isfinite(out).all()  # the NaN of unowned slots never reaches the output
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


def test_v4_kernel_bf16_within_tolerance_and_without_sinks_or_compressed_keys():
    out, lse, ref, ref_lse = _call(TritonMLABackend(), torch.bfloat16, 4)
    assert (out.double() - ref).abs().max() <= 8 * 2.0 ** -7 * ref.abs().max()
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    out, lse, ref, ref_lse = _call(TritonMLABackend(num_kv_splits=2), torch.float32, 5, sinks=False, compressed=False)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


def test_a_sink_alone_gives_zero_output_and_its_own_lse():
    meta, cache, ccache, ctable, idx, q, _, _, _ = v4_setup(torch.float32)
    big = torch.full((H,), 60.0)
    be = TritonMLABackend(num_kv_splits=2)
    out, lse = be.forward_mqa(q.float(), q[..., :0].float(), cache, meta, scale=SCALE, sinks=big, window=2,
                              plan=plan_step(meta, [be]))
    assert out.abs().max() < 1e-12 and torch.allclose(lse, big.expand_as(lse), atol=1e-5)


def test_triton_declares_v4_and_the_layer_runs_on_it():
    """A small V4 model's layers on TRITON_MLA (interpreted, float32) against the same layers on REF_TORCH."""
    from v4_models import small_v4_layers

    from mla_backends import BatchMetadata

    ref_layers = small_v4_layers(torch.float32)[:3]
    tri_layers = small_v4_layers(torch.float32, backend="TRITON_MLA")[:3]
    assert tri_layers[1].backend_cls.capabilities.compressed and tri_layers[0].backend_cls.name == "TRITON_MLA"
    table = torch.tensor([[5, 2, 7], [0, 3, -1]], dtype=torch.int32)
    meta = BatchMetadata.build([10, 6], [0, 0], table, 4)
    x = torch.randn(meta.num_tokens, 32)
    for ref_layer, tri_layer in zip(ref_layers, tri_layers, strict=True):
        want = ref_layer(x, None, ref_layer.allocate_cache(8, 4), plan_step(meta, [ref_layer]))
        got = tri_layer(x, None, tri_layer.allocate_cache(8, 4), plan_step(meta, [tri_layer]))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_v4_tables_are_data():
    from mla_backends.triton_mla.configs import V4_CONFIG_TABLE, choose_v4_config

    assert choose_v4_config(64, "16bit", rank_pad=512, rope_pad=16, smem_limit=232_448).name == "v4-heads32-n32"
    assert choose_v4_config(16, "fp32", rank_pad=512, rope_pad=16, smem_limit=99 * 1024).fp32_dots
    assert all(c.kernel == "v4" for rule in V4_CONFIG_TABLE for c in rule.candidates)
    assert CBS == 2  # the compressed pages of the inputs hold two entries (gathers cross pages)


@triton.jit
def _decode_all(B, O):
    offs = tl.arange(0, 256)
    tl.store(O + offs, decode_e4m3(tl.load(B + offs)) * 256.0)


def test_every_fp8_byte_decodes_exactly():
    """The kernel's integer fp8 decode (for every SM80+ GPU) against torch's e4m3 values: all 254 finite bytes,
    subnormals and both zeros included."""
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256, dtype=torch.float32)
    with launch_guard(True):
        _decode_all[(1,)](bytes_, got)
    want = bytes_.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(want)
    assert int(finite.sum()) == 254 and torch.equal(got[finite], want[finite])
