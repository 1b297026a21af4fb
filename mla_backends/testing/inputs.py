"""The inputs of one conformance case on one device, and the values the backend must reproduce.

:func:`prepare` builds everything from the case alone: random queries, random latent rows written into a
fresh :class:`~mla_backends.step.cache.LatentKVCache` through a scattered block table whose unused trailing
entries are ``-1`` (even requests) or valid-looking ids of other pages (odd requests). Every slot no request
owns (the tail of each request's last page, and every page outside the requests' tables) is *poisoned*
(:func:`poison_rows`): NaN, infinities, random bytes (fp8 caches: their NaN byte patterns) or finite junk, as
the engines' own kernel tests poison them, so a kernel that reads such a slot, even with a zero weight, fails.
:func:`expected` computes the reference with
:mod:`mla_backends.testing.reference`, fed with the rows exactly as stored (dequantised in float64 with the
cache's scale) and the queries exactly as the backend received them, so a tolerance measures only the
kernel's own arithmetic. The checks that use them are in :mod:`.checks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backends.capabilities import Precision
from ..backends.contract import MLABackend
from ..core.dims import MLADims
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from .cases import Case
from .reference import ReferenceMQA
from .rounding import rounded_mqa
from .tolerances import judged_dtype

__all__ = ["Prepared", "prepare", "expected", "expected_at", "honest", "poison_rows", "owned_slots", "GUARD_ROWS",
           "SENTINEL", "TRAILING", "POISONS"]

#: rows of guard band on each side of the ``out`` / ``lse_out`` slices
GUARD_ROWS = 3
#: the value guard rows are filled with (exactly representable in every float dtype)
SENTINEL = -1234.5
#: extra block-table entries past each request's last page
TRAILING = 2
#: what a slot no request owns may hold, drawn per row: NaN, infinities of both signs, random bytes (any bit
#: pattern of the storage dtype: NaN, infinities, denormals, huge values) and finite junk in [-3, 3] (so that a
#: kernel reading another page with a real weight gets finite wrong values, not only NaN)
POISONS = ("nan", "inf", "bytes", "junk")

#: NaN and infinity bytes of the fp8 storage dtypes (e4m3fn has no infinity: its NaN is S.1111.111; e5m2
#: follows IEEE: S.11111.00 is infinity, S.11111.xx with xx != 0 NaN)
_FP8_NAN = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}
_FP8_INF = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7C, 0xFC)}


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


def poison_rows(n: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[n, width]`` rows of storage ``dtype`` for slots no request owns: each row one of :data:`POISONS`,
    drawn from ``gen`` (NaN rows and infinity rows hold the dtype's NaN / infinity bit patterns, fp8 included)."""
    kinds = torch.randint(0, len(POISONS), (n,), generator=gen)
    nbytes = torch.empty((), dtype=dtype).element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[nbytes]
    raw = torch.randint(0, 256, (n, width * nbytes), generator=gen, dtype=torch.uint8)
    rows = raw.view(ints).view(dtype).clone()  # "bytes": any pattern
    junk = (torch.rand(n, width, generator=gen, dtype=torch.float32) * 6 - 3).to(dtype)
    rows[kinds == POISONS.index("junk")] = junk[kinds == POISONS.index("junk")]
    sign = torch.where(torch.arange(width) % 2 == 0, 1.0, -1.0)
    if nbytes == 1:  # fp8: the byte patterns
        pick = lambda codes: torch.tensor(codes, dtype=torch.uint8)[torch.arange(width) % len(codes)]  # noqa: E731
        nan, inf = pick(_FP8_NAN[dtype]).view(dtype), pick(_FP8_INF[dtype]).view(dtype)
    else:
        nan = torch.full((width,), float("nan")).to(dtype)
        inf = (sign * float("inf")).to(dtype)
    rows[kinds == POISONS.index("nan")] = nan
    rows[kinds == POISONS.index("inf")] = inf
    return rows


def owned_slots(case: Case, table: torch.Tensor) -> torch.Tensor:
    """``[S]`` int64 flat slots of every position of every request of ``case`` (``table``: the caller-order block
    table on the host): the only slots a kernel may read."""
    P = case.block_size
    parts = [table[b].long()[torch.arange(s) // P] * P + torch.arange(s) % P for b, s in enumerate(case.seq_lens)]
    return torch.cat(parts)


def prepare(case: Case, device: torch.device, *, poison: bool = True) -> Prepared:
    """Build the cache, block table, metadata, queries and (for sparse cases) top-k lists of ``case``.

    ``poison``: every slot no request owns holds :func:`poison_rows` (the default, what the checks run); False
    zeroes them instead (the out-of-bounds diagnosis compares the two, :mod:`.hints`). The owned rows, queries
    and lists are the same either way."""
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
    unowned = torch.ones(num_blocks * P, dtype=torch.bool)
    unowned[owned_slots(case, table)] = False
    fill = poison_rows(int(unowned.sum()), W, cache.data.dtype, torch.Generator().manual_seed(case.seed + 1))
    fill = fill if poison else torch.zeros_like(fill)
    if fill.element_size() == 1:  # fp8: move the bytes (index_put_ has no fp8 kernel on every device)
        flat, fill = flat.view(torch.uint8), fill.view(torch.uint8)
    flat[unowned.nonzero().squeeze(1).to(device)] = fill.to(device)

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


def expected_at(p: Prepared) -> Callable[[float], tuple[torch.Tensor, torch.Tensor]]:
    """The reference of ``p`` with the softmax scale left open: ``f(scale)`` gives ``(out [T, H, r], lse
    [T, H])`` in float64 on the CPU, tokens in processing order; the scale-independent work is done once (the
    hints recompute the reference at many scales)."""
    q_caller = p.meta.to_caller_order(p.q_latent.cpu())
    qr_caller = p.meta.to_caller_order(p.q_rope.cpu())
    parts = []
    start = 0
    for rows, vis, q in zip(p.rows, p.visible, p.case.query_lens, strict=True):
        parts.append(ReferenceMQA(q_caller[start : start + q], qr_caller[start : start + q], rows, vis))
        start += q
    order = p.meta.token_order.cpu()

    def at(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses = zip(*(part(scale) for part in parts), strict=True)
        return torch.cat(outs)[order], torch.cat(lses)[order]

    return at


def expected(p: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(out [T, H, r], lse [T, H])`` in float64 on the CPU, tokens in processing order."""
    return expected_at(p)(p.scale)


def honest(p: Prepared, precision: Precision) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, r], lse [T, H])`` as a correct kernel of ``precision`` computes ``p`` in its dtypes
    (:func:`.rounding.rounded_mqa`), float64 on the CPU, tokens in processing order: how far from
    :func:`expected` honest rounding lands on this case."""
    case = p.case
    q_caller = p.meta.to_caller_order(p.q_latent.cpu())
    qr_caller = p.meta.to_caller_order(p.q_rope.cpu())
    operand = judged_dtype(case.dtype, case.kv_cache_dtype)
    fp8_scale = float(p.cache.scale.item()) if p.cache.is_fp8 else 1.0
    outs, lses = [], []
    start = 0
    for rows, vis, q in zip(p.rows, p.visible, case.query_lens, strict=True):
        o, lse = rounded_mqa(q_caller[start: start + q], qr_caller[start: start + q], rows, vis, p.scale,
                             operand=operand, precision=precision, fp8_scale=fp8_scale)
        outs.append(o)
        lses.append(lse)
        start += q
    order = p.meta.token_order.cpu()
    return torch.cat(outs)[order], torch.cat(lses)[order]
