"""RoPE on the decoupled slice: agreement with transformers' DeepSeek-V3 rotary functions (both layouts,
default and YaRN), the relative-position property, and input validation."""

from __future__ import annotations

import pytest
import torch
from layer_cases import tiny_config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from mla_backends.core.dims import MLADims, RopeScaling
from mla_backends.core.rope import RotaryEmbedding, rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("yarn", [None, (1.0, 1.0), (0.707, 1.0), (1.0, None)])
def test_matches_transformers(interleave, yarn):
    """``yarn``: ``(mscale, mscale_all_dim)`` (None: plain RoPE); unequal values scale cos/sin by their mscale
    ratio, an absent ``mscale_all_dim`` by ``yarn_mscale(factor)``."""
    cfg = tiny_config(interleave=interleave, yarn=yarn is not None)
    if yarn is not None:
        params = {k: v for k, v in cfg.rope_parameters.items() if k not in ("mscale", "mscale_all_dim")}
        cfg.rope_parameters = {**params, "mscale": yarn[0]} | ({} if yarn[1] is None else {"mscale_all_dim": yarn[1]})
    rope = RotaryEmbedding.from_dims(MLADims.from_hf_config(cfg))
    assert (rope.attention_factor == 1.0) == (yarn in (None, (1.0, 1.0)))
    T, H = 37, 3
    pos = torch.randint(0, 250, (T,))
    q = torch.randn(T, H, 8, dtype=torch.float64)
    k = torch.randn(T, 8, dtype=torch.float64)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(q, pos[None])
    fn = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    # transformers' layout: [batch, heads, seq, dim]
    q_ref, k_ref = fn(q.permute(1, 0, 2)[None], k[None, None], cos, sin)
    q_got, k_got = rope(pos, q, k)
    torch.testing.assert_close(q_got, q_ref[0].permute(1, 0, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_got, k_ref[0, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleave", [True, False])
def test_scores_depend_only_on_relative_position(interleave):
    rope = RotaryEmbedding(16, 10000.0, None, interleave)
    g = torch.Generator().manual_seed(0)  # the test's own draw, not the suite's global RNG state
    q, k = torch.randn(1, 16, dtype=torch.float64, generator=g), torch.randn(1, 16, dtype=torch.float64, generator=g)
    # the angles come from float32 frequencies (as in transformers), so the invariance holds to about 1e-5 of
    # |q||k| in absolute terms; a relative test fails whenever the score itself happens to be near 0
    tol = 1e-5 * float(q.norm() * k.norm())

    def score(pq, pk):
        (rq,) = rope(torch.tensor([pq]), q)
        (rk,) = rope(torch.tensor([pk]), k)
        return float(rq @ rk.T)

    assert abs(score(10, 3) - score(107, 100)) <= tol
    assert abs(score(10, 3) - score(10, 4)) > 100 * tol


def test_yarn_frequencies_blend_interpolation_and_extrapolation():
    plain, f1 = rope_inv_freq(64, 10000.0, None)
    scaling = RopeScaling(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096)
    yarn, f2 = rope_inv_freq(64, 10000.0, scaling)
    assert f1 == 1.0 and f2 == pytest.approx(1.0)  # mscale == mscale_all_dim: cos/sin unscaled
    assert torch.equal(yarn[:5], plain[:5])  # fast (high-frequency) pairs kept
    torch.testing.assert_close(yarn[-3:], plain[-3:] / 40.0)  # slow pairs interpolated by the factor


def test_rejects_bad_input():
    rope = RotaryEmbedding(8)
    with pytest.raises(TypeError, match="positions: got dtype float32"):
        rope(torch.zeros(3), torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"x\[0\]: got shape \[3, 6\]"):
        rope(torch.arange(3), torch.zeros(3, 6))
    with pytest.raises(ValueError, match="qk_rope_head_dim: got 7"):
        RotaryEmbedding(7)
