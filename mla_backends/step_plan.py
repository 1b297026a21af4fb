"""What one step works out once and every layer of the step reuses: the :class:`StepPlan`.

A :class:`~mla_backends.metadata.BatchMetadata` describes one step (one forward over all layers). Each layer
runs the same checks and the same preparation on it, so their results are kept here, typed, next to the
metadata (``meta.step_plan``):

- ``runs``: the absorbed/expanded runs of requests (:class:`Run`), per dispatch key
  (:func:`mla_backends.dispatch.step_runs` fills it);
- ``block_ids_checked``: the cache sizes (``num_blocks``) the block ids were verified against;
- ``sub_batches``: the metadata of request ranges ``(start, stop)`` (``meta.select_requests``);
- ``accepted``: the declaration keys a backend accepted (``mqa_inputs.check_declared_support``);
- ``dcp``: decode context parallelism's per-step state (:mod:`mla_backends.dcp`: the local metadata of the
  absorbed requests);
- ``prepared``: each backend's per-step state, from :meth:`MLABackend.prepare
  <mla_backends.backend.MLABackend.prepare>`.

The plan is built with the metadata and is never copied: ``dataclasses.replace(meta, ...)`` makes new metadata
with an empty plan, so nothing checked or prepared for one step leaks into another. A step's metadata (and so
its plan) must not be edited in place once the first layer ran.

**The engine's call.** ``layer.prepare(meta)`` (``MLAAttention.prepare``) prepares exactly the batches the
layers hand to ``forward_mqa``; underneath, ``meta.prepare(backend)`` (equivalently
``meta.step_plan.prepare(backend, meta)``) runs the backend's ``prepare`` hook for that metadata, once, and
returns its state; a second call returns the same object. An engine calls it once per step before the first
layer, outside any CUDA-graph capture (for a captured
decode step: after ``DecodeGraphMetadata.update``, before ``graph.replay()``); a backend that was not prepared
is prepared on its first ``forward_mqa`` of the step. States are kept per ``backend.prepare_key()``: the class,
plus the layer's configuration (``backend.configure(spec, scale)``, which ``MLAAttention`` calls), so every
layer configured alike shares one state, and a 61-layer model prepares once per step, not 61 times.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .meta_checks import require_whole_sequences

if TYPE_CHECKING:
    from .backend import MLABackend
    from .metadata import BatchMetadata

__all__ = ["Run", "StepPlan"]


class Run(NamedTuple):
    """Consecutive processing-order requests ``start:stop`` that take one path (``absorbed`` or expanded)."""

    absorbed: bool
    start: int
    stop: int


@dataclass(eq=False)
class StepPlan:
    """Per-step state shared by every layer of one step (see the module docstring).

    Attributes:
        runs: dispatch key -> the step's runs under that policy/backend (:func:`mla_backends.dispatch.step_runs`).
        block_ids_checked: ``num_blocks`` of every cache the step's block ids were checked against.
        sub_batches: ``(start, stop)`` -> the sub-batch metadata of those processing-order requests.
        accepted: keys of the ``(backend, dtype, heads, cache ...)`` combinations whose declarations accepted
            this step's inputs.
        prepared: ``backend.prepare_key()`` (its class, plus its configuration when configured) -> what its
            ``prepare(meta)`` returned for this step (None included).
        dcp: :mod:`mla_backends.dcp`'s per-step state, by key.
    """

    runs: dict[Hashable, tuple[Run, ...]] = field(default_factory=dict)
    block_ids_checked: set[int] = field(default_factory=set)
    sub_batches: dict[tuple[int, int], BatchMetadata] = field(default_factory=dict)
    accepted: set[Hashable] = field(default_factory=set)
    prepared: dict[object, object | None] = field(default_factory=dict)
    dcp: dict[Hashable, object] = field(default_factory=dict)

    def prepare(self, backend: MLABackend, meta: BatchMetadata) -> object | None:
        """``backend.prepare(meta)`` once per backend class and step; later calls return the same state.

        Args:
            backend: an :class:`~mla_backends.backend.MLABackend` instance.
            meta: the metadata this plan belongs to (``meta.step_plan is self``).
        """
        require_whole_sequences(meta, "meta.prepare(backend)")
        if meta.step_plan is not self:
            raise ValueError("meta: got metadata whose step_plan is another plan; supported the metadata this "
                             "plan belongs to (call meta.prepare(backend))")
        prepare = getattr(backend, "prepare", None)
        if not callable(prepare):
            raise TypeError(f"backend: got {type(backend).__name__}, which has no prepare(meta); supported an "
                            "MLABackend instance")
        key_of = getattr(backend, "prepare_key", None)
        key = key_of() if callable(key_of) else type(backend)
        if key not in self.prepared:
            self.prepared[key] = prepare(meta)
        return self.prepared[key]

    def reset(self) -> None:
        """Forget everything kept for the step (a persistent metadata whose tensors were rewritten in place
        for a new step, :class:`~mla_backends.decode_graph.DecodeGraphMetadata`, starts over)."""
        self.runs.clear()
        self.block_ids_checked.clear()
        self.sub_batches.clear()
        self.accepted.clear()
        self.prepared.clear()
        self.dcp.clear()

    def is_prepared(self, backend: MLABackend) -> bool:
        """Whether ``backend``'s class (and configuration, ``backend.prepare_key()``) already prepared this step."""
        key_of = getattr(backend, "prepare_key", None)
        return (key_of() if callable(key_of) else type(backend)) in self.prepared
