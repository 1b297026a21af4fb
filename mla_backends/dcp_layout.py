"""Where decode context parallelism puts a sequence's rows: :func:`dcp_local_len`.

With a DCP group of ``D`` ranks the token at global position ``p`` lives on rank ``p % D`` at local index
``p // D`` (:mod:`mla_backends.dcp`). This module imports only :mod:`mla_backends.validation` (foundation
layer); :mod:`mla_backends.metadata` re-exports :func:`dcp_local_len`.
"""

from __future__ import annotations

from .validation import require_int

__all__ = ["dcp_local_len"]


def dcp_local_len(length: int, dcp_rank: int, dcp_size: int) -> int:
    """How many of positions ``0 .. length - 1`` DCP rank ``dcp_rank`` of ``dcp_size`` stores (``p % D``).

    Raises TypeError/ValueError naming the argument for a non-int, ``length < 0``, ``dcp_size < 1`` or a rank
    outside ``[0, dcp_size)``.
    """
    require_int("length", length, minimum=0)
    require_int("dcp_size", dcp_size, minimum=1)
    require_int("dcp_rank", dcp_rank, minimum=0)
    if dcp_rank >= dcp_size:
        raise ValueError(f"dcp_rank: got {dcp_rank}; supported 0..{dcp_size - 1} (dcp_size {dcp_size})")
    return (length - dcp_rank + dcp_size - 1) // dcp_size
