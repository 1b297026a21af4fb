"""The inputs of one conformance case on one device, and the values the backend must reproduce.

:func:`prepare` builds everything from the case alone: random queries, random latent rows written into a
fresh :class:`~mla_backends.step.cache.LatentKVCache` through a scattered block table whose unused trailing
entries are ``-1`` (even requests) or valid-looking ids of other pages (odd requests), and whose unused pages
and page tails hold finite junk. :func:`expected` computes the reference with
:mod:`mla_backends.testing.reference`, fed with the rows exactly as stored (dequantised in float64 with the
cache's scale) and the queries exactly as the backend received them, so a tolerance measures only the
kernel's own arithmetic. The checks that use them are in :mod:`.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.contract import MLABackend
from ..core.dims import MLADims
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from .cases import Case
from .reference import reference_mqa

__all__ = ["Prepared", "prepare", "expected", "GUARD_ROWS", "SENTINEL", "TRAILING"]

#: rows of guard band on each side of the ``out`` / ``lse_out`` slices
GUARD_ROWS = 3
#: the value guard rows are filled with (exactly representable in every float dtype)
SENTINEL = -1234.5
#: extra block-table entries past each request's last page
TRAILING = 2


@dataclass
class Prepared:
    """The inputs of one case on one device (tokens in processing order, as ``forward_mqa`` takes them)."""

    case: Case
    cache: LatentKVCache
    meta: BatchMetadata
    q_latent: torch.Tensor  # [T, H, r]
    q_rope: torch.Tensor  # [T, H, rope]
    topk: torch.Tensor | None  # [T, K] int32
    scale: float
    rows: list[torch.Tensor]  # per caller request: [S_b, r + rope] float64 as stored
    visible: list[torch.Tensor]  # per caller request: [q_b, S_b] bool

    def call(self, backend: MLABackend, **kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return backend.forward_mqa(
            self.q_latent, self.q_rope, self.cache, self.meta, scale=self.scale, topk_indices=self.topk, **kw
        )


def prepare(case: Case, device: torch.device) -> Prepared:
    """Build the cache, block table, metadata, queries and (for sparse cases) top-k lists of ``case``."""
    gen = torch.Generator().manual_seed(case.seed)
    P, r, rope, H = case.block_size, case.kv_lora_rank, case.qk_rope_head_dim, case.num_heads
    W = r + rope
    pages = [-(-s // P) for s in case.seq_lens]
    num_blocks = sum(pages) + 3 + sum(pages) // 4  # some pages no request owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(pages) + TRAILING
    table = torch.full((len(pages), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
        if b % 2:  # garbage after the used pages: ids of pages the request does not own
            table[b, n:] = torch.randint(0, num_blocks, (width - n,), generator=gen, dtype=torch.int32)

    cache = LatentKVCache(
        num_blocks,
        P,
        r,
        rope,
        kv_cache_dtype=case.kv_cache_dtype,
        model_dtype=case.dtype,
        device=device,
        scale=case.fp8_scale,
    )
    junk = torch.rand(num_blocks, P, W, generator=gen, dtype=torch.float32) * 6 - 3
    cache.data.copy_(junk.to(cache.data.dtype).to(device))
    scale_value = float(cache.scale.item())
    rows: list[torch.Tensor] = []
    flat = cache.data.view(-1, W)
    for b, s in enumerate(case.seq_lens):
        pos = torch.arange(s)
        slots = table[b].long()[pos // P] * P + pos % P
        values = torch.randn(s, W, generator=gen, dtype=torch.float64).to(case.dtype)
        cache.write(values[:, :r].to(device), values[:, r:].to(device), slots.to(device))
        stored = flat[slots.to(device)].cpu().to(torch.float64)
        rows.append(stored * scale_value if cache.is_fp8 else stored)

    meta = BatchMetadata.build(
        list(case.query_lens),
        list(case.context_lens),
        table.to(device),
        P,
        decode_threshold=case.decode_threshold,
        num_blocks=num_blocks,
    )
    T = sum(case.query_lens)
    q_latent = torch.randn(T, H, r, generator=gen, dtype=torch.float64).to(case.dtype)
    q_rope = torch.randn(T, H, rope, generator=gen, dtype=torch.float64).to(case.dtype)

    visible: list[torch.Tensor] = []
    topk_rows: list[torch.Tensor] = []
    for b, (s, c, q) in enumerate(zip(case.seq_lens, case.context_lens, case.query_lens, strict=True)):
        mask = torch.zeros(q, s, dtype=torch.bool)
        for j in range(q):
            window = c + j + 1  # causal: token j sees positions 0 .. c + j
            if case.topk is None:
                mask[j, :window] = True
                continue
            K = case.topk
            k_valid = max(1, min(K - (1 + (b + j) % 3), window))  # always some -1 padding
            chosen = torch.randperm(window, generator=gen)[:k_valid]
            mask[j, chosen] = True
            row = torch.full((K,), -1, dtype=torch.int32)
            row[:k_valid] = chosen.to(torch.int32)
            topk_rows.append(row)
        visible.append(mask)
    topk = None
    if case.topk is not None:
        topk = meta.to_processing_order(torch.stack(topk_rows)).to(device)
    # the softmax scale of a DeepSeek-V3 head with this rope width: YaRN's mscale ** 2 (about 1.874) included,
    # as real checkpoints pass it, so that a kernel that recomputes the scale without it is caught
    dims = MLADims(num_heads=H, kv_lora_rank=r, qk_rope_head_dim=rope,
                   rope_scaling=MLADims.deepseek_v3().rope_scaling)
    return Prepared(
        case=case,
        cache=cache,
        meta=meta,
        q_latent=meta.to_processing_order(q_latent).to(device),
        q_rope=meta.to_processing_order(q_rope).to(device),
        topk=topk,
        scale=dims.softmax_scale,
        rows=rows,
        visible=visible,
    )


def expected(p: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(out [T, H, r], lse [T, H])`` in float64 on the CPU, tokens in processing order."""
    q_caller = p.meta.to_caller_order(p.q_latent.cpu())
    qr_caller = p.meta.to_caller_order(p.q_rope.cpu())
    outs, lses = [], []
    start = 0
    for rows, vis, q in zip(p.rows, p.visible, p.case.query_lens, strict=True):
        o, lse = reference_mqa(q_caller[start : start + q], qr_caller[start : start + q], rows, vis, p.scale)
        outs.append(o)
        lses.append(lse)
        start += q
    order = p.meta.token_order.cpu()
    return torch.cat(outs)[order], torch.cat(lses)[order]
