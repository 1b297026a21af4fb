"""REF_TORCH's DeepSeek-V4 attention: window keys, compressed keys and the per-head sink in one softmax.

For every token ``t`` (position ``p``, request ``b``) the keys are gathered into one ``[t, Kw + Kc, W]`` block:

- ``Kw`` rows of the main cache: positions ``p - j`` for ``j < window`` (window given) or positions ``j <=
  p`` (no window: the whole causal context), through ``meta``'s block table;
- ``Kc`` rows of the compressed cache: the token's entry numbers through the compressed block table.

Scores are ``scale * q . row`` (``[t, H, Kw + Kc]``); keys outside the window, before position 0 or padded
(``-1``) get ``-inf`` and their gathered rows are zeroed (an unowned slot may hold NaN: it never reaches the
output, nor does a page id ``-1``). The sink joins as one more logit with a zero value; the LSE returned is
``log(sum exp(s) + exp(sink))``. Tokens go in chunks whose working set fits ``GROUP_ELEMENT_BUDGET``; shapes
come from host integers (no device read).
"""

from __future__ import annotations

import torch

from ..backends.v4_inputs import V4Keys
from ..core.attention_math import GROUP_ELEMENT_BUDGET, distinct_topk
from ..step.cache import LatentKVCache, position_slots
from ..step.metadata import BatchMetadata

__all__ = ["v4_attention"]


def _gathered(cache: LatentKVCache, slots: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised rows ``[*slots.shape, W]`` in ``dtype`` at ``slots`` (all in range), zero where not ``valid``."""
    rows = cache.dequantize(cache.stored_rows(slots), dtype)
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=dtype, device=rows.device))


def v4_attention(q: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata, scale: float, keys: V4Keys,
                 out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """``q [T, H, W]`` (compute dtype: float32, or float64 for float64 queries) -> ``out [T, H, kv_lora_rank]``,
    ``lse_out [T, H]`` (module docstring). ``cache``: the main (window) cache; ``keys``: the V4 inputs."""
    T, H, W = q.shape
    r, bs, dev, cdt = cache.kv_lora_rank, cache.block_size, q.device, q.dtype
    comp = keys.compressed
    Kw = min(keys.window, meta.max_seq_len) if keys.window is not None else meta.max_seq_len
    Kc = 0 if comp is None else comp.indices.shape[1]
    picks = None if comp is None else distinct_topk(comp.indices)
    sinks = None if keys.sinks is None else keys.sinks.to(cdt)
    K = Kw + Kc
    step = max(1, GROUP_ELEMENT_BUDGET // max(1, K * (W + H)))
    j = torch.arange(Kw, device=dev)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        pos = meta.token_positions[t0:t1, None]  # [t, 1]
        req = meta.token_request[t0:t1, None]
        if keys.window is not None:
            wpos = pos - j[None, :]  # p, p - 1, ... : the window, the token's own row first
            wvalid = wpos >= 0
        else:
            wpos = j[None, :].expand(t1 - t0, Kw)
            wvalid = wpos <= pos
        wpos = torch.where(wvalid, wpos, pos)  # a position the request owns (its own row), then zeroed
        slots = position_slots(meta.block_table, req.expand_as(wpos), wpos, bs)
        parts, valid = [_gathered(cache, slots, wvalid, cdt)], [wvalid]
        if comp is not None:
            idx = picks[t0:t1].long()
            cvalid = idx >= 0
            e = idx.clamp_min(0)
            cbs = comp.cache.block_size
            page = comp.block_table.long()[req.expand_as(e), e // cbs]
            cvalid = cvalid & (page >= 0)
            cslots = torch.where(cvalid, page * cbs + e % cbs, torch.zeros_like(page))
            parts.append(_gathered(comp.cache, cslots, cvalid, cdt))
            valid.append(cvalid)
        kv = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [t, K, W]
        seen = torch.cat(valid, dim=1) if len(valid) > 1 else valid[0]  # [t, K]
        s = torch.matmul(q[t0:t1], kv.transpose(1, 2)).mul_(scale)  # [t, H, K]
        s.masked_fill_(~seen[:, None, :], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(1, H, 1).expand(t1 - t0, H, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)  # [t, H]
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp(s[..., :K] - safe[..., None])
        out[t0:t1] = torch.matmul(p, kv[..., :r]).to(out.dtype)
        lse_out[t0:t1] = lse.to(lse_out.dtype)
