"""Persistent metadata for CUDA-graph decode: :class:`DecodeGraphMetadata`.

A captured graph replays kernels on fixed addresses with fixed shapes. To capture a decode step once and
replay it for every later step, an engine keeps static:

- **the batch size**: the step's ``n`` decode requests are padded to the captured ``max_batch`` with dummy
  requests of query length 1 whose slot is ``-1`` (their row goes to the cache's sink row; they read page 0,
  position 0, and their outputs are ignored), so ``hidden_states`` keeps its shape ``[max_batch, hidden]``;
- **the block-table width** ``max_blocks`` (shorter tables are padded with page 0, never read past a
  request's length);
- **the metadata tensors**, updated in place for each replay by :meth:`DecodeGraphMetadata.update`, which
  validates the real step with :meth:`BatchMetadata.build` on the host first (block ids within the cache,
  no two tokens on one slot) and only then copies it into the persistent tensors.

:attr:`DecodeGraphMetadata.meta` is the :class:`~mla_backends.step.metadata.BatchMetadata` the captured layers
see; its tensors never move. Its host lists describe the padded batch at its longest (every request at
``max_context``), which is what host-side choices (such as a split count) see during capture (pin
``TritonMLABackend``'s ``num_kv_splits`` so the grid does not depend on it). Only backends declaring
``cuda_graphs`` read lengths and block ids from the device tensors, so only they replay correctly; :attr:`meta`
is marked ``graph_static`` and every other consumer refuses it (:mod:`mla_backends.step.checks`).

Per step, outside any capture: ``graph_meta.update(context_lens, block_table)``, then
``plan = plan_step(graph_meta.meta, layers)`` (the step's plan: every backend's ``prepare`` runs there, after
the tensors hold the new step), then ``graph.replay()``. Capture itself runs the layers with a plan made the
same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.validation import require_device, require_int
from .metadata import BatchMetadata

__all__ = ["DecodeGraphMetadata"]


class DecodeGraphMetadata:
    """Decode metadata with persistent tensors for ``max_batch`` requests of one new token each.

    Args:
        max_batch: requests the graph is captured for (real steps may have fewer; the rest are dummies).
        max_blocks: block-table width (pages a request may hold).
        block_size: tokens per page.
        num_blocks: pages of the caches the graph runs on (every update is checked against it).
        device: where the tensors live.
        max_context: longest cached context a request may have (default ``max_blocks * block_size - 1``);
            the host lists of :attr:`meta` report it for every request.
    """

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, num_blocks: int, *,
                 device: str | torch.device = "cpu", max_context: int | None = None) -> None:
        dev = require_device("device", device)
        self.max_batch = require_int("max_batch", max_batch, minimum=1)
        self.max_blocks = require_int("max_blocks", max_blocks, minimum=1)
        self.block_size = require_int("block_size", block_size, minimum=1)
        self.num_blocks = require_int("num_blocks", num_blocks, minimum=1)
        limit = max_blocks * block_size - 1
        self.max_context = limit if max_context is None else require_int("max_context", max_context, minimum=0)
        if self.max_context > limit:
            raise ValueError(f"max_context: got {max_context}; supported <= {limit} ({max_blocks} pages of "
                             f"{block_size}, one token left for the new one)")
        B = max_batch
        ar = torch.arange(B, dtype=torch.int64, device=dev)
        table = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
        self.meta = BatchMetadata(
            block_size=block_size,
            order=ar.clone(),
            token_order=ar.clone(),
            query_lens=torch.ones(B, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(B, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(B, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
            block_table=table,
            slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=dev),
            token_request=ar.clone(),
            token_positions=torch.zeros(B, dtype=torch.int64, device=dev),
            query_lens_list=(1,) * B,
            context_lens_list=(self.max_context,) * B,
            num_blocks=num_blocks,
            graph_static=True,  # host lists are bounds: backends without cuda_graphs refuse it (meta_checks)
            verified_block_table=table,  # every update() validates the step with build() first
        )
        self.num_requests = 0

    def update(self, context_lens: Sequence[int] | torch.Tensor,
               block_table: torch.Tensor | Sequence[Sequence[int]]) -> BatchMetadata:
        """Validate a decode step of ``n <= max_batch`` requests and write it into :attr:`meta` in place.

        Args:
            context_lens: ``[n]`` tokens already cached per request (each gets one new token).
            block_table: ``[n, <= max_blocks]`` page ids.

        Returns:
            The step's own (unpadded) metadata from :meth:`BatchMetadata.build`; its rows are the first ``n``
            of :attr:`meta`, in the caller's order. Raises ValueError (nothing copied) when the step is bad.
        """
        n = len(context_lens)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"context_lens: got {n} requests; supported 1..{self.max_batch} (the captured batch)")
        real = BatchMetadata.build([1] * n, context_lens, block_table, self.block_size,
                                   num_blocks=self.num_blocks, device=self.meta.device)
        width = real.block_table.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block_table: got {width} columns; supported <= {self.max_blocks} (the captured "
                             "block-table width)")
        if max(real.context_lens_list) > self.max_context:
            raise ValueError(f"context_lens: got {max(real.context_lens_list)}; supported <= {self.max_context}")
        m = self.meta
        m.context_lens.zero_()
        m.context_lens[:n].copy_(real.context_lens)
        m.seq_lens.fill_(1)
        m.seq_lens[:n].copy_(real.seq_lens)
        m.block_table.zero_()
        m.block_table[:n, :width].copy_(real.block_table.clamp_min(0))  # unused entries may be -1: page 0
        m.slot_mapping.fill_(-1)  # dummies write to the sink row
        m.slot_mapping[:n].copy_(real.slot_mapping)
        m.token_positions.zero_()
        m.token_positions[:n].copy_(real.token_positions)
        self.num_requests = n
        return real
