"""DeepSeek-V4 attention through ``forward_mqa``: window keys, compressed keys and the per-head sink in one
softmax (REF_TORCH), against a float64 reference written out below; the declarations that refuse it elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from v4_forward_inputs import CBS, H, W
from v4_forward_inputs import v4_reference as _reference
from v4_forward_inputs import v4_setup as _setup

from mla_backends import LatentKVCache, RefTorchBackend, plan_step
from mla_backends.backends.capabilities import AttentionSpec
from mla_backends.backends.contract import Capabilities, MLABackend
from mla_backends.backends.v4_inputs import CompressedKeys
from mla_backends.plugins.loading import get_backend


@pytest.mark.parametrize("window", [1, 3, 8, None])
def test_window_compressed_and_sinks_match_the_reference(window):
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup()
    be = RefTorchBackend()
    comp = CompressedKeys(ccache, ctable, idx)
    scale = W ** -0.5
    out, lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale, sinks=sinks, window=window, compressed=comp,
                              plan=plan_step(meta, [be]))
    ref_out, ref_lse = _reference(meta, rows, crows, idx, q, sinks, window, scale)
    assert torch.isfinite(out).all()  # the NaN in unowned slots never reached it
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_without_compressed_keys_or_sinks_and_a_whole_window_it_is_dense_attention():
    meta, cache, _, _, _, q, _, _, _ = _setup(poison=False)  # the dense path's NaN rows are another issue's
    be = RefTorchBackend()
    scale = W ** -0.5
    dense, dense_lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale)
    windowed, w_lse = be.forward_mqa(q, q[..., :0], cache, meta, scale=scale, window=meta.max_seq_len)
    torch.testing.assert_close(windowed, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w_lse, dense_lse, rtol=1e-12, atol=1e-12)


def test_a_sink_alone_gives_zero_output_and_its_own_lse():
    meta, cache, ccache, ctable, idx, q, sinks, _, _ = _setup()
    # a sink far above every score takes all the weight: the output goes to 0, the LSE to the sink
    big = torch.full((H,), 1e4, dtype=torch.float64)
    out, lse = RefTorchBackend().forward_mqa(q, q[..., :0], cache, meta, scale=W ** -0.5, sinks=big, window=2)
    assert out.abs().max() < 1e-300 and torch.allclose(lse, big.expand_as(lse))


def test_bfloat16_within_tolerance_of_the_float64_reference():
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup(torch.bfloat16)
    qb = q.to(torch.bfloat16)
    out, _ = RefTorchBackend().forward_mqa(qb, qb[..., :0], cache, meta, scale=W ** -0.5, sinks=sinks.float(),
                                           window=4, compressed=CompressedKeys(ccache, ctable, idx))
    rows = {b: r.to(torch.bfloat16).double() for b, r in rows.items()}
    crows = {b: r.to(torch.bfloat16).double() for b, r in crows.items()}
    ref, _ = _reference(meta, rows, crows, idx, qb.double(), sinks.float().double(), 4, W ** -0.5)
    assert (out.double() - ref).abs().max() <= 8 * 2.0 ** -7 * ref.abs().max()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sinks": torch.zeros(H + 1, dtype=torch.float64)}, "sinks: got shape"),
    ({"sinks": torch.zeros(H, dtype=torch.int64)}, "sinks: got dtype"),
    ({"window": 0}, "window: got 0"),
    ({"topk_indices": torch.zeros(11, 2, dtype=torch.long), "window": 4}, "topk_indices: got a tensor"),
])
def test_bad_v4_inputs_are_refused_by_name(kwargs, match):
    meta, cache, _, _, _, q, _, _, _ = _setup()
    with pytest.raises((TypeError, ValueError), match=match):
        RefTorchBackend().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, **kwargs)


def test_bad_compressed_keys_are_refused_before_anything_runs():
    meta, cache, ccache, ctable, idx, q, sinks, _, _ = _setup()
    be = RefTorchBackend()
    narrow = LatentKVCache(4, CBS, W - 8, 8, model_dtype=torch.float64)
    with pytest.raises(ValueError, match="compressed.cache: got rows of 24\\+8"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(narrow, ctable, idx))
    far = idx.clone()
    far[0, 0] = ctable.shape[1] * CBS  # past the request's table
    with pytest.raises(ValueError, match="compressed.indices: got entries outside"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(ccache, ctable, far))
    with pytest.raises(ValueError, match="compressed.indices: got shape"):
        be.forward_mqa(q, q[..., :0], cache, meta, scale=0.1, compressed=CompressedKeys(ccache, ctable, idx[1:]))


V4_SPEC = AttentionSpec(num_heads=64, kv_lora_rank=512, qk_rope_head_dim=0, max_query_len=2, uniform_query_len=False,
                        sinks=True, window=True, compressed=True)


@pytest.mark.parametrize("name", ["FLASHINFER_MLA"])
def test_backends_without_v4_say_why(name):
    reasons = [str(r) for r in get_backend(name).not_supported_reasons(V4_SPEC)]
    for want in ("sinks: got required; supported none", "sliding window: got required; supported none",
                 "compressed keys: got required; supported none"):
        assert want in reasons
    assert not RefTorchBackend.not_supported_reasons(V4_SPEC)


class _DenseOnly(MLABackend):
    """A third-party backend declaring none of V4's features (its kernel must never see V4 inputs)."""

    name = "DENSE_ONLY"
    capabilities = Capabilities(dtypes=frozenset({torch.float64}), kv_cache_dtypes=frozenset({"float64"}), cpu=True)

    def forward_mqa_kernel(self, *args, **kwargs):  # pragma: no cover - refused before it runs
        raise AssertionError("the kernel ran")


def test_forward_mqa_refuses_v4_inputs_a_backend_does_not_declare():
    meta, cache, _, _, _, q, sinks, _, _ = _setup()
    with pytest.raises(ValueError, match="sinks: got required; supported none"):
        _DenseOnly().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, sinks=sinks)
    with pytest.raises(ValueError, match="sliding window: got required"):
        _DenseOnly().forward_mqa(q, q[..., :0], cache, meta, scale=0.1, window=4)


def test_scale_and_window_reach_the_kernel():
    """A sanity check of the reference itself: doubling the scale changes the result (the test means it)."""
    meta, cache, ccache, ctable, idx, q, sinks, rows, crows = _setup()
    a, _ = _reference(meta, rows, crows, idx, q, sinks, 3, W ** -0.5)
    b, _ = _reference(meta, rows, crows, idx, q, sinks, 4, W ** -0.5)
    assert not torch.allclose(a, b) and math.isfinite(float(a.abs().max()))
