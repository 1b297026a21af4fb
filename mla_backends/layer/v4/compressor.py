"""DeepSeek-V4's gated compressor and the CSA indexer: :class:`V4Compressor`, :class:`V4Indexer`.

**Compressor** (ratio ``r``, entry width ``d``; CSA overlaps windows, ``c = 2``, HCA does not, ``c = 1``). Every
token ``t`` at position ``p`` projects ``kv_t = x_t W_kv`` and ``z_t = x_t W_gate + B[p mod r]`` (``[c * d]``
each; ``B`` is the learned ``position_bias [r, c * d]``); both go to the state store at the token's slot. Entry
``w`` pools its window ``w*r .. w*r + r - 1`` (HCA), or (CSA) the second half (``[d:]``) of its window's rows
together with the first half (``[:d]``) of the window before, ``2r`` rows::

    entry_w = RMSNorm( sum_j softmax_j(z_j) * kv_j )      (softmax over the pooled rows, per channel)

then its last ``rope_head_dim`` channels are rotated at position ``w * r`` (the ``compress`` rotary). Rows before
position 0 (CSA's first window) weigh nothing. An entry is made in the step that brings its last token; until then
its tokens wait in the state store, so prefill, chunked prefill and decode are one computation.

**Indexer** (CSA only): a second compressor of width ``index_head_dim`` (``d_I``) writes one key per entry; a token
scores every entry it may see as ``sum_h w_h * relu(q_h . k) / sqrt(d_I)`` with ``q = rope(q_resid W_q)``
(``[index_n_heads, d_I]``) and ``w = x W_w / sqrt(index_n_heads)``, and keeps the ``index_topk`` best (``-1`` where
it sees fewer). Selection runs in float32 (float64 for float64 layers) in token chunks that fit
``GROUP_ELEMENT_BUDGET``; no device value is read.
"""

from __future__ import annotations

import torch

from ...core.attention_math import GROUP_ELEMENT_BUDGET
from ...core.dtypes import accumulate_dtype
from ...core.v4rope import V4Rotary
from ...step.cache import LatentKVCache, PagedRows
from ...step.v4 import EntryPlan
from ..projections import linear, rms_norm
from ..sparse.indexer_cache import IndexerKeyCache
from .cache import CompressorStateCache

__all__ = ["V4Compressor", "V4Indexer", "pooled_entries", "weight_param", "weight_holder"]


