"""Per-step batch description: request order, slot mapping, query offsets and the decode/prefill split.

A step covers many requests. For request ``b``, ``context_lens[b]`` tokens are already cached and
``query_lens[b]`` new tokens arrive; the step writes the new tokens' rows at positions
``context_lens[b] .. context_lens[b] + query_lens[b] - 1`` and then attends, so ``seq_lens = context_lens +
query_lens`` rows are visible to the last new token. New token ``j`` of a request sees positions
``0 .. context_lens[b] + j`` (causal among the new tokens, the whole context visible).

Requests may come in any order. :meth:`BatchMetadata.build` reorders them stably so that decode requests
(``query_len <= decode_threshold``) come first, and keeps the permutation so outputs go back in the caller's
order (:meth:`BatchMetadata.to_caller_order`).

Decode context parallelism (``dcp_size = D > 1``): the token at global position ``p`` is stored on DCP rank
``p % D`` at local index ``p // D``. The lengths (``query_lens``, ``context_lens``, ``seq_lens``,
``token_positions``) stay *global*, the same on every rank of the group; ``block_table`` and
``slot_mapping`` are *local*: the table maps this rank's local indices, and new tokens stored on another
rank get slot ``-1``. See docs/layer.md, "Decode context parallelism".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any

import torch

from ..core.validation import require_device, require_int, require_tensor
from .cache import PagedRows, SlotSource, duplicate_slot, position_slots

__all__ = ["BatchMetadata", "dcp_local_len", "live_block_bounds"]

IntsLike = Sequence[int] | torch.Tensor


#: the largest length, offset or block id the int32 metadata tensors can hold
INT32_MAX = 2**31 - 1
#: what this module's constructors pass as ``verified_lengths``: the tensors were made from the host lists (or
#: are an engine's own, mirrored by its host copy: :meth:`BatchMetadata.for_decode`), so they agree by construction
_MADE_FROM_LISTS = object()


def live_block_bounds(table: torch.Tensor, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo [B], hi [B])`` int64 on ``table``'s device: the smallest and largest block id among the first
    ``pages[b]`` entries of row ``b`` of ``table [B, W]`` (a request's live pages; ``0`` and ``-1`` for a row
    with none). The one computation of live block ids: :meth:`BatchMetadata.build`,
    :meth:`BatchMetadata.for_decode` and the step plan's device read of hand-made metadata all use it."""
    B, width = table.shape[0], max(pages, default=0)
    dev = table.device
    if not B or not width:
        return torch.zeros(B, dtype=torch.long, device=dev), torch.full((B,), -1, dtype=torch.long, device=dev)
    ids = table[:, :width].long()
    live = torch.arange(width, device=dev)[None, :] < torch.tensor(list(pages), device=dev)[:, None]
    hi = torch.where(live, ids, torch.full_like(ids, -1)).amax(dim=1)
    lo = torch.where(live, ids, torch.full_like(ids, torch.iinfo(torch.long).max)).amin(dim=1)
    return torch.where(hi >= 0, lo, torch.minimum(lo, torch.zeros_like(lo))), hi


def dcp_local_len(length: int, dcp_rank: int, dcp_size: int) -> int:
    """How many of positions ``0 .. length - 1`` DCP rank ``dcp_rank`` of ``dcp_size`` stores: with a DCP group
    of ``D`` ranks the token at global position ``p`` lives on rank ``p % D`` at local index ``p // D``.

    Raises TypeError/ValueError naming the argument for a non-int, ``length < 0``, ``dcp_size < 1`` or a rank
    outside ``[0, dcp_size)``.
    """
    require_int("length", length, minimum=0)
    require_int("dcp_size", dcp_size, minimum=1)
    require_int("dcp_rank", dcp_rank, minimum=0)
    if dcp_rank >= dcp_size:
        raise ValueError(f"dcp_rank: got {dcp_rank}; supported 0..{dcp_size - 1} (dcp_size {dcp_size})")
    return (length - dcp_rank + dcp_size - 1) // dcp_size


