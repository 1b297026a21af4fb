"""Absorption against the naive expanded path in float64, and the causal pair count seen by the reference backend.

Absorption is an exact algebraic identity: ``q (c W_UK)^T == (q W_UK^T) c^T`` for the scores and
``a (c W_UV) == (a c) W_UV`` for the outputs, so ``naive.expanded_decode`` (per-head K and V up-projected from
the cache) and ``RefTorchBackend`` (absorbed, on the latent rows) agree to rounding in float64. With a prefix of
P cached tokens and Q new ones, causal attention among the new tokens covers ``Q * P + Q * (Q + 1) / 2``
(query, key) pairs: 21 for P=5, Q=3.
"""

from __future__ import annotations

import torch

from mla_backends.backends.naive import expanded_decode
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata


def test_absorbed_reference_matches_naive_expanded_decode_in_float64():
    H, P, r, R, V, bs = 3, 5, 4, 2, 3, 4
    g = torch.Generator().manual_seed(42)
    f64 = {"generator": g, "dtype": torch.float64}
    cache = LatentKVCache(6, bs, r, R, model_dtype=torch.float64)
    cache.data.copy_(torch.randn(cache.data.shape, **f64))
    meta = BatchMetadata.build([1, 1, 1], [5, 1, 9], torch.tensor([[4, 0, -1], [2, -1, -1], [1, 5, 3]]), bs,
                               num_blocks=6)
    q_nope, q_pe = torch.randn(3, H, P, **f64), torch.randn(3, H, R, **f64)
    w_uk, w_uv = torch.randn(H, P, r, **f64), torch.randn(H, r, V, **f64)
    scale = (P + R) ** -0.5
    expanded = expanded_decode(q_nope, q_pe, w_uk, w_uv, cache, meta, scale)
    q_latent = torch.einsum("bhp,hpr->bhr", q_nope, w_uk)
    latent_out, _ = RefTorchBackend().forward_mqa(q_latent, q_pe, cache, meta, scale=scale)
    absorbed = torch.einsum("bhr,hrv->bhv", latent_out, w_uv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-12, atol=1e-12)
    # the scale is part of the function: the latent width's scale gives different outputs
    wrong, _ = RefTorchBackend().forward_mqa(q_latent, q_pe, cache, meta, scale=(r + R) ** -0.5)
    assert (torch.einsum("bhr,hrv->bhv", wrong, w_uv) - expanded).abs().max() > 1e-3


def test_causal_pair_count_is_21():
    """Prefix P=5, Q=3 new tokens: 3*5 + 3*4/2 = 21 visible pairs, as the metadata and the backend see it.

    With a zero query every visible score is 0, so ``exp(lse)`` counts the visible positions exactly.
    """
    P, Q = 5, 3
    meta = BatchMetadata.build([Q], [P], torch.tensor([[0]]), 16, num_blocks=1)
    assert sum(p + 1 for p in meta.token_positions.tolist()) == 21
    cache = LatentKVCache(1, 16, 4, 2, model_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    cache.write(torch.randn(P + Q, 4, generator=g, dtype=torch.float64),
                torch.randn(P + Q, 2, generator=g, dtype=torch.float64), torch.arange(P + Q))
    H = 2
    _, lse = RefTorchBackend().forward_mqa(torch.zeros(Q, H, 4, dtype=torch.float64),
                                           torch.zeros(Q, H, 2, dtype=torch.float64), cache, meta, scale=0.5)
    visible = torch.exp(lse.double())  # [Q, H]
    torch.testing.assert_close(visible[:, 0], torch.tensor([6.0, 7.0, 8.0], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    assert round(float(visible[:, 0].sum())) == 21
