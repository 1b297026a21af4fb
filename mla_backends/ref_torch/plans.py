"""``REF_TORCH``'s per-step plans: the index and mask tensors of its dense padded groups, made once per step.

Every layer of a step runs the same dense groups over the same metadata, so what they need besides the
cache and the queries is worked out once, from the metadata's host lists (no device read), and kept in the
step's :class:`RefStep` (what ``RefTorchBackend.prepare`` returns when the step is planned, ``plan_step``):

- the page ids of each group, ``[requests * pages]``, one ``index_select`` of the cache away from the
  padded ``[requests, pages * block_size, 576]`` rows (pages past a request's last one read page 0, hidden);
- the hidden positions, ``[requests, q_len, 1, pages * block_size]`` bool: position ``p`` of request ``b``
  is hidden from its token ``j`` when ``p > context_lens[b] + j`` (causal among the new tokens, and every
  padded position past the sequence);
- the padded rows past each request's sequence (the tail of its last page, and the page-0 stand-ins for pages
  past it), which the kernel zeroes after the gather: slots no request owns may hold NaN or infinities, and a
  hidden position's zero weight times NaN is NaN;
- for groups of mixed query lengths, which query token fills each padded row and where the kept rows go;

The step also holds the working buffers of its calls (gathered rows, scores, partials): made on the first
layer's call, reused by every later layer of the step (calls of one step run one after another), so no
layer pays for allocating, or the kernel for page-faulting, a fresh multi-megabyte buffer.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..core.attention_math import padded_groups
from ..step.metadata import BatchMetadata

__all__ = ["EXP_FLOOR", "HIDDEN_SCORE", "DenseGroup", "RefStep", "dense_groups", "group_page_ids"]


class DenseGroup(NamedTuple):
    """One padded group of requests ``start:stop`` (processing order, within the metadata it was made for).

    Attributes:
        start, stop: the group's requests.
        q_len: its longest query (``Q``); every request's tokens are padded to it.
        rows: padded positions per request, ``pages * block_size`` (``L``).
        page_ids: ``[requests * pages]`` int64 page of every padded page (page 0 past a request's last page).
        hidden: ``[requests, Q, 1, L]`` bool, True where a (token, position) pair is masked.
        token_rows: None when every query has ``Q`` tokens (a plain view); else ``[requests * Q]`` int64 query
            token of every padded row (token 0 for padding rows).
        keep, dest: None, or the padded rows that hold real tokens and the tokens they belong to (``[n]``).
        first_token: the group's first token in the metadata's token axis.
        tails: None when every request fills its padded rows; else ``[m]`` int64 indices into the gathered
            ``[requests * L]`` rows of the positions at or past each request's length (zeroed after the gather).
    """

    start: int
    stop: int
    q_len: int
    rows: int
    page_ids: torch.Tensor
    hidden: torch.Tensor
    token_rows: torch.Tensor | None
    keep: torch.Tensor | None
    dest: torch.Tensor | None
    first_token: int
    tails: torch.Tensor | None = None


#: score given to hidden positions: finite, so that a row or chunk with nothing visible gives finite partials
#: (weighted by exp(-1e30 - max) = 0) instead of NaN
HIDDEN_SCORE = -1e30
#: shifted scores (``score - max``, at most 0) are clamped here before ``exp``: ``exp(-80)`` = 1.8e-35 is still a
#: normal float32, so a visible weight it replaces changes no sum, while the denormal results of inputs below
#: about -87 (and ``HIDDEN_SCORE``'s far-out-of-range ones) cost the CPU's exp far more per element (8-14x
#: for a tensor half hidden: benchmarks/bench_decode_layouts_cpu.py).
#: Hidden positions are set to exactly 0 after the ``exp``
EXP_FLOOR = -80.0


@dataclass(eq=False)
class RefStep:
    """What ``REF_TORCH`` keeps for one step: its dense groups by ``(requests part, row width, heads, element
    budget)``. :meth:`RefTorchBackend.prepare <mla_backends.ref_torch.backend.RefTorchBackend.prepare>` makes
    the groups of a configured layer when the step is planned; a bare backend's first call makes its own."""

    groups: dict[Hashable, tuple[DenseGroup, ...]] = field(default_factory=dict)
    buffers: dict[Hashable, torch.Tensor] = field(default_factory=dict, repr=False)

    def buffer(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """An uninitialised working buffer of this step, ``shape`` / ``dtype`` / ``device``: a view of the one
        tensor kept under ``name`` (and dtype, device), grown to the largest size asked for, so that the layers of
        a step (which run one at a time; no buffer outlives the call that fills it) reuse it and the step holds
        at most one buffer per name, however many groups or streamed runs ask. A normal tensor even when first
        made under ``torch.inference_mode()``, so that a later call outside that mode can write into it."""
        key = (name, dtype, device)
        need = 1
        for n in shape:
            need *= n
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < need:
            with torch.inference_mode(False):
                buf = self.buffers[key] = torch.empty(max(need, 1), dtype=dtype, device=device)
        return buf[:need].view(shape)

    def groups_for(self, meta: BatchMetadata, part: tuple[int, int] | None, W: int, H: int,
                   budget: int) -> tuple[DenseGroup, ...]:
        """The padded groups of requests ``part`` (``(start, stop)``; None: all) of ``meta`` for rows ``W``
        wide and ``H`` heads, made on the first request for that key."""
        key = (part, W, H, budget)
        groups = self.groups.get(key)
        if groups is None:
            sub = meta if part is None else meta.select_requests(*part)
            groups = self.groups[key] = dense_groups(sub, W, H, budget)
        return groups


def group_page_ids(block_table: torch.Tensor, seq_lens: tuple[int, ...], block_size: int) -> torch.Tensor:
    """``[len(seq_lens) * pages]`` int64 page ids of the padded rows of requests ``seq_lens`` (rows of
    ``block_table [B, >= pages]``, on its device), ``pages`` the longest request's page count. Entries past a
    request's last page are replaced by page 0 (the table may hold -1 or stale ids there) without reading the
    table: the keep mask comes from the host lengths."""
    pages = -(-max(seq_lens) // block_size)
    used = torch.tensor([-(-s // block_size) for s in seq_lens], dtype=torch.int64)
    live = (torch.arange(pages)[None, :] < used[:, None]).to(block_table.device)
    ids = torch.where(live, block_table[:, :pages].long(), 0)
    return ids.reshape(-1)


def _tail_rows(seq_lens: tuple[int, ...], rows: int, device: torch.device) -> torch.Tensor | None:
    """``[m]`` int64 indices into ``[len(seq_lens) * rows]`` padded rows of the positions at or past each
    request's length (None when there are none), from the host lengths."""
    parts = [torch.arange(i * rows + s, (i + 1) * rows) for i, s in enumerate(seq_lens) if s < rows]
    return torch.cat(parts).to(device) if parts else None


def hidden_positions(context_lens: tuple[int, ...], q_len: int, rows: int, device: torch.device) -> torch.Tensor:
    """``[requests, q_len, 1, rows]`` bool: position ``p`` hidden from token ``j`` of request ``b`` when
    ``p > context_lens[b] + j``."""
    limit = torch.tensor(context_lens, dtype=torch.int64)[:, None] + torch.arange(q_len)[None, :]
    return (torch.arange(rows)[None, None, :] > limit[:, :, None]).unsqueeze(2).to(device)


def dense_groups(meta: BatchMetadata, row_width: int, heads: int, budget: int) -> tuple[DenseGroup, ...]:
    """The padded groups of ``meta``'s requests (:func:`~mla_backends.core.attention_math.padded_groups` with
    ``budget`` elements), each with its index and mask tensors, from host lists only; groups without tokens
    are left out."""
    seqs, qlens, ctxs = meta.seq_lens_list, meta.query_lens_list, meta.context_lens_list
    starts, bs, dev = meta.query_starts_list, meta.block_size, meta.device
    out = []
    for g0, g1 in padded_groups(seqs, qlens, row_width, heads, budget):
        q_len = max(qlens[g0:g1])
        if not q_len:
            continue
        rows = -(-max(seqs[g0:g1]) // bs) * bs
        page_ids = group_page_ids(meta.block_table[g0:g1], seqs[g0:g1], bs)
        hidden = hidden_positions(ctxs[g0:g1], q_len, rows, dev)
        token_rows = keep = dest = None
        if any(n != q_len for n in qlens[g0:g1]):  # padding rows read token 0 and are dropped
            tok = [starts[g0 + i] + j if j < n else -1 for i, n in enumerate(qlens[g0:g1]) for j in range(q_len)]
            token_rows = torch.tensor([max(t, 0) for t in tok], dtype=torch.int64, device=dev)
            keep = torch.tensor([i for i, t in enumerate(tok) if t >= 0], dtype=torch.int64, device=dev)
            dest = torch.tensor([t for t in tok if t >= 0], dtype=torch.int64, device=dev)
        tails = _tail_rows(seqs[g0:g1], rows, dev)
        out.append(DenseGroup(g0, g1, q_len, rows, page_ids, hidden, token_rows, keep, dest, starts[g0], tails))
    return tuple(out)
