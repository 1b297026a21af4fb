"""One vLLM decode step in mla-backends' terms: the step's :class:`~mla_backends.step.metadata.BatchMetadata`
(built once by the metadata builder, shared by every layer) and each layer's cache tensor wrapped as a
:class:`~mla_backends.step.cache.LatentKVCache` (no copy).

Host syncs: none on a GPU. The host lists the metadata carries (``context_lens_list``: they size REF_TORCH's
work) come from vLLM's host copy ``CommonAttentionMetadata.seq_lens_cpu_upper_bound``, which vLLM documents as
exact for decode rows except under *asynchronous speculative decoding* (optimistic there); the adapter
declares single-token decode, so vLLM does not send speculative rows to it. When a vLLM build gives no host
copy, the device lengths are read once per step (one sync), the one place without a host source. Block ids:
on the CPU the table is host memory and is checked against the cache as :meth:`BatchMetadata.build` would; on
a GPU the table is vLLM's own, made by its allocator for this very cache, and is trusted
(``BatchMetadata.block_ids_trusted``) instead of being read back. The step's plan (``plan_step``) is made in the
metadata builder too, once per step, for the backend every layer's impl runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...step.metadata import BatchMetadata
from ..engine_core import wrap_engine_cache as wrap_cache  # the core's wrapper, under its 0.4 name

__all__ = ["decode_batch_metadata", "host_seq_lens", "wrap_cache"]


def host_seq_lens(seq_lens: torch.Tensor, upper_bound: torch.Tensor | None) -> tuple[int, ...]:
    """Host copy of a step's decode lengths: ``upper_bound`` (vLLM's host tensor, first ``len(seq_lens)``
    rows) when given, else ``seq_lens`` itself (free on the CPU, one sync on a GPU)."""
    n = seq_lens.shape[0]
    src = upper_bound[:n] if upper_bound is not None else seq_lens
    return tuple(int(v) for v in src.tolist())


def decode_batch_metadata(block_table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: Sequence[int],
                          block_size: int, *, slot_mapping: torch.Tensor | None = None) -> BatchMetadata:
    """The :class:`BatchMetadata` of ``B`` single-token decode requests, in vLLM's order (no reordering):
    :meth:`BatchMetadata.for_decode`, the public constructor for an engine's own decode tables (a GPU table,
    made by vLLM's allocator for this very cache, is trusted rather than read back).

    Args:
        block_table: ``[B, max_blocks]`` int page ids (vLLM's decode ``block_table``), on the cache's device.
        seq_lens: ``[B]`` int lengths including this step's token, same device.
        seq_lens_host: the same lengths as host ints (:func:`host_seq_lens`); nothing on the device is read.
        block_size: tokens per page of the layer caches.
        slot_mapping: ``[B]`` slots of the new tokens (vLLM writes them itself; default all ``-1``).
    """
    return BatchMetadata.for_decode(block_table, seq_lens, seq_lens_host, block_size, slot_mapping=slot_mapping)