def _is_int_tensor(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def _as_int_list(name: str, x: IntsLike) -> list[int]:
    """``x`` (a sequence of ints or a 1-D int tensor; never floats, complex or bools) as ints in
    ``[0, INT32_MAX]``, each fault naming ``name[i]``."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or not _is_int_tensor(x):
            raise ValueError(f"{name}: got tensor of shape {list(x.shape)} dtype {x.dtype}; supported a 1-D int tensor")
        vals = [int(v) for v in x.tolist()]
    elif isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{name}: got {type(x).__name__}; supported a sequence of ints or a 1-D int tensor")
    else:
        vals = [require_int(f"{name}[{i}]", v) for i, v in enumerate(x)]
    for b, v in enumerate(vals):
        if not 0 <= v <= INT32_MAX:
            raise ValueError(f"{name}[{b}]: got {v} for request {b}; supported 0 .. {INT32_MAX} (int32)")
    return vals


def _as_block_table(block_table: object) -> torch.Tensor:
    """The block table as a 2-D integer tensor: a tensor as given (int dtypes only), or a list of rows of
    ints (ragged rows padded with -1). Floats, complex numbers and bools are refused, not truncated."""
    if isinstance(block_table, torch.Tensor):
        if block_table.dim() != 2 or not _is_int_tensor(block_table):
            raise ValueError(f"block_table: got shape {list(block_table.shape)} dtype {block_table.dtype}; "
                             "supported [B, max_blocks] int")
        return block_table
    if isinstance(block_table, (str, bytes)) or not isinstance(block_table, Sequence):
        raise TypeError(f"block_table: got {type(block_table).__name__}; supported a 2-D int tensor")
    rows = []
    for b, row in enumerate(block_table):
        if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, torch.Tensor)):
            raise TypeError(f"block_table[{b}]: got {type(row).__name__}; supported a sequence of block ids")
        rows.append([require_int(f"block_table[{b}][{j}]", v) for j, v in enumerate(row)])
    width = max((len(r) for r in rows), default=0)
    bt = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        if row:
            bt[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return bt


@dataclass(frozen=True, eq=False)
class BatchMetadata(SlotSource):
    """One step's batch, with requests in processing order (decodes first).

    Tensor fields live on ``device``; the ``*_list`` fields are host copies so that CPU code needs no sync.

    Attributes:
        block_size: tokens per cache page.
        order: ``[B]`` int64; processing request ``i`` is the caller's request ``order[i]``.
        token_order: ``[T]`` int64; processing token ``i`` is the caller's token ``token_order[i]``.
        query_lens, context_lens, seq_lens: ``[B]`` int32, processing order.
        query_start_loc: ``[B + 1]`` int32 offsets of each request's tokens in the processing-order token axis.
        block_table: ``[B, max_blocks]`` int32 page ids, processing order.
        slot_mapping: ``[T]`` int64 cache slot of every new token, processing order.
        token_request: ``[T]`` int64 processing request index of every token.
        token_positions: ``[T]`` int64 position of every token in its sequence (``context_len + j``).
        num_blocks: pages of the cache the block ids were checked against in :meth:`build` (None: unchecked).
        dcp_rank, dcp_size: this rank in its decode-context-parallel group and the group's size (0 and 1:
            no DCP). With ``dcp_size > 1`` the lengths and positions are global, ``block_table`` and
            ``slot_mapping`` local (module docstring).
        max_block_ids: ``[B]`` host ints, processing order: the largest block id of each request's live pages
            (``-1`` for a request holding no tokens). :meth:`build` fills it from host data (one device read
            when the table is on a GPU); :meth:`check_cache` compares it with a cache's ``num_blocks``, so no
            layer reads the table again. None on metadata made by hand: then the first check reads the table
            once (one sync) and the verdict is kept for the step.
        graph_static: True on :class:`~mla_backends.step.graph.DecodeGraphMetadata`'s persistent metadata,
            whose host lists are the captured bounds, not the step's lengths (:mod:`mla_backends.step.checks`).
        verified_block_table: the ``block_table`` object that ``num_blocks`` and ``max_block_ids`` describe
            (set by :meth:`build` and :meth:`select_requests`). A copy whose table was swapped
            (``dataclasses.replace(meta, block_table=...)``) no longer matches it, so :meth:`check_cache` reads
            the new table instead of trusting verdicts about the old one.
        block_ids_trusted: the engine vouches that every block id lies inside the caches the step runs on
            (its own allocator made the table for them, and reading a GPU table back would sync):
            :meth:`check_cache` then checks the page size only. Set by :meth:`for_decode`.
        verified_lengths: the length tensors (``query_lens``, ``context_lens``, ``seq_lens``,
            ``query_start_loc``, ``token_request``, ``token_positions``) and host lists whose agreement was
            established, as they were then. Set on construction; a copy (``dataclasses.replace``) that changed
            none of them is not checked again.

    Frozen means consistent: construction (``build``, :meth:`for_decode`, :meth:`select_requests`, a hand-made
    object or a ``dataclasses.replace`` copy alike) checks every field's type and every tensor's shape against
    the host lists (``[B]``, ``[B + 1]``, ``[T]``, one device), and that the length tensors hold what the host
    lists say, the lists being the source of truth every host-side decision reads. The constructors here make
    the tensors from the lists (or take an engine's tensors with its host copy), so nothing is read back; a
    hand-made or replaced object whose lengths changed is compared value by value: on the host for CPU
    tensors, with one device read otherwise (never on the engine paths). Graph metadata (``graph_static``)
    keeps bounds in its lists by design and is checked for shapes only.

    The metadata knows nothing of backends: what a step works out for its layers and backends (runs,
    sub-batches, prepared states) is the :class:`~mla_backends.step.plan.StepPlan` that
    :func:`~mla_backends.step.plan.plan_step` makes from it.
    """

    block_size: int
    order: torch.Tensor
    token_order: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    token_request: torch.Tensor
    token_positions: torch.Tensor
    query_lens_list: tuple[int, ...]
    context_lens_list: tuple[int, ...]
    num_blocks: int | None = None
    dcp_rank: int = 0
    dcp_size: int = 1
    max_block_ids: tuple[int, ...] | None = None
    graph_static: bool = False
    verified_block_table: torch.Tensor | None = field(default=None, repr=False, compare=False)
    block_ids_trusted: bool = False
    verified_lengths: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_fields()
        if self.verified_lengths is _MADE_FROM_LISTS or self.graph_static:
            object.__setattr__(self, "verified_lengths", self._length_fingerprint())
        elif not self._lengths_verified():
            self._check_length_values()
            object.__setattr__(self, "verified_lengths", self._length_fingerprint())

    def _check_fields(self) -> None:
        """Types, host lists and tensor shapes (host data only): the first disagreement, named."""
        require_int("block_size", self.block_size, minimum=1)
        for name in ("query_lens_list", "context_lens_list"):
            vals = getattr(self, name)
            if not isinstance(vals, tuple):
                raise TypeError(f"{name}: got {type(vals).__name__}; supported a tuple of ints")
            for b, v in enumerate(vals):
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT32_MAX:
                    raise ValueError(f"{name}[{b}]: got {v!r}; supported an int in 0 .. {INT32_MAX}")
        B = len(self.query_lens_list)
        if len(self.context_lens_list) != B:
            raise ValueError(f"context_lens_list: got {len(self.context_lens_list)} entries; supported one per "
                             f"request ({B} in query_lens_list)")
        T = sum(self.query_lens_list)
        table = require_tensor("block_table", self.block_table, ndim=2)
        if table.shape[0] != B or not _is_int_tensor(table):
            raise ValueError(f"block_table: got shape {list(table.shape)} dtype {table.dtype}; supported [{B}, *] "
                             "int (one row per request of the host lists)")
        dev = table.device
        for name, n in (("order", B), ("token_order", T), ("query_lens", B), ("context_lens", B), ("seq_lens", B),
                        ("query_start_loc", B + 1), ("slot_mapping", T), ("token_request", T),
                        ("token_positions", T)):
            t = require_tensor(name, getattr(self, name), ndim=1)
            if t.shape[0] != n or not _is_int_tensor(t):
                raise ValueError(f"{name}: got shape {list(t.shape)} dtype {t.dtype}; supported [{n}] int (the host "
                                 f"lists hold {B} requests and {T} tokens)")
            if t.device != dev:
                raise ValueError(f"{name}: got device {t.device}; supported the block table's {dev}")
        if self.num_blocks is not None:
            require_int("num_blocks", self.num_blocks, minimum=1)
        require_int("dcp_size", self.dcp_size, minimum=1)
        require_int("dcp_rank", self.dcp_rank, minimum=0)
        if self.dcp_rank >= self.dcp_size:
            raise ValueError(f"dcp_rank: got {self.dcp_rank}; supported 0..{self.dcp_size - 1} (dcp_size "
                             f"{self.dcp_size})")
        if self.max_block_ids is not None and (not isinstance(self.max_block_ids, tuple)
                                               or len(self.max_block_ids) != B):
            raise ValueError(f"max_block_ids: got {self.max_block_ids!r}; supported None or a tuple of {B} block "
                             "ids (one per request)")
        for name in ("graph_static", "block_ids_trusted"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: got {getattr(self, name)!r}; supported True or False")

    def _length_fingerprint(self) -> tuple[Any, ...]:
        return (self.query_lens, self.context_lens, self.seq_lens, self.query_start_loc, self.token_request,
                self.token_positions, self.query_lens_list, self.context_lens_list)

    def _lengths_verified(self) -> bool:
        """Whether :attr:`verified_lengths` describes these very tensors and lists (no value compared)."""
        fp = self.verified_lengths
        now = self._length_fingerprint()
        if not isinstance(fp, tuple) or len(fp) != len(now):
            return False
        return all(a is b for a, b in zip(fp[:6], now[:6], strict=True)) and fp[6:] == now[6:]

    def _check_length_values(self) -> None:
        """The length tensors against the host lists, value by value (a hand-made or replaced object): on the
        host for CPU tensors, one device read otherwise."""
        q, c = self.query_lens_list, self.context_lens_list
        B = len(q)
        expected = {
            "query_lens": torch.tensor(q, dtype=torch.int64),
            "context_lens": torch.tensor(c, dtype=torch.int64),
            "seq_lens": torch.tensor([a + b for a, b in zip(q, c, strict=True)], dtype=torch.int64),
            "query_start_loc": torch.tensor(list(accumulate(q, initial=0)), dtype=torch.int64),
            "token_request": torch.tensor([b for b in range(B) for _ in range(q[b])], dtype=torch.int64),
            "token_positions": torch.tensor([c[b] + j for b in range(B) for j in range(q[b])], dtype=torch.int64),
        }
        got = {name: getattr(self, name) for name in expected}
        if self.block_table.device.type != "cpu":  # one read of the six tensors together
            flat = torch.cat([t.reshape(-1).long() for t in got.values()]).cpu()
            got = dict(zip(got, flat.split([t.numel() for t in got.values()]), strict=True))
        for name, want in expected.items():
            have = got[name].long()
            if not torch.equal(have, want):
                i = int((have != want).nonzero()[0])
                raise ValueError(f"{name}: got {have.tolist()[:8]} (entry {i}: {int(have[i])}); supported what the "
                                 f"host lists say ({want.tolist()[:8]}, entry {i}: {int(want[i])}): query_lens_list "
                                 "and context_lens_list are the step's lengths, and every length tensor must "
                                 "agree with them")

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        query_lens: IntsLike,
        context_lens: IntsLike,
        block_table: torch.Tensor | Sequence[Sequence[int]],
        block_size: int,
        *,
        decode_threshold: int = 1,
        num_blocks: int | None = None,
        device: str | torch.device | None = None,
        reorder: bool = True,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        read_only: bool = False,
    ) -> BatchMetadata:
        """Validate one step's requests and derive everything backends need.

        Args:
            query_lens: ``[B]`` new tokens per request (>= 0), in the caller's order.
            context_lens: ``[B]`` tokens already cached per request (>= 0).
            block_table: ``[B, max_blocks]`` page ids; row ``b`` must cover ``context_lens[b] + query_lens[b]``
                tokens. Entries past a sequence's last page are ignored (may be -1).
            block_size: tokens per page.
            decode_threshold: requests with ``1 <= query_len <= decode_threshold`` are decodes.
            num_blocks: pages in the cache; when given, block ids are checked against it.
            device: where the tensors go (default: the block table's device, else CPU).
            reorder: put decodes first (default). With False the caller's order is kept.
            dcp_rank / dcp_size: decode context parallelism (default none). The lengths stay global; row
                ``b`` of ``block_table`` maps this rank's local tokens (``dcp_local_len(seq_len, dcp_rank,
                dcp_size)`` of them), and new tokens stored on other ranks get slot -1.
            read_only: the step writes nothing (a view over rows already cached, such as a DCP rank's local
                decode metadata, whose last local row of each request stands in for its token): every slot is
                -1 and the one-writer-per-slot check is skipped.
        """
        require_int("block_size", block_size, minimum=1)
        require_int("decode_threshold", decode_threshold, minimum=0)
        if num_blocks is not None:
            require_int("num_blocks", num_blocks, minimum=1)
        require_int("dcp_size", dcp_size, minimum=1)
        require_int("dcp_rank", dcp_rank, minimum=0)
        if dcp_rank >= dcp_size:
            raise ValueError(f"dcp_rank: got {dcp_rank}; supported 0..{dcp_size - 1} (dcp_size {dcp_size})")
        q = _as_int_list("query_lens", query_lens)
        c = _as_int_list("context_lens", context_lens)
        if len(q) != len(c):
            raise ValueError(f"context_lens: got {len(c)} entries; supported one per request ({len(q)} query_lens)")
        for name, vals in (("query_lens", q), ("context_lens", c)):
            for b, v in enumerate(vals):
                if v < 0:
                    raise ValueError(f"{name}[{b}]: got {v} for request {b}; supported >= 0")
        bt = _as_block_table(block_table)
        if bt.shape[0] != len(q):
            raise ValueError(f"block_table: got {bt.shape[0]} rows; supported one per request ({len(q)})")
        dev = require_device("device", device) if device is not None else bt.device
        bt_host = bt.detach().to("cpu", torch.int64)
        if bt_host.numel() and (int(bt_host.max()) > INT32_MAX or int(bt_host.min()) < -1 - INT32_MAX):
            bad = int(bt_host.max()) if int(bt_host.max()) > INT32_MAX else int(bt_host.min())
            raise ValueError(f"block_table: got block id {bad}; supported ids that fit int32 (<= {INT32_MAX})")
        seq = [cq + cc for cq, cc in zip(q, c, strict=True)]
        for b, s in enumerate(seq):
            if s > INT32_MAX:
                raise ValueError(f"context_lens[{b}]: got {c[b]} (+ query {q[b]} = {s} tokens) for request {b}; "
                                 f"supported context + query <= {INT32_MAX} (int32 sequence lengths)")
        if sum(q) > INT32_MAX:
            raise ValueError(f"query_lens: got {sum(q)} tokens in all; supported <= {INT32_MAX} (int32 offsets)")
        needs = []
        for b, s in enumerate(seq):
            held = dcp_local_len(s, dcp_rank, dcp_size)
            need = -(-held // block_size)
            if need > bt_host.shape[1]:
                where = "" if dcp_size == 1 else f", {held} of them on DCP rank {dcp_rank} of {dcp_size}"
                raise ValueError(
                    f"block_table: request {b} holds {s} tokens (context {c[b]} + query {q[b]}{where}) and needs "
                    f"{need} pages of {block_size}; got a row of {bt_host.shape[1]} entries"
                )
            needs.append(need)
        lows, highs = (v.tolist() for v in live_block_bounds(bt_host, needs))
        for b, (need, lo, hi) in enumerate(zip(needs, lows, highs, strict=True)):
            if need and (lo < 0 or (num_blocks is not None and hi >= num_blocks)):
                used = bt_host[b, :need]
                bad = int(used[(used < 0) | (used >= (num_blocks or 2**62))][0])
                limit = f"[0, {num_blocks - 1}]" if num_blocks is not None else ">= 0"
                raise ValueError(f"block_table: request {b} uses block id {bad}; supported {limit}")
        maxima = highs

        # decode requests first (stable), prefills after
        B = len(q)
        if reorder:
            is_dec = [1 <= v <= decode_threshold for v in q]
            order = [b for b in range(B) if is_dec[b]] + [b for b in range(B) if not is_dec[b]]
        else:
            order = list(range(B))
        caller_start = list(accumulate(q, initial=0))
        qo = [q[b] for b in order]
        co = [c[b] for b in order]
        token_order = [t for b in order for t in range(caller_start[b], caller_start[b] + q[b])]
        token_request = [i for i, b in enumerate(order) for _ in range(q[b])]
        token_positions = [c[b] + j for b in order for j in range(q[b])]
        bt_proc = bt_host[order] if B else bt_host
        pos = torch.tensor(token_positions, dtype=torch.int64)
        req = torch.tensor(token_request, dtype=torch.int64)
        if len(token_positions) and dcp_size > 1:  # interleaved: p -> rank p % D, local index p // D
            mine = pos % dcp_size == dcp_rank
            slots = torch.full_like(pos, -1)
            if bool(mine.any()):
                slots[mine] = position_slots(bt_proc, req[mine], pos[mine] // dcp_size, block_size)
        elif len(token_positions):
            slots = position_slots(bt_proc, req, pos, block_size)
        else:
            slots = torch.zeros(0, dtype=torch.int64)
        if not isinstance(read_only, bool):
            raise TypeError(f"read_only: got {type(read_only).__name__}; supported bool")
        if read_only:
            slots = torch.full_like(pos, -1)
        clash = None if read_only else duplicate_slot(slots)
        if clash is not None:
            first, second = clash
            raise ValueError(
                f"block_table: caller requests {order[token_request[first]]} and {order[token_request[second]]} "
                f"both write slot {int(slots[first])} (positions {token_positions[first]} and "
                f"{token_positions[second]}) in this step; supported one writer per slot (pages shared by "
                "several requests may hold only their cached prefix)")

        def i32(vals: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(vals), dtype=torch.int32, device=dev)

        def i64(vals: Sequence[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(vals, dtype=torch.int64).to(dev)

        table = bt_proc.to(dev, torch.int32).contiguous()
        return cls(
            block_size=block_size,
            order=i64(order),
            token_order=i64(token_order),
            query_lens=i32(qo),
            context_lens=i32(co),
            seq_lens=i32([a + b for a, b in zip(qo, co, strict=True)]),
            query_start_loc=i32(list(accumulate(qo, initial=0))),
            block_table=table,
            slot_mapping=i64(slots),
            token_request=i64(token_request),
            token_positions=i64(pos),
            query_lens_list=tuple(qo),
            context_lens_list=tuple(co),
            num_blocks=num_blocks,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            max_block_ids=tuple(maxima[b] for b in order),
            verified_block_table=table,
            verified_lengths=_MADE_FROM_LISTS,
        )

    # ---- validation against a cache (host only) ---------------------------------------------------------
    def check_cache(self, cache: PagedRows, *, max_block_id: int | None = None) -> None:
        """Raise ValueError unless ``cache`` has this step's page size and holds every block id of every
        request's whole sequence (slots then lie in range too: each is ``block * block_size + offset``).

        A host comparison: :meth:`build`'s verdict (``num_blocks``) or its per-request maxima
        (:attr:`max_block_ids`) against ``cache.num_blocks``; ``max_block_id`` (what the step plan computed once,
        :meth:`max_live_block_id`) stands in for metadata that has neither. Metadata with neither and no
        ``max_block_id`` (made by hand) reads its table from the device (one sync); the layers never do.
        """
        if self.block_size != cache.block_size:
            raise ValueError(f"meta.block_size: got {self.block_size}; supported the cache's {cache.block_size}")
        n = cache.num_blocks
        if self.block_ids_trusted or not self.num_requests:
            return
        verified = self.verified_block_table is self.block_table  # build's verdicts describe this table
        if verified and self.num_blocks is not None:
            if self.num_blocks > n:
                raise ValueError(f"meta.num_blocks: got {self.num_blocks}; supported <= the cache's {n}")
            return
        hi = self.max_live_block_id() if max_block_id is None else max_block_id
        if hi is not None and hi >= n:
            raise ValueError(f"meta.block_table: got block id {hi}; supported [0, {n - 1}] for this cache "
                             f"({n} blocks)")

    def max_live_block_id(self) -> int | None:
        """The largest block id any request of the step reads (``-1``: none), the one computation of it: from
        :meth:`build`'s host maxima when they describe this table, else read from ``block_table`` (one sync;
        hand-made metadata). None when no read is needed (``block_ids_trusted``, or ``build`` checked the ids
        against ``num_blocks``)."""
        if self.block_ids_trusted:
            return None
        verified = self.verified_block_table is self.block_table
        if verified and self.num_blocks is not None:
            return None
        if verified and self.max_block_ids is not None:
            return max(self.max_block_ids, default=-1)
        return self._device_max_block_id()

    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """The new tokens' slots ``[T]`` for ``cache.write``, after :meth:`check_cache` (host only)."""
        self.check_cache(cache)
        return self.slot_mapping

    def _device_max_block_id(self) -> int:
        """Largest live block id read from ``block_table`` (one sync; hand-made metadata only)."""
        held = [dcp_local_len(s, self.dcp_rank, self.dcp_size) for s in self.seq_lens_list]  # local under DCP
        used = [-(-h // self.block_size) for h in held]
        if not max(used, default=0):
            return -1
        lo, hi = live_block_bounds(self.block_table, used)
        lo_v, hi_v = torch.stack([lo.min(), hi.max()]).tolist()  # the one sync
        if lo_v < 0:
            raise ValueError(f"meta.block_table: got block id {lo_v}; supported >= 0")
        return hi_v

    # ---- derived sizes ---------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.query_lens_list)

    # (derived from the frozen host lists once: every layer of a step reads them)
    @cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @cached_property
    def query_starts_list(self) -> tuple[int, ...]:
        """Host copy of ``query_start_loc``: ``[B + 1]`` token offsets of each request (processing order)."""
        return tuple(accumulate(self.query_lens_list, initial=0))

    @cached_property
    def seq_lens_list(self) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(self.query_lens_list, self.context_lens_list, strict=True))

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    @cached_property
    def is_uniform_query_len(self) -> bool:
        return len(set(self.query_lens_list)) <= 1

    # ---- order ------------------------------------------------------------------------------------------
    def to_processing_order(self, x: torch.Tensor) -> torch.Tensor:
        """Reorder a caller-order token tensor ``[T, ...]`` into processing order."""
        self._check_tokens("x", x)
        return x.index_select(0, self.token_order.to(x.device))

    def to_caller_order(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_processing_order` for ``[T, ...]`` outputs."""
        self._check_tokens("y", y)
        out = torch.empty_like(y)
        out.index_copy_(0, self.token_order.to(y.device), y)
        return out

    def _check_tokens(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: got {type(x).__name__}; supported torch.Tensor")
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"{name}: got {x.shape[0]} tokens; supported {self.num_tokens} (the batch's tokens)")

    # ---- sub-batches --------------------------------------------------------------------------------------
    def select_requests(self, start: int, stop: int) -> BatchMetadata:
        """Metadata for processing requests ``start:stop`` (already ordered; the permutation is identity).

        A new object on every call: :func:`~mla_backends.step.plan.plan_step` makes each sub-batch of a step
        once and every layer reads it from the plan (``plan.batch(start, stop)``).
        """
        require_int("start", start, minimum=0)
        require_int("stop", stop, minimum=start)
        if stop > self.num_requests:
            raise ValueError(f"stop: got {stop}; supported <= {self.num_requests} (the batch's requests)")
        starts = self.query_starts_list
        tok0, tok1 = starts[start], starts[stop]
        dev = self.device
        sub_table = self.block_table[start:stop]
        sub = BatchMetadata(
            block_size=self.block_size,
            order=torch.arange(stop - start, device=dev),
            token_order=torch.arange(tok1 - tok0, device=dev),
            query_lens=self.query_lens[start:stop],
            context_lens=self.context_lens[start:stop],
            seq_lens=self.seq_lens[start:stop],
            query_start_loc=torch.tensor([s - tok0 for s in starts[start:stop + 1]], dtype=torch.int32, device=dev),
            block_table=sub_table,
            slot_mapping=self.slot_mapping[tok0:tok1],
            token_request=self.token_request[tok0:tok1] - start,
            token_positions=self.token_positions[tok0:tok1],
            query_lens_list=self.query_lens_list[start:stop],
            context_lens_list=self.context_lens_list[start:stop],
            num_blocks=self.num_blocks,
            dcp_rank=self.dcp_rank,
            dcp_size=self.dcp_size,
            max_block_ids=None if self.max_block_ids is None else self.max_block_ids[start:stop],
            graph_static=self.graph_static,
            verified_block_table=sub_table if self.verified_block_table is self.block_table else None,
            block_ids_trusted=self.block_ids_trusted,
            verified_lengths=_MADE_FROM_LISTS,  # slices of this object's tensors, which agree with its lists
        )
        return sub

    # ---- decode context parallelism --------------------------------------------------------------------------
    def local_decode(self, dcp_rank: int, dcp_size: int) -> tuple[BatchMetadata | None, torch.Tensor]:
        """This DCP rank's view of the step's single-token requests: ``(local, tokens)``.

        ``local`` is read-only metadata over the rows the rank holds (each request it holds rows of gets query
        length 1 and context ``held - 1``, its last local row standing in for the token), None when it holds
        no row of any; ``tokens [n]`` (int64) is the processing-order token of each of its requests. Requests
        with more than one new token are refused (under DCP they run ``forward_mha``).
        """
        require_int("dcp_size", dcp_size, minimum=1)
        require_int("dcp_rank", dcp_rank, minimum=0)
        starts = self.query_starts_list
        rows, tokens, ctx = [], [], []
        for b, (qn, s) in enumerate(zip(self.query_lens_list, self.seq_lens_list, strict=True)):
            if qn > 1:
                raise ValueError(f"meta: request {b} has query length {qn} on the absorbed path under decode "
                                 "context parallelism; supported 1 (longer queries run forward_mha)")
            held = dcp_local_len(s, dcp_rank, dcp_size)
            if qn == 1 and held:
                rows.append(b)
                tokens.append(starts[b])
                ctx.append(held - 1)
        local = None
        if rows:
            local = BatchMetadata.build([1] * len(rows), ctx, self.block_table[rows], self.block_size,
                                        num_blocks=self.num_blocks, reorder=False, device=self.device,
                                        read_only=True)
        return local, torch.tensor(tokens, dtype=torch.long, device=self.device)

    # ---- engines' own decode batches ---------------------------------------------------------------------
    @classmethod
    def for_decode(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: Sequence[int],
                   block_size: int, *, slot_mapping: torch.Tensor | None = None) -> BatchMetadata:
        """The metadata of ``B`` single-token decode requests an engine already laid out, in its order (no
        reordering, no copy of the table when it is int32).

        For engines that keep their own block tables and lengths on the device (vLLM's decode metadata):
        nothing on the device is read. A host (CPU) table is checked as :meth:`build` checks it; a device
        table was made by the engine's allocator for its caches and is trusted (:attr:`block_ids_trusted`),
        since reading it back would synchronise.

        Args:
            block_table: ``[B, max_blocks]`` int page ids, on the caches' device.
            seq_lens: ``[B]`` int lengths including this step's token, same device.
            seq_lens_host: the same lengths as host ints (the engine's host copy).
            block_size: tokens per page of the caches.
            slot_mapping: ``[B]`` slots of the new tokens (when the engine writes them itself; default ``-1``).
        """
        require_tensor("block_table", block_table, ndim=2)
        if not _is_int_tensor(block_table):
            raise TypeError(f"block_table: got dtype {block_table.dtype}; supported an int tensor")
        B = block_table.shape[0]
        require_tensor("seq_lens", seq_lens, shape=(B,))
        if not _is_int_tensor(seq_lens):
            raise TypeError(f"seq_lens: got dtype {seq_lens.dtype}; supported an int tensor")
        require_int("block_size", block_size, minimum=1)
        if isinstance(seq_lens_host, (str, bytes)) or not isinstance(seq_lens_host, Sequence):
            raise TypeError(f"seq_lens_host: got {type(seq_lens_host).__name__}; supported a sequence of ints")
        lens = tuple(seq_lens_host)
        if len(lens) != B:
            raise ValueError(f"seq_lens_host: got {len(lens)} lengths; supported one per request ({B})")
        for b, s in enumerate(lens):
            require_int(f"seq_lens_host[{b}]", s, minimum=1)
            if s > INT32_MAX:
                raise ValueError(f"seq_lens_host[{b}]: got {s}; supported <= {INT32_MAX} (int32 lengths)")
            if -(-s // block_size) > block_table.shape[1]:
                raise ValueError(f"block_table: request {b} holds {s} tokens and needs {-(-s // block_size)} "
                                 f"pages of {block_size}; got a row of {block_table.shape[1]} entries")
        dev = block_table.device
        if slot_mapping is not None:
            require_tensor("slot_mapping", slot_mapping, ndim=1)
            if slot_mapping.shape[0] < B or not _is_int_tensor(slot_mapping):
                raise ValueError(f"slot_mapping: got {list(slot_mapping.shape)} {slot_mapping.dtype}; supported "
                                 f"at least {B} int slots")
        table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        seq = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
        ctx = seq - 1
        rows = torch.arange(B, device=dev)
        slots = (torch.full((B,), -1, dtype=torch.int64, device=dev) if slot_mapping is None
                 else slot_mapping[:B].to(torch.int64))
        max_ids = None
        if dev.type == "cpu":  # host memory: the per-request largest live block id, as build() keeps it
            lo, hi = live_block_bounds(table, [-(-s // block_size) for s in lens])
            max_ids = tuple(hi.tolist())
            if B and int(lo.min()) < 0:
                raise ValueError("block_table: got a negative block id in a live page; supported ids >= 0")
        return cls(
            block_size=block_size, order=rows, token_order=rows,
            query_lens=torch.ones(B, dtype=torch.int32, device=dev), context_lens=ctx, seq_lens=seq,
            query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev), block_table=table,
            slot_mapping=slots, token_request=rows, token_positions=ctx.long(), query_lens_list=(1,) * B,
            context_lens_list=tuple(s - 1 for s in lens), max_block_ids=max_ids, verified_block_table=table,
            block_ids_trusted=dev.type != "cpu", verified_lengths=_MADE_FROM_LISTS)  # the engine's host copy
