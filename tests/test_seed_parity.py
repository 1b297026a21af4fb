"""The seed's own float64 parity check, and its causal pair count checked against the reference backend.

Absorption is an exact algebraic identity: ``q (c W_UK)^T == (q W_UK^T) c^T`` for the scores and
``a (c W_UV) == (a c) W_UV`` for the outputs. With a prefix of P cached tokens and Q new ones, causal
attention among the new tokens covers ``Q * P + Q * (Q + 1) / 2`` (query, key) pairs: 21 for P=5, Q=3.
"""

from __future__ import annotations

import numpy as np
import torch

from mla_backends.cache import LatentKVCache
from mla_backends.metadata import BatchMetadata
from mla_backends.ref_torch import RefTorchBackend


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_absorbed_and_expanded_agree_in_float64():
    rng = np.random.default_rng(42)
    queries, context, rank, key_dim, value_dim, rope_dim = 3, 5, 4, 2, 3, 2
    c = rng.normal(size=(context, rank))
    q = rng.normal(size=(queries, key_dim))
    q_rope = rng.normal(size=(queries, rope_dim))
    k_rope = rng.normal(size=(context, rope_dim))
    uk = rng.normal(size=(rank, key_dim))
    uv = rng.normal(size=(rank, value_dim))
    scale = (key_dim + rope_dim) ** -0.5
    expanded_scores = (q @ (c @ uk).T + q_rope @ k_rope.T) * scale
    absorbed_scores = ((q @ uk.T) @ c.T + q_rope @ k_rope.T) * scale
    np.testing.assert_allclose(absorbed_scores, expanded_scores, atol=1e-12)
    a = _softmax(expanded_scores)
    np.testing.assert_allclose(_softmax(absorbed_scores), a, atol=1e-12)
    np.testing.assert_allclose(a @ (c @ uv), (a @ c) @ uv, atol=1e-12)
    # the scale is part of the function: the latent width's scale gives different probabilities
    wrong = _softmax(((q @ uk.T) @ c.T + q_rope @ k_rope.T) * (rank + rope_dim) ** -0.5)
    assert np.abs(wrong - a).max() > 1e-3


def test_causal_pair_count_is_21():
    """Prefix P=5, Q=3 new tokens: 3*5 + 3*4/2 = 21 visible pairs, as the metadata and the backend see it.

    With a zero query every visible score is 0, so ``exp(lse)`` counts the visible positions exactly.
    """
    P, Q = 5, 3
    assert Q * P + Q * (Q + 1) // 2 == 21
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
