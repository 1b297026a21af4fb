"""What a DeepSeek-V4 step works out once, before its first layer: :class:`V4Planner` and :class:`V4StepState`.

A V4 layer keeps four paged stores (``mla_backends/layer/v4/cache.py``); this module says, from the step's
:class:`~mla_backends.step.metadata.BatchMetadata` alone (host lists, one pass), where everything goes:

- **window rows** and **compressor state rows** are addressed by token position through the step's block table
  (``meta.block_table``, ``meta.block_size``): the new tokens' slots are ``meta.slot_mapping``;
- **compressed entries** (and the CSA indexer's keys) are addressed by entry number through a compressed block
  table derived from the same table: a page holds ``entries_per_page = max(1, block_size // ratio)`` entries and
  entry ``w`` lives on the token page holding position ``w * ratio`` (``block_size`` and ``ratio`` must divide
  one another), so one table serves every pool (:func:`compressed_table`);
- per layer kind (``compressed_sparse_attention`` / ``heavily_compressed_attention``, ratio ``r``, CSA windows
  overlapping by one: ``span = 2r``, HCA ``span = r``), the :class:`EntryPlan`: the entries this step completes
  (entry ``w`` of a request with ``context_len`` cached and ``seq_len`` after the step is new when
  ``context_len // r <= w < seq_len // r``), their slots, their rotary positions ``w * r``, the state slots of the
  ``span`` tokens each pools (``-1`` before position 0), and, per token, the entries it may see: entry ``w`` is
  visible to position ``p`` once its window is complete, ``w < (p + 1) // r``.

The state is frozen and made once per step (``plan_step`` asks the layer's planner for it through
``PlanRequest.preparers``); the layers only read it. Shapes are host integers; nothing here is read back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..core.v4dims import CSA, HCA
from ..core.validation import require_int, require_tensor
from .cache import PagedRows, SlotSource, position_slots
from .metadata import BatchMetadata
from .plan import PlanRequest, Run, StepPlan, plan_step

__all__ = ["V4Planner", "V4StepState", "EntryPlan", "CompressorSlots", "PoolWrite", "PoolTable", "V4PoolTables",
           "plan_v4_step", "compressed_table", "entries_per_page", "check_page_ratio"]


def entries_per_page(block_size: int, ratio: int) -> int:
    """Compressed entries on one page of a pool paged like the token pages: ``max(1, block_size // ratio)``."""
    return max(1, block_size // ratio)


def check_page_ratio(block_size: int, ratio: int, what: str = "block_size") -> None:
    """ValueError unless ``block_size`` and ``ratio`` divide one another (then a token page holds whole
    entries, or an entry's window spans whole pages)."""
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"{what}: got {block_size}; supported a multiple or a divisor of the compress ratio "
                         f"{ratio} (a page holds whole compressed entries, or an entry spans whole pages)")


def compressed_table(block_table: torch.Tensor, block_size: int, ratio: int) -> torch.Tensor:
    """The compressed block table ``[B, pages]`` of a pool with :func:`entries_per_page` entries a page, derived
    from the token ``block_table``: column ``j`` is the token page holding position ``j * entries_per_page *
    ratio`` (the table itself when ``block_size >= ratio``, every ``ratio // block_size``-th column otherwise)."""
    if block_size >= ratio:
        return block_table
    return block_table[:, :: ratio // block_size]



@dataclass(frozen=True)
class PoolTable:
    """One pool's own pages in a step, as an engine keeps them (vLLM gives each V4 pool its own table).

    Attributes:
        block_table: ``[B, pages]`` int32/int64 page ids, one row per request in the **caller's order** (the
            order ``BatchMetadata.build`` was given; the planner puts them in processing order on the device).
        block_size: rows a page: tokens for a state pool, entries for a compressed or indexer-key pool.
        num_blocks: the pool's pages, when the ids should be checked against it (host tables only).
    """

    block_table: torch.Tensor
    block_size: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        require_tensor("block_table", self.block_table, ndim=2, dtypes=(torch.int32, torch.int64))
        require_int("block_size", self.block_size, minimum=1)
        if self.num_blocks is not None:
            require_int("num_blocks", self.num_blocks, minimum=1)


def _frozen_pools(name: str, pools: Mapping[str, PoolTable] | None) -> Mapping[str, PoolTable]:
    pools = dict(pools or {})
    bad = sorted(set(pools) - {CSA, HCA})
    if bad:
        raise ValueError(f"{name}: got kinds {bad}; supported {CSA!r}, {HCA!r}")
    for kind, table in pools.items():
        if not isinstance(table, PoolTable):
            raise TypeError(f"{name}[{kind!r}]: got {type(table).__name__}; supported PoolTable")
    return MappingProxyType(pools)


@dataclass(frozen=True)
class V4PoolTables:
    """Per-pool block tables of one V4 step (what :func:`plan_v4_step` takes). The window rows are always
    addressed through the step's metadata (``meta.block_table`` / ``meta.block_size``: build it from the window
    pool's table); every pool left out here is derived from that table (:func:`compressed_table`, token
    positions).

    Attributes:
        compressed: ``{layer kind: PoolTable}`` of the compressed entries (``block_size`` entries a page).
        state: ``{layer kind: PoolTable}`` of the compressor states (``block_size`` token positions a page;
            only the positions a step reads need live pages, so the pool may recycle older ones).
        indexer_keys / indexer_state: the CSA indexer's keys (entries) and states (positions); None: the CSA
            ``compressed`` / ``state`` tables.
    """

    compressed: Mapping[str, PoolTable] = field(default_factory=dict)
    state: Mapping[str, PoolTable] = field(default_factory=dict)
    indexer_keys: PoolTable | None = None
    indexer_state: PoolTable | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compressed", _frozen_pools("compressed", self.compressed))
        object.__setattr__(self, "state", _frozen_pools("state", self.state))
        for name in ("indexer_keys", "indexer_state"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, PoolTable):
                raise TypeError(f"{name}: got {type(value).__name__}; supported PoolTable or None")


@dataclass(frozen=True, eq=False)
class PoolWrite(SlotSource):
    """The slots a step writes in one pool (``cache.write(rows, pool_write)``: trusted, no device read) and
    what they were checked against: ``slots [n]`` int64, ``block_size`` rows a page, the largest page id the
    step uses (None: checked by ``BatchMetadata.build`` against ``num_blocks``, or an engine's device table)."""

    slots: torch.Tensor
    block_size: int
    what: str
    max_block_id: int | None = None
    num_blocks: int | None = None

    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """The slots, after a host check that ``cache`` pages rows as this pool does and holds every page."""
        if cache.block_size != self.block_size:
            raise ValueError(f"{self.what}: got a store of {cache.block_size} rows a page; supported "
                             f"{self.block_size} (the step's {self.what} table)")
        if self.num_blocks is not None and self.num_blocks > cache.num_blocks:
            raise ValueError(f"{self.what}: got a store of {cache.num_blocks} pages; supported >= "
                             f"{self.num_blocks} (the pages the step's table was checked against)")
        if self.max_block_id is not None and self.max_block_id >= cache.num_blocks:
            raise ValueError(f"{self.what}: got block id {self.max_block_id} in the step's table; supported "
                             f"[0, {cache.num_blocks - 1}] for this store")
        return self.slots


@dataclass(frozen=True, eq=False)
class CompressorSlots:
    """Where one compressor of a layer kind reads and writes in a step.

    Attributes:
        state: the new tokens' slots in its state pool (``[T]``, a :class:`PoolWrite`).
        sources: ``[n, span]`` int64 state slots of the tokens each new entry pools, oldest first (``-1``:
            a position before 0, whose weight is 0).
        out: the new entries' slots in its entry pool (a :class:`PoolWrite`).
        table / entries_per_page: the entry pool's block table ``[B, pages]`` (processing order) and page.
    """

    state: PoolWrite
    sources: torch.Tensor
    out: PoolWrite
    table: torch.Tensor
    entries_per_page: int


@dataclass(frozen=True, eq=False)
class EntryPlan(SlotSource):
    """One layer kind's compressed entries in a step (module docstring); the slot source of the entries it
    writes into the compressed store (``cache.write(rows, plan)``: trusted, no device read).

    Attributes:
        ratio / span: tokens per entry and tokens pooled per entry (``2 * ratio`` with CSA's overlap).
        entries_per_page: entries on one page of the compressed pool.
        table: ``[B, pages]`` int32 compressed block table (processing order).
        new_slots: ``[n]`` int64 compressed-pool slots of the entries this step completes.
        new_positions: ``[n]`` int64 rotary positions of those entries (``w * ratio``).
        source_slots: ``[n, span]`` int64 state slots of the tokens each pools, oldest first (``-1``: a
            position before 0, whose weight is 0).
        visible: ``[T]`` int64 entries each token may see (``(p + 1) // ratio``).
        seen: ``[T, E]`` int64 entry numbers ``0 .. visible - 1`` of each token, ``-1`` padded (``E =
            max(1, max visible)``): HCA attends all of them, the CSA indexer scores them.
        num_new / max_visible: host counts (``n`` and the largest ``visible``).
        main / indexer: the layer's compressor's and (CSA) the indexer's :class:`CompressorSlots` (their
            pools' tables: the step's own, or the engine's per-pool ones).
    """

    ratio: int
    span: int
    entries_per_page: int
    table: torch.Tensor
    new_slots: torch.Tensor
    new_positions: torch.Tensor
    source_slots: torch.Tensor
    visible: torch.Tensor
    seen: torch.Tensor
    num_new: int
    max_visible: int
    main: CompressorSlots
    indexer: CompressorSlots | None = None

    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """The new entries' slots ``[n]`` in the compressed pool, after the host checks of
        :meth:`PoolWrite.slots_for`."""
        return self.main.out.slots_for(cache)


@dataclass(frozen=True, eq=False)
class V4StepState:
    """A V4 step's plan: the window length, one :class:`EntryPlan` per compressed layer kind, and the per-pool
    tables it was made from (None: every pool derived from the step's table)."""

    window: int
    entries: Mapping[str, EntryPlan]
    tables: V4PoolTables | None = None

    def for_kind(self, kind: str) -> EntryPlan:
        return self.entries[kind]


class V4Planner:
    """Makes a step's :class:`V4StepState` (``prepare(meta)``); a ``Preparer`` of the plan protocol.

    Args:
        window: ``sliding_window`` of the model.
        ratios: ``{layer kind: compress ratio}`` for the compressed kinds the planned layers use.
        tables: this step's per-pool tables (:meth:`with_tables`, what :func:`plan_v4_step` does); None: every
            pool is addressed through the step's table.

    Layers of one model share one planner key, so the state is made once per step for all of them.
    """

    def __init__(self, window: int, ratios: Mapping[str, int], tables: V4PoolTables | None = None) -> None:
        self.window = require_int("window", window, minimum=1)
        bad = sorted(set(ratios) - {CSA, HCA})
        if bad:
            raise ValueError(f"ratios: got kinds {bad}; supported {CSA!r}, {HCA!r}")
        self.ratios = {k: require_int(f"ratios[{k!r}]", r, minimum=1) for k, r in sorted(ratios.items())}
        if tables is not None and not isinstance(tables, V4PoolTables):
            raise TypeError(f"tables: got {type(tables).__name__}; supported V4PoolTables or None")
        self.tables = tables

    def prepare_key(self) -> Hashable:
        return ("V4Planner", self.window, tuple(self.ratios.items()))

    def with_tables(self, tables: V4PoolTables) -> V4Planner:
        """This planner for one step with per-pool tables (the same key: its state stands for this one's)."""
        return V4Planner(self.window, self.ratios, tables)

    def check_block_size(self, block_size: int) -> None:
        """ValueError unless ``block_size`` suits every ratio (:func:`check_page_ratio`)."""
        for r in self.ratios.values():
            check_page_ratio(block_size, r)

    def prepare(self, meta: BatchMetadata) -> V4StepState:
        """The step's :class:`V4StepState` for ``meta`` (whole sequences; host lists and table gathers)."""
        tables = self.tables
        for kind, r in self.ratios.items():
            if tables is None or kind not in tables.compressed:  # a compressed pool derived from the step's
                check_page_ratio(meta.block_size, r)
        checked = meta.num_blocks if meta.verified_block_table is meta.block_table else None
        max_id = meta.max_live_block_id() if self.ratios else None  # host maxima (a device read: hand-made)
        entries = {kind: _entry_plan(meta, kind, r, 2 * r if kind == CSA else r, tables, max_id, checked)
                   for kind, r in self.ratios.items()}
        return V4StepState(window=self.window, entries=MappingProxyType(entries), tables=tables)


def _pool_rows(meta: BatchMetadata, pool: PoolTable, what: str,
               spans: list[tuple[int, int]]) -> tuple[torch.Tensor, int | None, int | None]:
    """``(table in processing order on meta's device, largest page id the step uses or None, num_blocks)``.
    ``spans``: per processing-order request, the rows ``[lo, hi)`` the step reads or writes. Host tables on a
    CPU step are checked here (ids >= 0 and below ``num_blocks``); a device step trusts the engine's table."""
    B = meta.num_requests
    if pool.block_table.shape[0] != B:
        raise ValueError(f"{what}.block_table: got {pool.block_table.shape[0]} rows; supported one per request ({B})")
    if meta.device.type != "cpu" or pool.block_table.device.type != "cpu":
        return pool.block_table.to(meta.device)[meta.order].to(torch.int32), None, None
    table = pool.block_table[meta.order]
    bs, hi_id = pool.block_size, -1
    for b, (lo, hi) in enumerate(spans):
        if hi <= lo:
            continue
        first, last = lo // bs, (hi - 1) // bs
        if last >= table.shape[1]:
            raise ValueError(f"{what}.block_table: request {int(meta.order[b])} needs page {last} (rows {lo}..{hi - 1} "
                             f"of {bs} a page); got a row of {table.shape[1]} entries")
        ids = table[b, first: last + 1]
        bad = (ids < 0) | (ids >= (pool.num_blocks or 2**62))
        if bool(bad.any()):
            limit = f"[0, {pool.num_blocks - 1}]" if pool.num_blocks else ">= 0"
            raise ValueError(f"{what}.block_table: request {int(meta.order[b])} uses block id {int(ids[bad][0])} "
                             f"for rows {lo}..{hi - 1}; supported {limit}")
        hi_id = max(hi_id, int(ids.max()))
    return table.to(torch.int32), hi_id, pool.num_blocks


def _entry_plan(meta: BatchMetadata, kind: str, ratio: int, span: int, tables: V4PoolTables | None,
                max_block_id: int | None, num_blocks: int | None) -> EntryPlan:
    dev, bs = meta.device, meta.block_size
    ctx, seq = meta.context_lens_list, meta.seq_lens_list
    reqs: list[int] = []
    ents: list[int] = []
    for b, (c, s) in enumerate(zip(ctx, seq, strict=True)):
        first, stop = c // ratio, s // ratio
        reqs += [b] * (stop - first)
        ents += range(first, stop)
    req = torch.tensor(reqs, dtype=torch.long)
    ent = torch.tensor(ents, dtype=torch.long)
    req_d, ent_d = req.to(dev), ent.to(dev)
    # the tokens each new entry pools: positions (w + 1) * ratio - span .. (w + 1) * ratio - 1, oldest first
    src_pos = ((ent + 1) * ratio - span)[:, None] + torch.arange(span)[None, :]
    src_valid = src_pos >= 0
    src_req = req[:, None].expand_as(src_pos)
    # rows each pool's step touches, per request: entries 0 .. seq // ratio - 1; states back to the oldest
    # token a new entry pools
    entry_spans = [(0, s // ratio) for s in seq]
    state_spans = [(max(0, min(c, (c // ratio + 1) * ratio - span)), s) for c, s in zip(ctx, seq, strict=True)]

    def entries_pool(pool: PoolTable | None, what: str) -> tuple[torch.Tensor, int, PoolWrite]:
        if pool is None:  # derived from the step's token table
            epp = entries_per_page(bs, ratio)
            table, hi, nb = compressed_table(meta.block_table, bs, ratio), max_block_id, num_blocks
        else:
            epp = pool.block_size
            table, hi, nb = _pool_rows(meta, pool, what, entry_spans)
        slots = (table.long()[req_d, ent_d // epp] * epp + ent_d % epp if reqs
                 else torch.zeros(0, dtype=torch.long, device=dev))
        return table, epp, PoolWrite(slots, epp, what, hi, nb)

    def state_pool(pool: PoolTable | None, what: str) -> tuple[PoolWrite, torch.Tensor]:
        if pool is None:
            table, sbs, hi, nb = meta.block_table, bs, max_block_id, num_blocks
            new = meta.slot_mapping
        else:
            sbs = pool.block_size
            table, hi, nb = _pool_rows(meta, pool, what, state_spans)
            new = position_slots(table, meta.token_request, meta.token_positions, sbs)
        src = position_slots(table, src_req.to(dev), src_pos.clamp_min(0).to(dev), sbs)
        return PoolWrite(new, sbs, what, hi, nb), torch.where(src_valid.to(dev), src, torch.full_like(src, -1))

    def slots(entries: PoolTable | None, states: PoolTable | None, indexer: bool) -> CompressorSlots:
        names = ("indexer_keys", "indexer_state") if indexer else (f"compressed[{kind!r}]", f"state[{kind!r}]")
        table, epp, out = entries_pool(entries, names[0])
        write, sources = state_pool(states, names[1])
        return CompressorSlots(write, sources, out, table, epp)

    comp = tables.compressed.get(kind) if tables is not None else None
    state = tables.state.get(kind) if tables is not None else None
    main = slots(comp, state, False)
    indexer = None
    if kind == CSA:
        ikeys = tables.indexer_keys if tables is not None and tables.indexer_keys is not None else comp
        istate = tables.indexer_state if tables is not None and tables.indexer_state is not None else state
        indexer = slots(ikeys, istate, True)
    visible = (meta.token_positions + 1) // ratio
    max_vis = max((s // ratio for s in seq), default=0)
    E = max(1, max_vis)
    cols = torch.arange(E, device=dev)[None, :]
    seen = torch.where(cols < visible[:, None], cols, torch.full_like(cols, -1))
    return EntryPlan(ratio=ratio, span=span, entries_per_page=main.entries_per_page, table=main.table,
                     new_slots=main.out.slots, new_positions=ent_d * ratio, source_slots=main.sources,
                     visible=visible, seen=seen, num_new=len(reqs), max_visible=max_vis, main=main, indexer=indexer)


class _TablesStep:
    """What :func:`plan_v4_step` puts first among a step's participants: the planner bound to the step's tables,
    asking for one absorbed run of the whole step with no backend state of its own."""

    def __init__(self, planner: V4Planner) -> None:
        self.planner = planner

    def plan_request(self, meta: BatchMetadata) -> PlanRequest:
        return PlanRequest(runs_key=None, runs=(Run(True, 0, meta.num_requests),), backend=_NO_STATE,
                           preparers=(self.planner,))


class _NoState:
    """A ``Preparer`` with nothing to prepare (the tables' participant has no backend)."""

    def prepare(self, meta: BatchMetadata) -> None:
        return None

    def prepare_key(self) -> Hashable:
        return "V4PoolTables"

    def planned_declarations(self, meta: BatchMetadata, *, sparse: bool = False) -> frozenset:
        return frozenset()


_NO_STATE = _NoState()


def plan_v4_step(meta: BatchMetadata, participants: Iterable[object],
                 tables: V4PoolTables | None = None) -> StepPlan:
    """``plan_step(meta, participants)`` for a step whose V4 pools have their own block tables: every V4
    layer's planner among ``participants`` (``layer.planner``) makes the step's :class:`V4StepState` from
    ``tables`` (slots of every compressed, state and indexer pool from its own table) instead of deriving them
    from ``meta.block_table``, which addresses the window rows. ``tables`` None: ``plan_step`` as it is.

    Raises:
        TypeError: ``tables`` is not :class:`V4PoolTables`.
        ValueError: no V4 layer among ``participants``; a table with the wrong rows or (host tables) a page id
            the step uses that is negative or past the pool's ``num_blocks``.
    """
    if tables is None:
        return plan_step(meta, participants)
    if not isinstance(tables, V4PoolTables):
        raise TypeError(f"tables: got {type(tables).__name__}; supported V4PoolTables or None")
    if isinstance(participants, (str, bytes)) or not isinstance(participants, Iterable):
        raise TypeError(f"participants: got {type(participants).__name__}; supported an iterable of layers")
    participants = list(participants)
    lead: list[object] = []
    keys: set[Hashable] = set()
    for p in participants:
        planner = getattr(p, "planner", None)
        if isinstance(planner, V4Planner) and planner.prepare_key() not in keys:
            keys.add(planner.prepare_key())
            lead.append(_TablesStep(planner.with_tables(tables)))
    if not lead:
        raise ValueError("participants: got no DeepSeek-V4 layer (with a V4Planner); supported the step's V4 "
                         "layers when per-pool tables are given")
    return plan_step(meta, [*lead, *participants])  # the bound planners first: their states are the step's
