"""DeepSeek-V3.2's lightning indexer: score every cached position for every query token, keep the top-k.

Per token ``t`` at position ``p`` (``x`` the hidden state, ``c_q`` the normalised query latent
``q_a_layernorm(q_a_proj(x))`` that the MLA layer already computes)::

    q_t   = rope(split(c_q @ wq_b^T))            [n_heads, head_dim]   (RoPE on the first qk_rope_head_dim)
    k_t   = rope(LayerNorm(x @ wk^T))            [head_dim]            (one key per token, cached)
    w_t   = (x @ weights_proj^T) * n_heads**-0.5 [n_heads]             (float32 projection)
    I[t, s] = sum_h w_t[h] * relu(q_t[h] . k_s) * head_dim**-0.5        for every visible s <= p

and the token attends to the ``index_topk`` positions of largest ``I[t, s]`` (2048 for V3.2). The indexer RoPE
uses the model's frequencies (``rope_theta``, YaRN) on the *leading* ``qk_rope_head_dim`` channels, in the
non-interleaved "rotate half" layout for V3.2 (``IndexerDims.rope_interleave`` covers GLM-style configs).

Before caching, keys and queries are multiplied by an orthonormal Hadamard matrix, as DeepSeek's reference
code does: it leaves every dot product unchanged and spreads outliers across channels, which keeps the fp8
keys of :class:`~.indexer_cache.IndexerKeyCache` accurate. Queries stay in floating point here (the reference
also quantises them to fp8; that is a kernel precision choice, not part of the function).

Selection is batched: requests are processed in groups whose padded working set fits a fixed element budget
(long prefills are split by tokens), never one token at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...core.attention_math import GROUP_ELEMENT_BUDGET, padded_groups
from ...core.dims import IndexerDims, MLADims
from ...core.dtypes import accumulate_dtype
from ...core.rope import RotaryEmbedding
from ...core.validation import require_device, require_int, require_on_device, require_tensor
from ...step.cache import LatentKVCache
from ...step.checks import require_step_lengths, require_whole_sequences
from ...step.metadata import BatchMetadata
from .indexer_cache import IndexerKeyCache

__all__ = ["Indexer", "hadamard_matrix", "index_scores", "causal_topk"]


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix ``[n, n]`` (``n`` a power of two), symmetric, ``H @ H = I``."""
    require_int("n", n, minimum=1)
    device = require_device("device", device)
    if n & (n - 1):
        raise ValueError(f"n: got {n}; supported a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Indexer logits ``sum_h weights[..., h] * relu(q[..., h, :] . k)`` for a batch of queries and keys.

    Args:
        q: ``[B, Q, H, D]`` queries (already scaled or not; the caller folds constants into ``weights``).
        weights: ``[B, Q, H]`` per-head weights.
        keys: ``[B, S, D]`` keys.

    Returns:
        ``[B, Q, S]`` scores in the dtype of ``q``.
    """
    B, Q, H, D = q.shape
    s = torch.matmul(q.reshape(B, Q * H, D), keys.transpose(1, 2)).relu_()  # [B, Q*H, S]
    s = s.view(B, Q, H, -1)
    return torch.matmul(weights.unsqueeze(2), s).squeeze(2)  # [B, Q, 1, H] @ [B, Q, H, S] -> [B, Q, S]


def _work_items(meta: BatchMetadata, per_row: int, per_pos: int) -> list[tuple[int, int, int, int]]:
    """Split the batch into ``(req0, req1, tok0, tok1)`` groups that fit :data:`GROUP_ELEMENT_BUDGET`.

    A group of consecutive requests covers their new tokens ``tok0 .. tok1`` (offsets within each request;
    ``0 .. max query len`` for a whole group). A request too large for the budget on its own is split into
    token ranges. Working set of a group: ``requests * seq * (per_pos + tokens * per_row)`` elements.
    """
    items: list[tuple[int, int, int, int]] = []
    qs, ss, n = meta.query_lens_list, meta.seq_lens_list, meta.num_requests
    seg = 0  # first request of the current run of requests that fit the budget alone
    for i in range(n + 1):
        big = i < n and qs[i] > 0 and ss[i] * (per_pos + qs[i] * per_row) > GROUP_ELEMENT_BUDGET
        if i < n and not big:
            continue
        for a, b in padded_groups(ss[seg:i], qs[seg:i], per_pos, per_row, GROUP_ELEMENT_BUDGET):
            if max(qs[seg + a: seg + b]):  # groups of zero-length requests select nothing
                items.append((seg + a, seg + b, 0, max(qs[seg + a: seg + b])))
        if big:  # too big alone: split its tokens
            step = max(1, (GROUP_ELEMENT_BUDGET // ss[i] - per_pos) // per_row)
            items.extend((i, i + 1, j, min(qs[i], j + step)) for j in range(0, qs[i], step))
        seg = i + 1
    return items


def causal_topk(q: torch.Tensor, weights: torch.Tensor, cache: IndexerKeyCache, meta: BatchMetadata,
                topk: int) -> torch.Tensor:
    """Top-``topk`` cached positions per token by indexer score, causally; ``-1`` pads missing entries.

    Args:
        q: ``[T, H, D]`` indexer queries (processing order, as ``meta``), float.
        weights: ``[T, H]`` per-head weights, constants (``n_heads**-0.5 * head_dim**-0.5``) folded in.
        cache: the indexer key cache holding every visible position (this step's keys already written).
        meta: the step's metadata; token ``t`` sees positions ``0 .. meta.token_positions[t]``.
        topk: positions to keep per token.

    Returns:
        ``int32 [T, topk]``: positions of the highest scores, best first; a token at position ``p`` with
        ``p + 1 < topk`` gets its ``p + 1`` visible positions followed by ``-1``.
    """
    if not isinstance(cache, IndexerKeyCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported IndexerKeyCache")
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    require_int("topk", topk, minimum=1)
    T = meta.num_tokens
    require_tensor("q", q, shape=(T, None, cache.head_dim))
    H = q.shape[1]
    require_tensor("weights", weights, shape=(T, H))
    if not q.is_floating_point() or not weights.is_floating_point():
        raise TypeError(f"q/weights: got dtypes {q.dtype}/{weights.dtype}; supported floating point")
    if meta.block_size != cache.block_size:
        raise ValueError(f"meta.block_size: got {meta.block_size}; supported the cache's {cache.block_size}")
    require_whole_sequences(meta, "causal_topk")
    require_step_lengths(meta, "causal_topk")
    require_on_device(cache.device, q=q, weights=weights, **{"meta.block_table": meta.block_table})

    dev = q.device
    out = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    if T == 0:
        return out
    cdt = accumulate_dtype(q.dtype)
    q, weights = q.to(cdt), weights.to(cdt)
    bs, D, W = cache.block_size, cache.head_dim, cache.row_width
    starts = meta.query_starts_list
    for g0, g1, j0, j1 in _work_items(meta, per_row=H + 2, per_pos=D + W):
        qlens = meta.query_lens_list[g0:g1]
        ctxs = meta.context_lens_list[g0:g1]
        b, Q = g1 - g0, j1 - j0
        S = max(c + min(n, j1) for c, n in zip(ctxs, qlens, strict=True))
        if S == 0:
            continue
        pages = -(-S // bs)
        bt = meta.block_table[g0:g1, :pages].long().clamp_min(0)
        keys = cache.dequantize(cache.data[bt].reshape(b, pages * bs, W)[:, :S], cdt)  # [b, S, D]
        j = j0 + torch.arange(Q, device=dev)
        ql = torch.tensor(qlens, device=dev)[:, None]
        base = torch.tensor(starts[g0:g1], device=dev)[:, None]
        tok = torch.where(j[None, :] < ql, base + j[None, :], torch.full_like(base + j, -1))  # [b, Q]
        safe = tok.clamp_min(0)
        scores = index_scores(q[safe], weights[safe], keys)  # [b, Q, S]
        last = torch.tensor(ctxs, device=dev)[:, None] + j[None, :]  # last visible position per query
        visible = torch.arange(S, device=dev)[None, None, :] <= last[:, :, None]
        scores.masked_fill_(~visible, float("-inf"))
        k = min(topk, S)
        vals, idx = torch.topk(scores, k, dim=-1, sorted=True)
        idx = torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx).to(torch.int32)
        flat, keep = tok.reshape(-1), tok.reshape(-1) >= 0
        out[flat[keep], :k] = idx.reshape(b * Q, k)[keep]
    return out


class Indexer(nn.Module):
    """The V3.2 indexer of one layer: its projections, its RoPE and the causal top-k selection.

    Parameter names follow the checkpoints (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``), so
    ``load_state_dict`` takes a layer's ``...self_attn.indexer.*`` weights (or transformers'
    ``DeepseekV32Indexer.state_dict()``) directly.

    Args:
        hidden_size: model width (input of ``wk`` and ``weights_proj``).
        q_lora_rank: width of the query latent fed to ``wq_b``.
        indexer: head count, head width, top-k and RoPE layout.
        rope: RoPE frequencies of the model over ``qk_rope_head_dim`` channels; the layout is taken from
            ``indexer.rope_interleave``.
        rotate: multiply keys and queries by a Hadamard matrix before caching (needs a power-of-two head
            width; scores are unchanged, fp8 error is smaller).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, indexer: IndexerDims, rope: RotaryEmbedding, *,
                 rotate: bool = True, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 layer_norm_eps: float = 1e-6) -> None:
        super().__init__()
        require_int("hidden_size", hidden_size, minimum=1)
        require_int("q_lora_rank", q_lora_rank, minimum=1)
        device = require_device("device", device)
        if not isinstance(indexer, IndexerDims):
            raise TypeError(f"indexer: got {type(indexer).__name__}; supported IndexerDims")
        require_int("indexer.n_heads", indexer.n_heads, minimum=1)
        require_int("indexer.head_dim", indexer.head_dim, minimum=1)
        require_int("indexer.topk", indexer.topk, minimum=1)
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope: got {type(rope).__name__}; supported RotaryEmbedding")
        if rope.dim > indexer.head_dim:
            raise ValueError(f"rope.dim: got {rope.dim}; supported <= indexer.head_dim={indexer.head_dim}")
        hd = indexer.head_dim
        if rotate and hd & (hd - 1):
            raise ValueError(f"rotate: got True with indexer.head_dim={hd}; supported a power-of-two "
                             "head_dim (or rotate=False)")
        self.dims = indexer
        self.n_heads, self.head_dim, self.topk = indexer.n_heads, hd, indexer.topk
        self.rope = RotaryEmbedding(rope.dim, rope.base, rope.scaling, interleave=indexer.rope_interleave)
        self.rope_dim = rope.dim
        self.rotate = bool(rotate)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.wq_b = nn.Linear(q_lora_rank, indexer.n_heads * hd, bias=False, **kw)
        self.wk = nn.Linear(hidden_size, hd, bias=False, **kw)
        self.k_norm = nn.LayerNorm(hd, eps=layer_norm_eps, **kw)
        # the checkpoints store it in bf16; the reference computes it in float32 (as transformers does)
        wp_dtype = accumulate_dtype(dtype)
        self.weights_proj = nn.Linear(hidden_size, indexer.n_heads, bias=False, dtype=wp_dtype, device=device)
        self.register_buffer("hadamard", hadamard_matrix(hd, torch.float32, device) if self.rotate else None,
                             persistent=False)

    @classmethod
    def from_dims(cls, dims: MLADims, **kwargs: Any) -> Indexer:
        """The indexer of a sparse layer described by ``dims`` (with ``indexer`` and ``q_lora_rank``)."""
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
        if dims.indexer is None:
            raise ValueError(f"dims: got {dims.name!r} without an indexer; supported a sparse (V3.2) MLADims")
        if dims.q_lora_rank is None:
            raise ValueError("dims.q_lora_rank: got None; supported an int (the indexer reads the q latent)")
        return cls(dims.hidden_size, dims.q_lora_rank, dims.indexer,
                   RotaryEmbedding(dims.qk_rope_head_dim, dims.rope_theta, dims.rope_scaling), **kwargs)

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, topk={self.topk}, "
                f"rope_dim={self.rope_dim}, rope_interleave={self.rope.interleave}, rotate={self.rotate}")

    # ---- projections ------------------------------------------------------------------------------------
    def _rope_first(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the leading ``rope_dim`` channels of ``x [T, ..., head_dim]``."""
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim:]
        (rot,) = self.rope(positions, rot)
        return torch.cat([rot, rest], dim=-1)

    def _hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ H`` computed in float32 (float64 stays float64), returned in ``x``'s dtype."""
        if self.hadamard is None:
            return x
        acc = accumulate_dtype(x.dtype)
        return torch.matmul(x.to(acc), self.hadamard.to(acc)).to(x.dtype)

    def keys(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``[T, head_dim]`` (what the cache stores) for ``hidden_states [T, hidden]``."""
        k = self.k_norm(self.wk(hidden_states))
        return self._hadamard(self._rope_first(k, positions))

    def queries(self, q_resid: torch.Tensor, hidden_states: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [T, n_heads, head_dim], weights [T, n_heads])``; scale constants folded into weights."""
        T = q_resid.shape[0]
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        q = self._hadamard(self._rope_first(q, positions))
        w = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype))
        w = w.to(accumulate_dtype(q.dtype))
        w = w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def _checked(self, hidden_states: torch.Tensor, cache: IndexerKeyCache | LatentKVCache,
                 meta: BatchMetadata, positions: torch.Tensor | None) -> tuple[IndexerKeyCache, torch.Tensor]:
        """Validate the common arguments; return the indexer key cache and the RoPE positions."""
        if not isinstance(meta, BatchMetadata):
            raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
        if isinstance(cache, LatentKVCache):
            keys_cache = getattr(cache, "indexer_cache", None)
            if keys_cache is None:
                raise ValueError(f"cache: got a {type(cache).__name__} without an indexer cache; supported "
                                 "an IndexerKeyCache or a SparseKVCache of an indexing layer")
            cache = keys_cache
        if not isinstance(cache, IndexerKeyCache):
            raise TypeError(f"cache: got {type(cache).__name__}; supported IndexerKeyCache or SparseKVCache")
        T = meta.num_tokens
        require_tensor("hidden_states", hidden_states, shape=(T, self.wk.in_features))
        if cache.head_dim != self.head_dim:
            raise ValueError(f"cache.head_dim: got {cache.head_dim}; supported the indexer's {self.head_dim}")
        if positions is None:
            positions = meta.token_positions
        require_tensor("positions", positions, shape=(T,), dtypes=(torch.int32, torch.int64))
        return cache, positions.to(hidden_states.device)

    @torch.no_grad()
    def write_keys(self, hidden_states: torch.Tensor, cache: IndexerKeyCache | LatentKVCache,
                   meta: BatchMetadata, *, positions: torch.Tensor | None = None) -> None:
        """Only cache this step's keys (when the top-k comes from elsewhere); arguments as :meth:`forward`."""
        keys_cache, positions = self._checked(hidden_states, cache, meta, positions)
        keys_cache.write(self.keys(hidden_states, positions), meta.slot_mapping.to(keys_cache.device))

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                cache: IndexerKeyCache | LatentKVCache, meta: BatchMetadata, *,
                positions: torch.Tensor | None = None, topk: int | None = None) -> torch.Tensor:
        """Write this step's keys into the indexer cache and select each token's top-k positions.

        Args:
            hidden_states: ``[T, hidden_size]`` in processing order (as ``meta``).
            q_resid: ``[T, q_lora_rank]`` the normalised query latent of the same tokens.
            cache: this layer's :class:`IndexerKeyCache`, or a :class:`~.layer_support.SparseKVCache` holding
                it (paged like the latent cache; slots come from ``meta``).
            meta: the step's metadata; causality follows ``meta.token_positions``.
            positions: ``[T]`` RoPE positions (default ``meta.token_positions``).
            topk: override of ``indexer.topk``.

        Returns:
            ``int32 [T, topk]`` positions, best first, ``-1`` padded (``forward_mqa``'s ``topk_indices``).
        """
        keys_cache, positions = self._checked(hidden_states, cache, meta, positions)
        require_whole_sequences(meta, "the sparse indexer")  # before the keys are written
        require_step_lengths(meta, "the sparse indexer")
        require_tensor("q_resid", q_resid, shape=(meta.num_tokens, self.wq_b.in_features))
        k_topk = self.topk if topk is None else require_int("topk", topk, minimum=1)
        keys_cache.write(self.keys(hidden_states, positions), meta.slot_mapping.to(keys_cache.device))
        q, w = self.queries(q_resid, hidden_states, positions)
        return causal_topk(q, w, keys_cache, meta, k_topk)
