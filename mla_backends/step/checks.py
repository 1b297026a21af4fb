"""Which entry points may take a step's metadata: the refusals for metadata an entry would misread.

Two kinds of :class:`~mla_backends.step.metadata.BatchMetadata` describe a step only in part, and an entry point
that reads the wrong part would return a wrong answer with no error. Each entry refuses them by name:

- **DCP metadata** (``dcp_size > 1``): the lengths are global, the block table maps only this rank's rows
  (local index ``p // D``). An entry that reads a request's rows by walking its block table up to its length
  (``forward_mqa``, ``plan_step(meta, backends)``, :func:`~mla_backends.backends.naive.expanded_decode`, the sparse
  indexer) would read rows that are not there: :func:`require_whole_sequences`. The layer
  (``MLAAttention(dcp_size=...)``) takes it and hands ``forward_mqa`` the rank's local metadata
  (:func:`mla_backends.layer.dcp.local_decode_metadata`); ``forward_mha`` takes it with the group's reader.
- **graph metadata** (:class:`~mla_backends.step.graph.DecodeGraphMetadata`'s ``meta``, ``graph_static``):
  the tensors are rewritten in place for every replay and the host lists hold the captured bounds (every
  request at ``max_context``), not the step's lengths. Only backends declaring ``cuda_graphs`` read the
  device tensors: :func:`require_graph_support`. Entries that size their work from the host lists
  (``forward_mha``, ``expanded_decode``, the sparse indexer) refuse it: :func:`require_step_lengths`;
  :func:`check_graph_step` is the layer's check, before anything is written.

This module imports nothing from the package at run time (foundation layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metadata import BatchMetadata

__all__ = ["require_whole_sequences", "require_step_lengths", "require_graph_support", "check_graph_step"]

_GRAPH = "the persistent metadata of a DecodeGraphMetadata (graph_static: its host lists hold the captured bounds)"


def require_whole_sequences(meta: BatchMetadata, entry: str) -> None:
    """Refuse DCP metadata (``dcp_size > 1``) for ``entry``, which reads global lengths through the table."""
    if meta.dcp_size > 1:
        raise ValueError(
            f"meta: got metadata of DCP rank {meta.dcp_rank} of dcp_size {meta.dcp_size} for {entry}; supported "
            f"dcp_size 1 ({entry} reads each request's global length through the block table, which maps only "
            "this rank's rows: run the layer, MLAAttention(dcp_size=...), or give forward_mqa the rank's local "
            "metadata, mla_backends.layer.dcp.local_decode_metadata)")


def require_step_lengths(meta: BatchMetadata, entry: str) -> None:
    """Refuse graph metadata for ``entry``, which sizes its work from the host lengths."""
    if meta.graph_static:
        raise ValueError(f"meta: got {_GRAPH} for {entry}; supported metadata from BatchMetadata.build for the "
                         f"step ({entry} reads the host lengths, which there are not the step's)")


def require_graph_support(backend_cls: type, meta: BatchMetadata) -> None:
    """Refuse graph metadata for a backend that does not declare ``cuda_graphs`` (it reads the host lists)."""
    if meta.graph_static and not backend_cls.capabilities.cuda_graphs:  # type: ignore[attr-defined]
        name = getattr(backend_cls, "name", backend_cls.__name__)
        raise ValueError(
            f"meta: got {_GRAPH} for backend {name}, which declares cuda_graphs=False; supported a backend "
            "declaring cuda_graphs (it reads lengths and block ids from the device tensors), or metadata from "
            f"BatchMetadata.build for the step ({name} reads the host lengths, which there are not the step's)")


def check_graph_step(meta: BatchMetadata, backend_cls: type, runs: Callable[[], Sequence[tuple[bool, int, int]]], *,
                     indexer: bool) -> None:
    """The layer's check of graph metadata, before it writes anything: the backend declares ``cuda_graphs``,
    the sparse indexer does not run (``indexer``: it would) and no request of the step's ``runs()`` takes
    the expanded path."""
    if not meta.graph_static:
        return
    require_graph_support(backend_cls, meta)
    if indexer:
        require_step_lengths(meta, "the sparse indexer (pass topk_indices)")
    starts = meta.query_starts_list
    if any(not absorbed and starts[b0] < starts[b1] for absorbed, b0, b1 in runs()):
        require_step_lengths(meta, "forward_mha (the dispatch policy sends requests of this step there)")
