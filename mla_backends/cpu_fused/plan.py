"""CPU_FUSED's per-step work list: which (request, lanes, cached rows) each task covers, made once per step from
the metadata's host lists (no device read), as an immutable :class:`FusedStep`.

A *lane* is one (query token, head) pair of a request, numbered token-major (``lane = token * heads + head``).
A *group* is up to ``max_lanes`` consecutive lanes of one request; the kernel keeps a group's queries and
fp32 accumulators ``[lanes, kv_lora_rank]`` in cache while it passes over the rows. A group whose work is
large next to the step's share per thread is cut into *KV splits* (consecutive row ranges); each split leaves
a partial result in a slot and a merge combines the slots of a group by their LSE. So one long request still
keeps every thread busy, and a batch of short ones is one task per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.validation import require_int

__all__ = ["FusedStep", "plan_work", "MAX_LANES", "SPLITS_PER_THREAD", "MIN_SPLIT_ROWS", "LANE_BLOCK",
           "PARALLEL_MIN_COST"]

#: most lanes (query tokens x heads) one task carries: its queries and accumulators, 64 x (576 + 512) fp32
#: (about 280 KB), stay in a 512 KB L2
MAX_LANES = 64
#: lane groups are cut on multiples of this (the kernel's widest vector of lanes)
LANE_BLOCK = 16
#: the step's work is cut into about this many tasks per thread (tasks are taken from a shared counter, so a
#: few per thread even out tasks of unequal length and a core slowed by another process)
SPLITS_PER_THREAD = 4
#: a KV split covers at least this many rows (shorter ones cost more in merging than they gain)
MIN_SPLIT_ROWS = 256
#: cost of a task beyond its rows, in row-lanes: building its fp32 queries and writing its output
TASK_OVERHEAD_ROWS = 8
#: a step costing less than this many row-lanes (about 0.1-0.2 ms of one core at 16 heads) runs on one
#: thread: waking the other threads would cost more than they save
PARALLEL_MIN_COST = 4096


@dataclass(frozen=True, eq=False)
class FusedStep:
    """One step's work list for ``heads`` heads on ``threads`` threads (all int64, contiguous, CPU).

    Attributes:
        heads: the head count the lanes were numbered for.
        threads: the most threads the call uses (torch's intra-op count, or 1 for a step too small to share).
        requests: ``[R, 4]``: first token (processing order), tokens, context length, block-table row; one row
            per request that has query tokens.
        items: ``[I, 6]``: request (row of ``requests``), first lane, lanes, first row, end row, partial slot
            (-1: the task writes the output itself), largest first.
        merges: ``[M, 5]``: request, first lane, lanes, first slot, splits; one per split group.
        num_slots: partial slots the call needs (``sum`` of the merges' splits).
        slot_lanes: lanes of the widest split group (each slot holds that many).
    """

    heads: int
    threads: int
    requests: torch.Tensor
    items: torch.Tensor
    merges: torch.Tensor
    num_slots: int
    slot_lanes: int


def _groups(lanes: int, max_lanes: int) -> list[tuple[int, int]]:
    """``(first lane, lanes)`` of the groups of a request with ``lanes`` lanes: as few groups as ``max_lanes``
    allows, of nearly equal size, cut on multiples of ``LANE_BLOCK`` where the size allows."""
    n = -(-lanes // max_lanes)
    size = -(-lanes // n)
    if size > LANE_BLOCK:
        size = -(-size // LANE_BLOCK) * LANE_BLOCK
    out = []
    for start in range(0, lanes, size):
        out.append((start, min(size, lanes - start)))
    return out


def plan_work(query_lens: Sequence[int], context_lens: Sequence[int], heads: int, threads: int) -> FusedStep:
    """The work list of one step: requests in processing order with ``query_lens[b]`` new tokens after
    ``context_lens[b]`` cached ones (host ints), ``heads`` heads, ``threads`` intra-op threads.

    Each group (at most ``MAX_LANES`` lanes) sees the rows up to its last token's position; its cost is
    ``(rows + TASK_OVERHEAD_ROWS) x lanes``. A step costing less than ``PARALLEL_MIN_COST`` runs on one thread.
    Otherwise a group costing more than the step's total over ``threads x SPLITS_PER_THREAD`` is cut into
    that many equal row ranges (each at least ``MIN_SPLIT_ROWS`` rows). The module's constants are read on
    every call.
    """
    require_int("heads", heads, minimum=1)
    require_int("threads", threads, minimum=1)
    max_lanes, splits_per_thread, min_split_rows = MAX_LANES, SPLITS_PER_THREAD, MIN_SPLIT_ROWS
    if len(query_lens) != len(context_lens):
        raise ValueError(f"context_lens: got {len(context_lens)} entries; supported one per request "
                         f"({len(query_lens)})")
    requests: list[tuple[int, int, int, int]] = []
    groups: list[tuple[int, int, int, int]] = []  # (request row, first lane, lanes, visible rows)
    tok = 0
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        if n:
            row = len(requests)
            requests.append((tok, n, ctx, b))
            for lane0, lanes in _groups(n * heads, max_lanes):
                last_token = (lane0 + lanes - 1) // heads
                groups.append((row, lane0, lanes, ctx + last_token + 1))
        tok += n
    cost = [(rows + TASK_OVERHEAD_ROWS) * lanes for _, _, lanes, rows in groups]
    if sum(cost) < PARALLEL_MIN_COST:
        threads = 1
    share = sum(cost) / (threads * splits_per_thread) if threads > 1 else float("inf")
    items: list[tuple[int, int, int, int, int, int]] = []
    merges: list[tuple[int, int, int, int, int]] = []
    slots, slot_lanes = 0, 0
    for (row, lane0, lanes, rows), c in zip(groups, cost, strict=True):
        k = 1 if c <= share else min(math.ceil(c / share), max(1, rows // min_split_rows))
        if k <= 1:
            items.append((row, lane0, lanes, 0, rows, -1))
            continue
        bounds = [rows * i // k for i in range(k + 1)]
        merges.append((row, lane0, lanes, slots, k))
        for i in range(k):
            items.append((row, lane0, lanes, bounds[i], bounds[i + 1], slots + i))
        slots += k
        slot_lanes = max(slot_lanes, lanes)
    items.sort(key=lambda it: -(it[4] - it[3] + TASK_OVERHEAD_ROWS) * it[2])
    # one tensor, three contiguous views of it (one allocation: this runs once per step, on the host)
    flat = torch.tensor([v for table in (requests, items, merges) for row in table for v in row], dtype=torch.int64)
    a, b = 4 * len(requests), 4 * len(requests) + 6 * len(items)
    return FusedStep(heads=heads, threads=threads, requests=flat[:a].view(-1, 4), items=flat[a:b].view(-1, 6),
                     merges=flat[b:].view(-1, 5), num_slots=slots, slot_lanes=slot_lanes)
