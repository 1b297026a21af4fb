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

The state is complete and frozen once made (no layer adds to it), so any number of layers, in any threads,
read it at once. The working buffers of the calls (gathered rows, scores, partials) are not the step's: they
come from the configured backend's :class:`ScratchArena`, one set per thread, reused by every layer and step of
that thread, so no layer pays for allocating, or the kernel for page-faulting, a fresh multi-megabyte buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..core.attention_math import padded_groups
from ..step.metadata import BatchMetadata
from ..step.plan import StepPlanError

__all__ = ["EXP_FLOOR", "HIDDEN_SCORE", "DenseGroup", "RefStep", "ScratchArena", "prepare_step", "dense_groups",
           "group_page_ids"]


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


class ScratchArena:
    """The working buffers of one configured ``REF_TORCH`` (its :attr:`~mla_backends.MLABackend.resources`),
    one set per thread.

    Each thread gets its own buffers (``threading.local``), so layers running in several threads under one plan
    never share a buffer, and the calls of one thread (which run one at a time; no buffer outlives the call
    that fills it) reuse them across layers and steps: one tensor per name, dtype and device, grown to the
    largest size asked for and never shrunk. :meth:`RefTorchBackend.prepare
    <mla_backends.ref_torch.backend.RefTorchBackend.prepare>` sizes the planning thread's padded-group and query
    buffers for the step (:meth:`reserve`), so its layer calls allocate nothing; another thread's first call
    (and a streamed call's chunk buffers, sized by the kernel) may grow its own set once.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type[ScratchArena], tuple[()]]:
        return (ScratchArena, ())  # buffers are scratch: a copy starts empty

    def thread_buffers(self) -> dict[Hashable, torch.Tensor]:
        """This thread's buffers, by ``(name, dtype, device)``."""
        bufs = getattr(self._local, "buffers", None)
        if bufs is None:
            bufs = self._local.buffers = {}
        return bufs

    def buffer(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """An uninitialised working buffer ``shape`` / ``dtype`` / ``device``: a view of this thread's one tensor
        kept under ``name`` (and dtype, device), grown to the largest size asked for, so that the calls of a
        thread hold at most one buffer per name however many groups or streamed runs ask. A normal tensor even
        when first made under ``torch.inference_mode()``, so that a later call outside that mode can write
        into it."""
        need = 1
        for n in shape:
            need *= n
        return self.reserve(name, need, dtype, device)[:need].view(shape)

    def reserve(self, name: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This thread's buffer ``name`` with room for at least ``numel`` elements (grown when smaller)."""
        bufs = self.thread_buffers()
        key = (name, dtype, device)
        buf = bufs.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):
                buf = bufs[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf


@dataclass(frozen=True, eq=False)
class RefStep:
    """What ``REF_TORCH`` prepared for one step (or one call): complete and frozen, read by every layer.

    Attributes:
        groups: ``(requests part, row width, heads, element budget)`` -> the padded groups of that part
            (``None``: the whole batch), index and mask tensors made from the host lists.
        parts: the dense call's split (:meth:`RefTorchBackend.dense_parts
            <mla_backends.ref_torch.backend.RefTorchBackend.dense_parts>`), worked out once; None when made for
            no particular call (then each call works it out).
        arena: where the calls' working buffers come from (the configured backend's :class:`ScratchArena`:
            per thread; a state made without one has its own).

    Nothing is added after it was made: a call asking for groups it does not hold is a
    :class:`~mla_backends.step.plan.StepPlanError` (a state carried to another batch or shape), never a lazy
    fill, so layers in several threads may read one state at once.
    """

    groups: Mapping[Hashable, tuple[DenseGroup, ...]] = field(default_factory=lambda: MappingProxyType({}))
    parts: tuple[tuple[bool, int, int], ...] | None = None
    arena: ScratchArena = field(default_factory=ScratchArena, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.groups, MappingProxyType):
            object.__setattr__(self, "groups", MappingProxyType(dict(self.groups)))
        if self.parts is not None and not isinstance(self.parts, tuple):
            raise TypeError(f"parts: got {type(self.parts).__name__}; supported a tuple of (streamed, start, stop)")
        if not isinstance(self.arena, ScratchArena):
            raise TypeError(f"arena: got {type(self.arena).__name__}; supported ScratchArena")

    @property
    def buffers(self) -> dict[Hashable, torch.Tensor]:
        """The calling thread's working buffers (:meth:`ScratchArena.thread_buffers`)."""
        return self.arena.thread_buffers()

    def buffer(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """A working buffer of the calling thread (:meth:`ScratchArena.buffer`)."""
        return self.arena.buffer(name, shape, dtype, device)

    def groups_for(self, meta: BatchMetadata, part: tuple[int, int] | None, W: int, H: int,
                   budget: int) -> tuple[DenseGroup, ...]:
        """The prepared padded groups of requests ``part`` (``(start, stop)``; None: all) of ``meta`` for rows
        ``W`` wide and ``H`` heads.

        Raises:
            StepPlanError: this state holds no such groups (it was prepared for other shapes or batches).
        """
        groups = self.groups.get((part, W, H, budget))
        if groups is None:
            raise StepPlanError(f"REF_TORCH: got a call needing padded groups of requests {part or 'all'} for rows "
                                f"{W} wide and {H} heads; supported the groups its step state was prepared with "
                                f"({sorted(map(str, self.groups)) or 'none'}): plan the step with this backend, "
                                "configured for these shapes (configure_backend)")
        return groups


def prepare_step(meta: BatchMetadata, parts: Sequence[tuple[bool, int, int]], row_width: int, heads: int,
                 budget: int, arena: ScratchArena, *, compute_dtype: torch.dtype | None = None,
                 gather_direct: bool = False) -> RefStep:
    """The :class:`RefStep` of ``meta`` for rows ``row_width`` wide and ``heads`` heads: the padded groups of
    every non-streamed part of ``parts`` (``dense_parts``' split), from host lists only. With ``compute_dtype``
    the planning thread's buffers of those groups (query, scores, and the gathered rows when the cache is read
    without conversion, ``gather_direct``) are reserved in ``arena`` now, so its layer calls allocate nothing."""
    whole = len(parts) == 1 and tuple(parts[0]) == (False, 0, meta.num_requests)
    groups: dict[Hashable, tuple[DenseGroup, ...]] = {}
    for streamed, b, e in parts:
        if not streamed:
            part = None if whole else (b, e)
            sub = meta if part is None else meta.select_requests(b, e)
            groups[(part, row_width, heads, budget)] = dense_groups(sub, row_width, heads, budget)
    step = RefStep(MappingProxyType(groups), tuple(tuple(p) for p in parts), arena)
    if compute_dtype is not None and meta.num_tokens:
        dev = meta.device
        arena.reserve("q", meta.num_tokens * heads * row_width, compute_dtype, dev)
        every = [g for gs in groups.values() for g in gs]
        if every:
            arena.reserve("dense_s", max((g.stop - g.start) * g.rows * g.q_len * heads for g in every),
                          compute_dtype, dev)
            if gather_direct:
                arena.reserve("dense_kv", max(g.page_ids.numel() * meta.block_size * row_width for g in every),
                              compute_dtype, dev)
    return step


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
