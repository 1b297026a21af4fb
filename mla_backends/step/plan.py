"""What one step works out once, before its first layer: :func:`plan_step` and the frozen :class:`StepPlan`.

A :class:`~mla_backends.step.metadata.BatchMetadata` describes one step (one forward over all layers) and knows
nothing of backends. :func:`plan_step` is the one place that turns it into everything the step's layers and
backends read:

- ``runs``: for each layer's dispatch (policy, backend declarations, sparse or not), the processing-order
  requests cut into :class:`Run` s that take the absorbed or the expanded path;
- ``batches``: the sub-batch metadata of every run (``(start, stop)``; the whole step is ``(0, B)``);
- ``local``: under decode context parallelism, each absorbed run's rank-local decode metadata and the
  processing-order token of each of its rows;
- ``states``: every backend's per-step state, its :meth:`~mla_backends.backends.contract.MLABackend.prepare` result for
  every batch it will be handed (FlashInfer's ``plan()``, REF_TORCH's page ids and masks), once per
  ``backend.prepare_key()`` and batch;
- ``accepted``: the combinations of inputs each configured backend's declarations accept for its batches
  (``forward_mqa`` looks its inputs up here instead of asking the declarations again on every layer);
- ``max_block_id``: the largest live block id of the step, which every cache check compares with;
- ``members``: which runs each participant reads (an engine's ``plan.runs_of(backend)``, a layer's own runs).

It runs once per step, eagerly, outside any CUDA-graph capture (for a captured decode step: after
``DecodeGraphMetadata.update`` and before ``graph.replay()``). The plan is then frozen: ``MLAAttention.forward``,
``forward_mqa`` and ``forward_mha`` only read it, and a layer handed a plan that was not made for it (another
step's metadata, another layer's dispatch, another backend) refuses it by name instead of planning in the middle
of a step. Nothing after planning waits for the device: what needs host data was computed here, from host data.

Participants are duck-typed so that this module stays below the backends and the layer: each has
``plan_request(meta) -> PlanRequest`` saying what it will run. ``MLAAttention`` asks for its runs; an
``MLABackend`` instance asks for the whole step as one absorbed batch, or, given ``dispatch=`` (a policy or its
name), for the runs that policy cuts, the ones a layer with that policy gets: an engine that calls ``forward_mqa``
itself reads them back with :meth:`StepPlan.runs_of` (``(Run, sub-batch)`` pairs) instead of splitting the step
again. A participant may also have ``plan_key() -> Hashable``: the participants of a step with equal keys would
make equal requests, so only the first of them is asked (a 60-layer model whose layers are configured alike costs
one request, not 60).

Frozen means consistent: :class:`Run`, :class:`PlanRequest` and :class:`StepPlan` check themselves on
construction, ``dataclasses.replace`` included. A plan is bound to the metadata it was planned for: its
``meta`` is its own whole-step batch, every run, batch and state belongs to it, so ``replace(plan, meta=other)``
is a :class:`StepPlanError` at once, before any layer reads or writes anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..core.errors import plugin_call
from ..core.validation import require_int
from .cache import PagedRows, SlotSource
from .checks import require_whole_sequences
from .metadata import BatchMetadata

__all__ = ["Run", "RunBatch", "PlanRequest", "StepPlan", "StepPlanError", "plan_step", "require_plan", "Preparer",
           "WHOLE_STEP_ABSORBED"]

#: the runs key of a backend handed a whole step without a dispatch policy (every request absorbed)
WHOLE_STEP_ABSORBED = "whole step absorbed"


class _RunFields(NamedTuple):
    absorbed: bool
    start: int
    stop: int


class Run(_RunFields):
    """Consecutive processing-order requests ``start:stop`` that take one path (``absorbed`` or expanded).

    A tuple (``absorbed, start, stop = run``), checked on construction (``_replace`` and ``_make`` included):
    ``absorbed`` a bool, ``0 <= start <= stop`` ints."""

    __slots__ = ()

    def __new__(cls, absorbed: bool, start: int, stop: int) -> Run:
        if not isinstance(absorbed, bool):
            raise TypeError(f"absorbed: got {absorbed!r}; supported True or False")
        require_int("start", start, minimum=0)
        require_int("stop", stop, minimum=start)
        return super().__new__(cls, absorbed, start, stop)

    @classmethod
    def _make(cls, iterable: Iterable[Any]) -> Run:
        return cls(*iterable)

    def _replace(self, **changes: Any) -> Run:
        return type(self)(**{**self._asdict(), **changes})


class RunBatch(NamedTuple):
    """One run of a step and the planned metadata of its requests (:meth:`StepPlan.runs_of`)."""

    run: Run
    batch: BatchMetadata


class StepPlanError(ValueError):
    """A plan that does not fit the call: made for other metadata, without this layer or backend, or missing."""


@runtime_checkable
class Preparer(Protocol):
    """What :func:`plan_step` needs of a backend: its per-step ``prepare``, the key states are shared by, and
    the declaration keys its configuration accepts on a batch (``MLABackend`` has all three)."""

    def prepare(self, meta: BatchMetadata) -> object | None: ...

    def prepare_key(self) -> Hashable: ...

    def planned_declarations(self, meta: BatchMetadata, *, sparse: bool = False) -> frozenset[Hashable]: ...


@dataclass(frozen=True)
class PlanRequest:
    """What one layer will run this step, as it tells :func:`plan_step`.

    Attributes:
        runs_key: the key its runs are kept under (layers that dispatch alike share it).
        runs: the step's processing-order requests cut into runs.
        backend: the backend instance its absorbed runs go to (prepared for each of them).
        dcp: ``(rank, size)`` of its decode-context-parallel place, or None.
        sparse: its absorbed calls pass top-k indices (DeepSeek-V3.2).
        preparers: more per-step state this layer reads besides its backend's, prepared for the same absorbed
            batches and kept under their own ``prepare_key()`` (DeepSeek-V4's step tables:
            :class:`~mla_backends.step.v4.V4Planner`); only ``prepare`` and ``prepare_key`` are asked of them.
    """

    runs_key: Hashable
    runs: tuple[Run, ...]
    backend: Preparer
    dcp: tuple[int, int] | None = None
    sparse: bool = False
    preparers: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        try:
            hash(self.runs_key)
        except TypeError:
            raise TypeError(f"runs_key: got {type(self.runs_key).__name__}, which cannot be hashed; supported a "
                            "hashable key") from None
        if not isinstance(self.runs, tuple) or not all(isinstance(r, Run) for r in self.runs):
            raise TypeError(f"runs: got {self.runs!r}; supported a tuple of Run")
        prev = 0
        for i, r in enumerate(self.runs):
            if r.start != prev:
                raise ValueError(f"runs[{i}]: got {tuple(r)}, starting at request {r.start}; supported runs that "
                                 f"cut the step's requests in order (this one starts at {prev})")
            prev = r.stop
        if not isinstance(self.backend, Preparer) or isinstance(self.backend, type):
            raise TypeError(f"backend: got {type(self.backend).__name__}; supported a backend instance (prepare, "
                            "prepare_key, planned_declarations)")
        if self.dcp is not None:
            if not (isinstance(self.dcp, tuple) and len(self.dcp) == 2):
                raise TypeError(f"dcp: got {self.dcp!r}; supported None or (rank, size)")
            require_int("dcp size", self.dcp[1], minimum=1)
            require_int("dcp rank", self.dcp[0], minimum=0)
            if self.dcp[0] >= self.dcp[1]:
                raise ValueError(f"dcp: got rank {self.dcp[0]} of {self.dcp[1]}; supported 0 <= rank < size")
        if not isinstance(self.sparse, bool):
            raise TypeError(f"sparse: got {self.sparse!r}; supported True or False")


@dataclass(frozen=True, eq=False)
class StepPlan(SlotSource):
    """One step's plan (module docstring): made by :func:`plan_step`, read by every layer, never changed.

    Attributes:
        meta: the step's metadata.
        runs: dispatch key -> the step's runs under it.
        batches: ``(start, stop)`` -> the metadata of those processing-order requests (``(0, B)`` is ``meta``).
        local: ``(start, stop, dcp_rank, dcp_size)`` -> ``(local decode metadata or None, [n] int64 tokens)``.
        states: ``(backend.prepare_key(), id(batch))`` -> what ``backend.prepare(batch)`` returned.
        accepted: declaration keys (``mqa_inputs.declaration_key``) the planned backends accept.
        max_block_id: the largest block id any request of the step reads (``-1``: none), computed once
            (``meta.max_live_block_id()``); None when no cache check needs it (``build`` checked the ids
            against ``num_blocks``, or the engine vouched for them: ``block_ids_trusted``).
        members: ``id(participant)`` -> the runs key it reads, for every participant named (those asked and
            those alike to one asked); ``participants`` keeps them alive while the plan is.

    Checked on construction (and so on ``dataclasses.replace``): ``meta`` is the plan's own whole-step batch
    (``batches[(0, B)]``), every run tiles the step's requests, every batch holds the requests its key names,
    every DCP view and prepared state belongs to one of the plan's batches. Anything else is a
    :class:`StepPlanError`.
    """

    meta: BatchMetadata
    runs: Mapping[Hashable, tuple[Run, ...]] = field(repr=False)
    batches: Mapping[tuple[int, int], BatchMetadata] = field(repr=False)
    local: Mapping[tuple[int, int, int, int], tuple[Any, Any]] = field(repr=False)
    states: Mapping[tuple[Hashable, int], object] = field(repr=False)
    accepted: frozenset[Hashable] = field(default=frozenset(), repr=False)
    max_block_id: int | None = None
    members: Mapping[int, Hashable] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    participants: tuple[object, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        meta = self.meta
        if not isinstance(meta, BatchMetadata):
            raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
        B = meta.num_requests
        if self.batches.get((0, B)) is not meta:
            raise StepPlanError(
                "plan.meta: got metadata this plan was not made for (it is not the plan's whole-step batch); "
                "supported the metadata the plan was made for: a plan is bound to its step, so plan the other "
                "metadata with plan_step(meta, participants) instead of carrying this plan to it")
        ids = set()
        for (b0, b1), sub in self.batches.items():
            if not (0 <= b0 <= b1 <= B) or not isinstance(sub, BatchMetadata) or (
                    sub.query_lens_list != meta.query_lens_list[b0:b1]
                    or sub.context_lens_list != meta.context_lens_list[b0:b1]):
                raise StepPlanError(f"plan.batches: got a batch for requests {b0}:{b1} that is not those requests of "
                                    "plan.meta; supported the sub-batches plan_step made")
            ids.add(id(sub))
        for key, runs in self.runs.items():
            if not runs or runs[0].start != 0 or runs[-1].stop != B or any(
                    a.stop != b.start for a, b in zip(runs, runs[1:], strict=False)):
                raise StepPlanError(f"plan.runs: got runs {[tuple(r) for r in runs]} under {key!r}, which do not cut "
                                    f"the plan's {B} requests in order; supported the runs plan_step recorded")
        for (b0, b1, *_), (local, _tokens) in self.local.items():
            if (b0, b1) not in self.batches:
                raise StepPlanError(f"plan.local: got a DCP view of requests {b0}:{b1}, not a batch of this plan")
            if local is not None:
                ids.add(id(local))
        for _pkey, bid in self.states:
            if bid not in ids:
                raise StepPlanError("plan.states: got a prepared state of a batch that is not this plan's; "
                                    "supported the states plan_step prepared for its batches")
        for key in self.members.values():
            if key not in self.runs:
                raise StepPlanError(f"plan.members: got runs key {key!r}, which the plan does not hold")
        # what every cache check compares with, worked out once: (page size, the fewest blocks a cache needs;
        # None: no host bound known, the metadata's own check runs)
        if meta.block_ids_trusted or not B:
            need: int | None = 0
        elif meta.verified_block_table is meta.block_table and meta.num_blocks is not None:
            need = meta.num_blocks
        else:
            need = None if self.max_block_id is None else self.max_block_id + 1
        object.__setattr__(self, "_cache_bound", (meta.block_size, need))

    # ---- what the layers read ----------------------------------------------------------------------------
    def runs_for(self, key: Hashable, who: str = "this layer") -> tuple[Run, ...]:
        """The runs planned under dispatch ``key``; :class:`StepPlanError` when no participant asked for it."""
        try:
            return self.runs[key]
        except (KeyError, TypeError):
            raise StepPlanError(
                f"plan: got a plan made without {who} (no runs for its dispatch); supported the step's plan "
                "from plan_step(meta, layers) naming every layer of the step") from None

    def member_runs(self, participant: object, who: str = "this layer") -> tuple[Run, ...]:
        """The runs of ``participant`` (a layer or backend named to :func:`plan_step`, or one alike to a
        participant: its ``runs_key()`` is then looked up); :class:`StepPlanError` when it took no part."""
        key = self.members.get(id(participant), _MISSING)
        if key is not _MISSING:
            return self.runs[key]
        runs_key = getattr(participant, "runs_key", None)
        if callable(runs_key) and not isinstance(participant, type):
            return self.runs_for(runs_key(), who)
        raise StepPlanError(f"plan: got a plan made without {who}; supported the step's plan from "
                            "plan_step(meta, participants) naming it")

    def runs_of(self, participant: object) -> tuple[RunBatch, ...]:
        """What ``participant`` runs this step, as ``(run, batch)`` pairs in processing order: each :class:`Run`
        holding tokens with its planned sub-batch metadata. The one place an engine reads its split: an
        absorbed run goes to ``backend.forward_mqa(q[t0:t1], ..., batch, plan=plan)``, an expanded one to
        ``forward_mha(..., batch)``, rows ``t0:t1`` being the batch's tokens
        (``plan.meta.query_starts_list[run.start]`` to ``[run.stop]``).

        Raises:
            StepPlanError: ``participant`` took no part in this plan.
        """
        starts = self.meta.query_starts_list
        name = getattr(participant, "name", type(participant).__name__)
        return tuple(RunBatch(run, self.batches[(run.start, run.stop)])
                     for run in self.member_runs(participant, str(name))
                     if starts[run.start] < starts[run.stop])

    def absorbed_batches(self, participant: object) -> tuple[BatchMetadata, ...]:
        """The sub-batches ``participant`` runs absorbed (``forward_mqa``), in processing order."""
        return tuple(rb.batch for rb in self.runs_of(participant) if rb.run.absorbed)

    def batch(self, start: int, stop: int) -> BatchMetadata:
        """The planned metadata of processing requests ``start:stop``."""
        try:
            return self.batches[(start, stop)]
        except KeyError:
            raise StepPlanError(f"plan: got no batch for requests {start}:{stop}; supported the runs this plan "
                                "was made with (plan_step(meta, layers) naming every layer)") from None

    def local_decode(self, start: int, stop: int, dcp_rank: int, dcp_size: int) -> tuple[Any, Any]:
        """``(local metadata or None, tokens)`` of run ``start:stop`` on DCP rank ``dcp_rank`` of ``dcp_size``."""
        try:
            return self.local[(start, stop, dcp_rank, dcp_size)]
        except KeyError:
            raise StepPlanError(f"plan: got no DCP-local metadata for requests {start}:{stop} on rank {dcp_rank} "
                                f"of {dcp_size}; supported a plan made with this layer") from None

    def state(self, backend: Preparer, meta: BatchMetadata) -> object | None:
        """``backend``'s prepared state for ``meta`` (one of this plan's batches).

        Raises:
            StepPlanError: ``meta`` is not a batch of this plan (the plan was made for other metadata), or
                ``backend`` (its ``prepare_key()``) was not planned for it.
        """
        key = (backend.prepare_key(), id(meta))
        if key in self.states:
            return self.states[key]
        mine = any(b is meta for b in self.batches.values()) or any(
            loc is meta for loc, _ in self.local.values())
        name = getattr(backend, "name", type(backend).__name__)
        if not mine:
            raise StepPlanError(
                "plan: got a plan made for other metadata (the metadata given is not one of its batches); "
                "supported the plan of this step's metadata (plan_step(meta, ...) for the same meta, once per "
                "step, before the first layer)")
        raise StepPlanError(
            f"plan: got a plan made without backend {name} (configured as {backend.prepare_key()!r}) for this "
            "batch; supported a plan from plan_step(meta, participants) naming the layer or backend that runs it")

    def is_planned(self, backend: Preparer, meta: BatchMetadata) -> bool:
        """Whether this plan holds ``backend``'s prepared state for ``meta``."""
        return (backend.prepare_key(), id(meta)) in self.states

    def check_cache(self, cache: PagedRows) -> None:
        """Raise ValueError unless ``cache`` has the step's page size and holds every block id of the step:
        two integer comparisons with bounds worked out when the plan was made (:attr:`max_block_id`, or the
        block count ``build`` checked the ids against); no device read."""
        if not self.cache_fits(cache):
            self.meta.check_cache(cache, max_block_id=self.max_block_id)  # raises, naming what disagrees

    def cache_fits(self, cache: PagedRows) -> bool:
        """Whether :meth:`check_cache` passes by the bounds worked out when the plan was made (False also when
        no host bound is known: :meth:`check_cache` then asks the metadata)."""
        block_size, need = self._cache_bound
        return need is not None and cache.block_size == block_size and cache.num_blocks >= need

    def slots_for(self, cache: PagedRows) -> torch.Tensor:
        """The step's new-token slots ``[T]`` for ``cache.write``, after :meth:`check_cache` (host only)."""
        self.check_cache(cache)
        return self.meta.slot_mapping

    def is_for(self, meta: BatchMetadata) -> bool:
        """Whether this plan was made for ``meta`` (the step's metadata or one of its batches)."""
        return meta is self.meta or any(b is meta for b in self.batches.values()) or any(
            loc is meta for loc, _ in self.local.values())


