"""What FlashInfer's fa2/fa3 MLA planner refuses, as declarations: the tile-boundary and work-item limits.

FlashInfer 0.7.4 checks every paged-MLA ``plan()`` of the fa2/fa3 backends against two limits of its native
scheduler (``flashinfer/mla/_batch_mla/_backends/_fa_common.py``: ``_validate_fa_plan_workload``, mirroring
``MLAPlan`` in ``include/flashinfer/attention/scheduler.cuh``). Both work on *packed* query rows: request
``b`` contributes ``query_len_b * H`` rows (token-major, heads inner), cut into query tiles of ``64 x
cluster`` rows, where the cluster is 2 CTAs when the batch's average packed length (``sum(q) * H // B``) is
over 64, else 1.

* **Causal tile boundary.** The scheduler rounds a tile's causal key bound up (``ceil(tile_end / H)``) and
  the kernels round it down, so when a tile ends inside a token (``tile % H != 0``) that token can lose its
  last visible key; FlashInfer refuses such a causal batch whenever the lost key starts a KV tile. Single
  tokens at up to 64 heads never cross a tile end, nor do heads dividing 64, nor 128 heads (its tiles are
  always 128 rows); 20, 40, 48 or 96 heads with several tokens per request (or more than 128 heads) can.
* **Work items.** A plan holds at most 16,384 work items: one per query tile, plus one per extra KV split
  (at most one per cluster, so at most one per SM). A 16k-token absorbed extend at 128 heads is 16,384
  tiles on its own.

The selector sees only the largest query length, so :func:`fa_spec_reasons` refuses what one request of that
length can hit. :func:`fa_request_groups` then cuts a batch the declarations accept into groups of requests
that each fit one plan (and leaves zero-token requests out, which also keeps the tile what the declaration
assumed), so :class:`~mla_backends.flashinfer_mla.FlashInferMLABackend` splits the call instead of failing.

One more fact of the same kernels, not a refusal: they cast the per-tensor fp8 ``ckv_scale``/``kpe_scale``
to the query dtype (bf16: fp8 caches take bf16 queries) before multiplying the dequantised rows
(``static_cast<DTypeQ>(ckv_scale)`` in ``mla_hopper.cuh``), so every score and output carries the scale's
bf16 rounding, a relative bias of up to :data:`FA_FP8_SCALE_MAX_BIAS` (2**-8; 2.3e-3 for a scale of 0.37).
:func:`fa_applied_fp8_scale` is the scale the kernels really apply. Imports no flashinfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.reasons import Reason, ReasonKind

__all__ = [
    "FA_MAX_WORK_ITEMS",
    "FA_CTA_TILE_ROWS",
    "SM_COUNT_BOUND",
    "fa_tile_rows",
    "fa_possible_tile_rows",
    "fa_tile_boundary_reason",
    "fa_work_items_reason",
    "fa_spec_reasons",
    "fa_work_items_bound",
    "fa_request_groups",
    "FA_FP8_SCALE_DTYPE",
    "FA_FP8_SCALE_MAX_BIAS",
    "fa_applied_fp8_scale",
]

#: most work items one fa2/fa3 MLA plan holds (FlashInfer's ``max_total_num_works``)
FA_MAX_WORK_ITEMS = 16384
#: packed query rows of one CTA's tile (a cluster of 2 CTAs makes 128-row tiles)
FA_CTA_TILE_ROWS = 64
#: the dtype the fa kernels cast an fp8 cache's scales to before use (the query dtype, bf16 for fp8 caches)
FA_FP8_SCALE_DTYPE = torch.bfloat16
#: largest relative error of that cast: bf16 keeps 8 significant bits, so rounding to nearest is off by at
#: most half a unit in the 8th bit, 2**-8 of the value (0.37 becomes 0.369140625: -2.3e-3)
FA_FP8_SCALE_MAX_BIAS = 2.0 ** -8
#: SMs assumed when the device does not say (more than any GPU the backend declares: H100/H200 have 132)
SM_COUNT_BOUND = 256


def fa_tile_rows(query_lens: Sequence[int], num_heads: int) -> int:
    """Packed query rows per tile FlashInfer's planner uses for this batch: 128 when the average packed
    length ``sum(query_lens) * num_heads // len(query_lens)`` is over 64, else 64."""
    if not query_lens:
        return FA_CTA_TILE_ROWS
    cluster = 2 if sum(query_lens) * num_heads // len(query_lens) > FA_CTA_TILE_ROWS else 1
    return FA_CTA_TILE_ROWS * cluster