def weight_param(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    """A zeroed frozen parameter (loaded later)."""
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


def weight_holder(out_features: int, in_features: int, *, dtype: torch.dtype,
                   device: torch.device) -> torch.nn.Module:
    """A module holding one zeroed ``weight [out_features, in_features]`` (a linear map under its name)."""
    mod = torch.nn.Module()
    mod.weight = weight_param(out_features, in_features, dtype=dtype, device=device)
    return mod


def pooled_entries(rows: torch.Tensor, valid: torch.Tensor, ratio: int, width: int, overlap: bool) -> torch.Tensor:
    """The gated pool of each entry: ``rows [n, span, 2 * c * width]`` (``kv | gate`` of its tokens, oldest
    first), ``valid [n, span]`` -> ``[n, width]`` (before the norm). CSA (``overlap``): the older ``ratio`` rows give
    their first halves, the newer their second halves."""
    c = 2 if overlap else 1
    if overlap:
        kv = torch.cat([rows[:, :ratio, :width], rows[:, ratio:, width:2 * width]], dim=1)
        gate = torch.cat([rows[:, :ratio, 2 * width:3 * width], rows[:, ratio:, 3 * width:]], dim=1)
    else:
        kv, gate = rows[..., :width], rows[..., c * width:]
    keep = valid[..., None]
    kv = torch.where(keep, kv, torch.zeros((), dtype=kv.dtype, device=kv.device))  # an unowned row may be NaN
    gate = gate.masked_fill(~keep, float("-inf"))
    return (kv * torch.softmax(gate, dim=1)).sum(dim=1)


class V4Compressor(torch.nn.Module):
    """One gated compressor (module docstring): ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm`` under
    transformers' names. Parameters are zeros until loaded; ``position_bias`` is kept in float32 (float64 for
    float64 layers), as the state is."""

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, *, eps: float, rotary: V4Rotary,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.width, self.ratio, self.overlap, self.eps, self.rotary = width, ratio, overlap, eps, rotary
        self.kv_proj = weight_holder(c * width, hidden, dtype=dtype, device=device)
        self.gate_proj = weight_holder(c * width, hidden, dtype=dtype, device=device)
        self.position_bias = weight_param(ratio, c * width, dtype=accumulate_dtype(dtype), device=device)
        self.kv_norm = torch.nn.Module()
        self.kv_norm.weight = weight_param(width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: CompressorStateCache, slots: object,
                plan: EntryPlan, out: PagedRows) -> None:
        """Write the step's tokens' ``kv | gate`` into ``state`` (at ``slots``: the step plan, a trusted slot
        source) and the entries the step completes into ``out`` (``plan``'s slots), normalised and rotated.
        ``x [T, hidden]``, ``positions [T]`` in processing order."""
        sdt = state.data.dtype
        kv = linear(x, self.kv_proj.weight).to(sdt)
        gate = linear(x, self.gate_proj.weight).to(sdt) + self.position_bias.to(sdt)[positions % self.ratio]
        state.write(torch.cat([kv, gate], dim=-1), slots.slots_for(state), trusted=True)  # type: ignore[attr-defined]
        if not plan.num_new:
            return
        valid = plan.source_slots >= 0
        rows = state.read_slots(plan.source_slots.clamp_min(0))
        pooled = pooled_entries(rows, valid, self.ratio, self.width, self.overlap)
        entry = rms_norm(pooled, self.kv_norm.weight.to(sdt), self.eps).to(x.dtype)
        cos, sin = self.rotary.cos_sin(plan.new_positions, x.dtype)
        entry = self.rotary.apply(entry, cos, sin)
        if isinstance(out, LatentKVCache):
            out.write(entry, entry[:, :0], plan)
        else:
            out.write(entry, plan)  # type: ignore[call-arg]


class V4Indexer(V4Compressor):
    """The CSA indexer (module docstring): a compressor of keys (``kv_proj``, ``gate_proj``, ``position_bias``,
    ``kv_norm``, as transformers names them) plus the scorer (``q_b_proj``, ``scorer.weights_proj``)."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int, *,
                 eps: float, rotary: V4Rotary, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hidden, head_dim, ratio, True, eps=eps, rotary=rotary, dtype=dtype, device=device)
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.q_b_proj = weight_holder(n_heads * head_dim, q_lora_rank, dtype=dtype, device=device)
        self.scorer = torch.nn.Module()
        self.scorer.weights_proj = weight_holder(n_heads, hidden, dtype=dtype, device=device)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, meta: object,
               keys: IndexerKeyCache, state: CompressorStateCache, slots: object, plan: EntryPlan) -> torch.Tensor:
        """Write this step's indexer keys, then return each token's selected entries ``[T, min(topk, E)]``
        (int64, ``-1`` padded; ``E``: the most entries a token of the step sees, at least 1)."""
        self(x, positions, state, slots, plan, keys)
        T, cdt = x.shape[0], accumulate_dtype(x.dtype)
        q = linear(q_resid, self.q_b_proj.weight).view(T, self.n_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        q = self.rotary.apply(q, cos, sin).to(cdt)
        w = linear(x, self.scorer.weights_proj.weight).to(cdt) * self.n_heads ** -0.5
        seen = plan.seen  # [T, E]
        E = seen.shape[1]
        K = min(self.topk, E)
        out = torch.empty(T, K, dtype=torch.long, device=x.device)
        epp = plan.entries_per_page
        step = max(1, GROUP_ELEMENT_BUDGET // max(1, E * (self.head_dim + self.n_heads)))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            idx = seen[t0:t1]
            ok = idx >= 0
            e = idx.clamp_min(0)
            req = meta.token_request[t0:t1, None].expand_as(e)  # type: ignore[attr-defined]
            page = plan.table.long()[req, e // epp]
            ok = ok & (page >= 0)
            slot = torch.where(ok, page * epp + e % epp, torch.zeros_like(page))
            k = keys.read_slots(slot, cdt)  # [t, E, d_I]
            k = torch.where(ok[..., None], k, torch.zeros((), dtype=cdt, device=k.device))
            s = torch.relu(torch.matmul(q[t0:t1], k.transpose(1, 2))) * self.head_dim ** -0.5  # [t, H_I, E]
            score = (s * w[t0:t1, :, None]).sum(dim=1).masked_fill_(~ok, float("-inf"))
            top = torch.topk(score, K, dim=-1)
            out[t0:t1] = torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))
        return out
