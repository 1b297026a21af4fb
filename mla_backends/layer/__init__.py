"""The MLA layer a host engine puts in each DeepSeek layer (``attention``: ``MLAAttention``) and what it owns:
its weights (``weights``), projections (``projections``), the decode/prefill dispatch (``dispatch``, with the
measured ``thresholds`` table), decode context parallelism (``dcp``), the shared expanded prefill
(``prefill``: ``forward_mha``; ``prefill_kernels``), the one prefill workspace per device (``workspace``),
DeepSeek-V3.2's sparse indexer (``sparse``) and every layer of a checkpoint folder (``pretrained``).

Imports: everything below (``core``, ``step``, ``backends``, ``plugins``, ``loading``) and ``selector``.
"""

from typing import Any

__all__ = ["MLAAttention"]


def __getattr__(name: str) -> Any:  # the layer class, as ``from mla_backends.layer import MLAAttention`` reads
    if name in ("MLAAttention", "DEFAULT_MAX_NUM_SEQS"):
        from . import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'mla_backends.layer' has no attribute {name!r}")