def fa_possible_tile_rows(num_heads: int, max_query_len: int, uniform_query_len: bool) -> tuple[int, ...]:
    """The tile sizes a batch of requests with 1 .. ``max_query_len`` tokens each can get.

    Uniform lengths fix the average, so the tile; varying lengths can average anywhere from ``num_heads``
    (all single tokens) to ``max_query_len * num_heads`` packed rows.
    """
    top = max_query_len * num_heads
    if uniform_query_len:
        return (2 * FA_CTA_TILE_ROWS if top > FA_CTA_TILE_ROWS else FA_CTA_TILE_ROWS,)
    tiles = []
    if num_heads <= FA_CTA_TILE_ROWS:
        tiles.append(FA_CTA_TILE_ROWS)
    if top > FA_CTA_TILE_ROWS:
        tiles.append(2 * FA_CTA_TILE_ROWS)
    return tuple(tiles)


def fa_tile_boundary_reason(num_heads: int, max_query_len: int, uniform_query_len: bool) -> Reason | None:
    """The reason a causal batch with up to ``max_query_len`` tokens per request at ``num_heads`` heads can
    put a query-tile end inside a token (None when no tile it can get does)."""
    top = max_query_len * num_heads
    bad = [t for t in fa_possible_tile_rows(num_heads, max_query_len, uniform_query_len)
           if t % num_heads and top > t]
    if not bad:
        return None
    return Reason(
        ReasonKind.NUM_HEADS, "heads with multi-token queries",
        f"{num_heads} heads x {max_query_len} tokens per request ({top} packed rows; query tiles of "
        f"{' or '.join(map(str, bad))} rows end inside a token)",
        "heads dividing 64, or 128 heads, or at most one tile of packed rows per request",
        hint="FlashInfer's fa2/fa3 MLA plan refuses causal batches whose tile ends drop a visible key",
    )


def fa_work_items_bound(query_lens: Sequence[int], num_heads: int, num_sm: int) -> int:
    """Most work items FlashInfer's planner can make of this batch: its query tiles plus one KV split per SM.

    (Each tile is one item per ``kv_len_limit`` keys; the limit is at least the batch's keys over the
    clusters, so the splits add at most one item per cluster.)
    """
    tile = fa_tile_rows(query_lens, num_heads)
    return sum(-(-q * num_heads // tile) for q in query_lens) + max(0, num_sm)


def fa_work_items_reason(num_heads: int, max_query_len: int, num_sm: int) -> Reason | None:
    """The reason one request of ``max_query_len`` tokens at ``num_heads`` heads can exceed a plan's work
    items on a device with ``num_sm`` SMs (0: unknown, :data:`SM_COUNT_BOUND` assumed); None when it fits."""
    sm = num_sm if num_sm > 0 else SM_COUNT_BOUND
    need = fa_work_items_bound([max_query_len], num_heads, sm)
    if need <= FA_MAX_WORK_ITEMS:
        return None
    per_tile = fa_tile_rows([max_query_len], num_heads)
    most = (FA_MAX_WORK_ITEMS - sm) * per_tile // num_heads
    return Reason(
        ReasonKind.QUERY_LEN, "query tokens per request",
        f"{max_query_len} at {num_heads} heads (up to {need} work items with {sm} SMs)",
        f"at most {most} (FlashInfer's fa2/fa3 MLA plan holds {FA_MAX_WORK_ITEMS} work items: "
        f"{per_tile}-row query tiles plus KV splits)",
    )


def fa_spec_reasons(num_heads: int, max_query_len: int, uniform_query_len: bool, num_sm: int) -> list[Reason]:
    """Both limits for what the selector asks (every request has at least one token)."""
    found = (fa_tile_boundary_reason(num_heads, max_query_len, uniform_query_len),
             fa_work_items_reason(num_heads, max_query_len, num_sm))
    return [r for r in found if r is not None]


def fa_request_groups(query_lens: Sequence[int], num_heads: int, num_sm: int,
                      capacity: int | None = None) -> list[list[int]]:
    """Requests (indices into ``query_lens``, in order) cut into consecutive groups that each fit one plan.

    Zero-token requests are left out (they produce nothing; leaving them in could lower the batch's average
    and so its tile). A group grows while :func:`fa_work_items_bound` stays within ``capacity``; one request
    that alone does not fit gets a group of its own (the declarations refuse it before this is reached).
    Most batches are one group. ``capacity`` defaults to :data:`FA_MAX_WORK_ITEMS`.
    """
    cap = FA_MAX_WORK_ITEMS if capacity is None else capacity
    groups: list[list[int]] = []
    current: list[int] = []
    lens: list[int] = []
    for b, q in enumerate(query_lens):
        if q <= 0:
            continue
        if current and fa_work_items_bound(lens + [q], num_heads, num_sm) > cap:
            groups.append(current)
            current, lens = [], []
        current.append(b)
        lens.append(q)
    if current:
        groups.append(current)
    return groups


def fa_applied_fp8_scale(scale: float) -> float:
    """The fp8 dequantisation scale FlashInfer's fa kernels apply for ``scale``: ``scale`` rounded to bf16."""
    return float(torch.tensor(float(scale), dtype=torch.float32).to(FA_FP8_SCALE_DTYPE).float())
