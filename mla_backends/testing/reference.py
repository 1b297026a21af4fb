"""The conformance suite's own reference: naive *expanded* MLA in float64, written for clarity.

It shares no code with any backend (``REF_TORCH`` included). Per head ``h`` it up-projects the cached latent
rows into full keys and values with explicit matrices, broadcasts the shared RoPE key ``k_pe`` to every head,
and runs textbook softmax attention:

    k_h = [kv_c @ W_UK[h] | k_pe]            # [S, r + rope]
    v_h = kv_c @ W_UV[h]                      # [S, r]
    s_h = scale * (q_nope_h @ k_h[:, :r].T + q_pe_h @ k_pe.T)
    o_h = softmax(s_h) @ v_h,  lse_h = log(sum(exp(s_h)))   (natural log)

What a backend receives is the *absorbed* query ``q_latent = q_nope @ W_UK^T`` and what it returns is the
*latent* output ``o_latent`` with ``o_latent @ W_UV = o``. The up-projections here are random orthogonal
``r x r`` matrices (one pair shared by the heads), so both directions are exact in float64:
``q_nope = q_latent @ W_UK`` recovers the expanded query from exactly the (rounded) query the backend saw,
and ``o_latent = o @ W_UV^T`` derives the latent-space output from the expanded one.
The LSE is the same in both spaces (the scores are equal).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["UpProjections", "up_projections", "random_orthogonal", "expanded_attention", "ExpandedAttention",
           "reference_mqa", "ReferenceMQA"]

#: Householder reflections composed into each random orthogonal matrix
REFLECTIONS = 6


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A dense random orthogonal ``[n, n]`` float64 matrix: a random signed permutation composed with
    :data:`REFLECTIONS` Householder reflections (cheaper than a QR factorisation, exactly orthogonal)."""
    perm = torch.randperm(n, generator=gen)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    w = torch.zeros(n, n, dtype=torch.float64)
    w[torch.arange(n), perm] = signs
    for _ in range(REFLECTIONS):
        v = torch.randn(n, 1, generator=gen, dtype=torch.float64)
        v /= v.norm()
        w -= 2.0 * (w @ v) @ v.T  # w <- w (I - 2 v v^T)
    return w


class UpProjections:
    """Random orthogonal up-projections ``w_uk``/``w_uv`` (``[r, r]`` float64) for ``kv_lora_rank`` r.

    One pair serves every head: heads differ through their queries, and per-head matrices would change
    nothing a backend can observe (it only sees the absorbed query and returns the latent output).
    """

    def __init__(self, kv_lora_rank: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed + kv_lora_rank)
        self.w_uk = random_orthogonal(kv_lora_rank, gen)
        self.w_uv = random_orthogonal(kv_lora_rank, gen)


@functools.lru_cache(maxsize=8)
def up_projections(kv_lora_rank: int) -> UpProjections:
    """Cached :class:`UpProjections` for one latent width."""
    return UpProjections(kv_lora_rank)


class ExpandedAttention:
    """Expanded attention of ``n`` tokens with ``g`` heads each over ``S`` cached rows (float64 throughout),
    with everything that does not depend on the softmax scale computed once: call it with a scale.

    Args:
        q_nope: ``[n, g, r]`` expanded no-RoPE queries; ``q_pe``: ``[n, g, rope]`` roped queries.
        kv_c: ``[S, r]`` latent rows; ``k_pe``: ``[S, rope]`` shared RoPE keys (broadcast to every head).
        visible: ``[n, S]`` bool, which rows each query may attend to (at least one per query).
        w_uk / w_uv: ``[r, r]`` key / value up-projections.

    ``self(scale)`` returns ``(o [n, g, r], lse [n, g])``: the expanded (value-space) output and the natural-log
    LSE. The conformance hints recompute it at many scales (:mod:`.hints`), hence the split.
    """

    def __init__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                 visible: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        k_nope = kv_c @ w_uk  # [S, r]  per-head keys, materialised
        keys = torch.cat([k_nope, k_pe], dim=-1)  # [S, r + rope]: k_pe broadcast to the heads
        self.values = kv_c @ w_uv  # [S, r]  per-head values, materialised
        query = torch.cat([q_nope, q_pe], dim=-1)  # [n, g, r + rope]
        self.raw_scores = torch.einsum("ngd,sd->ngs", query, keys)  # before the softmax scale
        self.visible = visible

    def softmax(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs [n, g, S], lse [n, g])``: the attention weights and the natural-log LSE at ``scale``."""
        scores = self.raw_scores * scale
        scores = scores.masked_fill(~self.visible[:, None, :], float("-inf"))
        m = scores.max(dim=-1, keepdim=True).values
        weights = torch.exp(scores - m)
        total = weights.sum(dim=-1, keepdim=True)
        return weights / total, (m + torch.log(total)).squeeze(-1)

    def __call__(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        probs, lse = self.softmax(scale)
        return torch.einsum("ngs,sr->ngr", probs, self.values), lse


def expanded_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    visible: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded attention at one softmax ``scale`` (:class:`ExpandedAttention` for the arguments):
    ``(o [n, g, r], lse [n, g])``, float64."""
    return ExpandedAttention(q_nope, q_pe, kv_c, k_pe, visible, w_uk, w_uv)(scale)


class ReferenceMQA:
    """:func:`reference_mqa` of one request with the scale left open: ``self(scale)`` gives ``(out, lse)``
    (the scale-independent work done once, in the constructor; same arguments as :func:`reference_mqa`
    without ``scale``)."""

    def __init__(self, q_latent: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
                 visible: torch.Tensor) -> None:
        r = q_latent.shape[-1]
        self.proj = up_projections(r)
        ql = q_latent.detach().cpu().to(torch.float64)
        qr = q_rope.detach().cpu().to(torch.float64)
        rows = rows.detach().cpu().to(torch.float64)
        kv_c, k_pe = rows[:, :r], rows[:, r:]
        q_nope = ql @ self.proj.w_uk  # inverse of the absorption q_latent = q_nope @ w_uk.T (w_uk is orthogonal)
        self.attention = ExpandedAttention(q_nope, qr, kv_c, k_pe, visible, self.proj.w_uk, self.proj.w_uv)
        # the latent output is o_expanded @ w_uv.T = probs @ (values @ w_uv.T): the per-position factor is
        # scale-independent, so it is mapped back once here and each scale costs one [S]-long product
        self.latent_values = self.attention.values @ self.proj.w_uv.T  # [S, r]

    def __call__(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        probs, lse = self.attention.softmax(scale)
        return torch.einsum("ngs,sr->ngr", probs, self.latent_values), lse  # o_expanded = o_latent @ w_uv


def reference_mqa(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent-space output and LSE of the tokens of one request, derived from :func:`expanded_attention`.

    Args:
        q_latent: ``[n, heads, r]`` absorbed queries exactly as the backend received them (any float dtype).
        q_rope: ``[n, heads, rope]``.
        rows: ``[S, r + rope]`` the request's cached rows by position, dequantised to float64.
        visible: ``[n, S]`` bool mask of the positions each token attends to.
        scale: softmax scale.

    Returns:
        ``(out [n, heads, r] float64, lse [n, heads] float64)``.
    """
    return ReferenceMQA(q_latent, q_rope, rows, visible)(scale)
