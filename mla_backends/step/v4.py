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

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..core.v4dims import CSA, HCA
from ..core.validation import require_int
from .cache import PagedRows, SlotSource, position_slots
from .metadata import BatchMetadata

__all__ = ["V4Planner", "V4StepState", "EntryPlan", "compressed_table", "entries_per_page", "check_page_ratio"]


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


@dataclass(frozen=True, eq=False)
class EntryPlan(SlotSource):
    """One layer kind's compressed entries in a step (module docstring); the slot source of the entries it
    writes (``cache.write(rows, plan)`` into a compressed store: trusted, no device read).

    Attributes:
        ratio / span: tokens per entry and tokens pooled per entry (``2 * ratio`` with CSA's overlap).
        entries_per_page: entries on one page of the compressed pools.
        table: ``[B, pages]`` int32 compressed block table (processing order).
        new_slots: ``[n]`` int64 compressed-pool slots of the entries this step completes.
        new_positions: ``[n]`` int64 rotary positions of those entries (``w * ratio``).
        source_slots: ``[n, span]`` int64 state slots of the tokens each pools, oldest first (``-1``: a
            position before 0, whose weight is 0).
        visible: ``[T]`` int64 entries each token may see (``(p + 1) // ratio``).
        seen: ``[T, E]`` int64 entry numbers ``0 .. visible - 1`` of each token, ``-1`` padded (``E =
            max(1, max visible)``): HCA attends all of them, the CSA indexer scores them.
        num_new / max_visible: host counts (``n`` and the largest ``visible``).
        max_block_id / num_blocks: what the step's block ids were checked against (as ``BatchMetadata``: the
            largest live block id, or the ``num_blocks`` ``build`` checked them against; both None: trusted).
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
    max_block_id: int | None = None
    num_blocks: int | None = None

    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """The new entries' slots ``[n]`` after a host check that ``cache`` pages entries as this plan does and
        holds every page of the step."""
        if cache.block_size != self.entries_per_page:
            raise ValueError(f"cache.block_size: got {cache.block_size}; supported {self.entries_per_page} entries "
                             f"a page (ratio {self.ratio})")
        if self.num_blocks is not None and self.num_blocks > cache.num_blocks:
            raise ValueError(f"meta.num_blocks: got {self.num_blocks}; supported <= the cache's {cache.num_blocks}")
        if self.max_block_id is not None and self.max_block_id >= cache.num_blocks:
            raise ValueError(f"meta.block_table: got block id {self.max_block_id}; supported [0, "
                             f"{cache.num_blocks - 1}] for this cache")
        return self.new_slots


@dataclass(frozen=True, eq=False)
class V4StepState:
    """A V4 step's plan: the window length and one :class:`EntryPlan` per compressed layer kind."""

    window: int
    entries: Mapping[str, EntryPlan]

    def for_kind(self, kind: str) -> EntryPlan:
        return self.entries[kind]


class V4Planner:
    """Makes a step's :class:`V4StepState` (``prepare(meta)``); a ``Preparer`` of the plan protocol.

    Args:
        window: ``sliding_window`` of the model.
        ratios: ``{layer kind: compress ratio}`` for the compressed kinds the planned layers use.

    Layers of one model share one planner key, so the state is made once per step for all of them.
    """

    def __init__(self, window: int, ratios: Mapping[str, int]) -> None:
        self.window = require_int("window", window, minimum=1)
        bad = sorted(set(ratios) - {CSA, HCA})
        if bad:
            raise ValueError(f"ratios: got kinds {bad}; supported {CSA!r}, {HCA!r}")
        self.ratios = {k: require_int(f"ratios[{k!r}]", r, minimum=1) for k, r in sorted(ratios.items())}

    def prepare_key(self) -> Hashable:
        return ("V4Planner", self.window, tuple(self.ratios.items()))

    def check_block_size(self, block_size: int) -> None:
        """ValueError unless ``block_size`` suits every ratio (:func:`check_page_ratio`)."""
        for r in self.ratios.values():
            check_page_ratio(block_size, r)

    def prepare(self, meta: BatchMetadata) -> V4StepState:
        """The step's :class:`V4StepState` for ``meta`` (whole sequences; host lists and one table gather)."""
        self.check_block_size(meta.block_size)
        checked = meta.num_blocks if meta.verified_block_table is meta.block_table else None
        max_id = meta.max_live_block_id() if self.ratios else None  # host maxima (a device read: hand-made)
        entries = {kind: _entry_plan(meta, r, 2 * r if kind == CSA else r, max_id, checked)
                   for kind, r in self.ratios.items()}
        return V4StepState(window=self.window, entries=MappingProxyType(entries))


def _entry_plan(meta: BatchMetadata, ratio: int, span: int, max_block_id: int | None,
                num_blocks: int | None) -> EntryPlan:
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
    epp = entries_per_page(bs, ratio)
    table = compressed_table(meta.block_table, bs, ratio)
    req_d, ent_d = req.to(dev), ent.to(dev)
    new_slots = table.long()[req_d, ent_d // epp] * epp + ent_d % epp if reqs else torch.zeros(0, dtype=torch.long,
                                                                                               device=dev)
    # the tokens each new entry pools: positions (w + 1) * ratio - span .. (w + 1) * ratio - 1, oldest first
    src_pos = ((ent + 1) * ratio - span)[:, None] + torch.arange(span)[None, :]
    src_valid = src_pos >= 0
    src_req = req[:, None].expand_as(src_pos)
    src = position_slots(meta.block_table, src_req.to(dev), src_pos.clamp_min(0).to(dev), bs)
    source_slots = torch.where(src_valid.to(dev), src, torch.full_like(src, -1))
    visible = (meta.token_positions + 1) // ratio
    max_vis = max((s // ratio for s in seq), default=0)
    E = max(1, max_vis)
    cols = torch.arange(E, device=dev)[None, :]
    seen = torch.where(cols < visible[:, None], cols, torch.full_like(cols, -1))
    return EntryPlan(ratio=ratio, span=span, entries_per_page=epp, table=table, new_slots=new_slots,
                     new_positions=ent_d * ratio, source_slots=source_slots, visible=visible, seen=seen,
                     num_new=len(reqs), max_visible=max_vis, max_block_id=max_block_id, num_blocks=num_blocks)