_MISSING = object()


def _participant(p: object, meta: BatchMetadata, dispatch: object) -> PlanRequest:
    request = getattr(p, "plan_request", None)
    if callable(request) and not isinstance(p, type):
        got = request(meta) if dispatch is None else request(meta, dispatch=dispatch)
        if not isinstance(got, PlanRequest):
            raise TypeError(f"participants: {type(p).__name__}.plan_request returned {type(got).__name__}; "
                            "supported PlanRequest")
        return got
    raise TypeError(f"participants: got {type(p).__name__}; supported MLAAttention layers (plan_request) or "
                    "MLABackend instances (prepare, prepare_key)")


def _plan_key(p: object) -> Hashable | None:
    """``p.plan_key()`` when ``p`` has one (participants with equal keys make equal requests), else None."""
    method = getattr(p, "plan_key", None)
    if not callable(method) or isinstance(p, type):
        return None
    key = method()
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"participants: {type(p).__name__}.plan_key returned {type(key).__name__}, which cannot "
                        "be hashed; supported a hashable key (or no plan_key method)") from None
    return key


def plan_step(meta: BatchMetadata, participants: Iterable[object], *, dispatch: object = None) -> StepPlan:
    """Plan one step for every layer (or backend) that will run it; see the module docstring.

    Args:
        meta: the step's :class:`~mla_backends.step.metadata.BatchMetadata`.
        participants: the step's ``MLAAttention`` layers (each layer's dispatch and backend; layers alike are
            planned once), or ``MLABackend`` instances an engine calls itself (``forward_mqa``): anything with
            ``plan_request(meta)`` (and optionally ``plan_key()``: of participants with equal keys only the
            first is asked).
        dispatch: for backend participants: the dispatch policy that splits the step between their
            ``forward_mqa`` and ``forward_mha`` (a ``DispatchPolicy``, or ``"per-request"`` / ``"per-batch"``),
            the same runs a layer with that policy gets; read them with :meth:`StepPlan.runs_of`. None: the
            whole step absorbed. Layers dispatch by their own policy and refuse it.

    Returns:
        The frozen :class:`StepPlan`. Every backend's ``prepare`` ran here, once per ``prepare_key()`` and batch.

    Raises:
        TypeError: ``meta`` is not metadata, or a participant is neither a layer nor a backend.
        ValueError: a backend or layer refuses the metadata (DCP metadata given to a bare backend, ...).
        PluginCodeError: a backend's ``prepare`` / ``prepare_key`` called ``sys.exit()`` or raised another
            ``BaseException`` that is not an ``Exception`` (Ctrl-C excepted); its exceptions pass as they are,
            with a note naming the backend.
    """
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata (BatchMetadata.build)")
    if isinstance(participants, (str, bytes)) or not isinstance(participants, Iterable):
        raise TypeError(f"participants: got {type(participants).__name__}; supported an iterable of layers or "
                        "backends")
    requests: list[PlanRequest] = []
    asked: dict[Hashable, PlanRequest] = {}
    members: dict[int, Hashable] = {}
    named: list[object] = []
    B = meta.num_requests
    for p in participants:
        key = _plan_key(p)
        req = asked.get(key) if key is not None else None
        if req is None:  # (a participant alike to one already asked makes the same request)
            req = _participant(p, meta, dispatch)
            if req.runs and req.runs[-1].stop != B:
                raise ValueError(f"participants: {type(p).__name__}.plan_request returned runs ending at request "
                                 f"{req.runs[-1].stop}; supported runs covering the step's {B} requests")
            requests.append(req)
            if key is not None:
                asked[key] = req
        if req.runs_key is not None:
            members[id(p)] = req.runs_key
        named.append(p)
    starts = meta.query_starts_list
    runs: dict[Hashable, tuple[Run, ...]] = {}
    batches: dict[tuple[int, int], BatchMetadata] = {(0, B): meta}
    local: dict[tuple[int, int, int, int], tuple[Any, Any]] = {}
    states: dict[tuple[Hashable, int], object] = {}
    accepted: set[Hashable] = set()

    def batch(b0: int, b1: int) -> BatchMetadata:
        if (b0, b1) not in batches:
            batches[(b0, b1)] = meta.select_requests(b0, b1)
        return batches[(b0, b1)]

    for req in requests:
        if req.runs_key is not None:
            runs.setdefault(req.runs_key, req.runs)
        for absorbed, b0, b1 in req.runs:
            sub = batch(b0, b1)
            if not absorbed or starts[b0] == starts[b1]:
                continue
            target = sub
            if req.dcp is not None:
                rank, size = req.dcp
                key = (b0, b1, rank, size)
                if key not in local:
                    local[key] = sub.local_decode(rank, size)
                target = local[key][0]
                if target is None:
                    continue
            else:
                require_whole_sequences(target, "plan_step(meta, backends)")
            with plugin_call(req.backend, "prepare_key()"):
                skey = (req.backend.prepare_key(), id(target))
            if skey not in states:
                with plugin_call(req.backend, "prepare()"):  # sys.exit() there is PluginCodeError
                    states[skey] = req.backend.prepare(target)
                accepted |= req.backend.planned_declarations(target, sparse=req.sparse)
            for extra in req.preparers:  # more state of the same layer (DeepSeek-V4's step tables)
                xkey = (extra.prepare_key(), id(target))
                if xkey not in states:
                    states[xkey] = extra.prepare(target)
    max_id = meta.max_live_block_id()  # the one device read, for hand-made metadata only
    return StepPlan(meta=meta, runs=MappingProxyType(runs), batches=MappingProxyType(batches),
                    local=MappingProxyType(local), states=MappingProxyType(states), accepted=frozenset(accepted),
                    max_block_id=max_id, members=MappingProxyType(members), participants=tuple(named))


def require_plan(plan: object, entry: str) -> StepPlan:
    """``plan`` when it is a :class:`StepPlan`; a :class:`TypeError` naming ``entry`` otherwise (metadata given
    where the step's plan belongs, or nothing)."""
    if isinstance(plan, StepPlan):
        return plan
    got = type(plan).__name__
    raise TypeError(f"plan: got {got} for {entry}; supported the step's StepPlan (plan = plan_step(meta, layers), "
                    "once per step, before the first layer and outside any CUDA-graph capture)")
