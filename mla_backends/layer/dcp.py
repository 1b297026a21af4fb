"""Decode context parallelism (DCP): the latent cache of a tensor-parallel group split across its ranks.

Under tensor parallelism alone every rank holds the whole latent cache. With DCP of size ``D`` (dividing
``tp_size`` ``T``) the ``D`` consecutive TP ranks ``g*D .. g*D + D - 1`` form a DCP group and split every
sequence between them, interleaved: the token at global position ``p`` lives on DCP rank ``p % D`` at local
index ``p // D`` (:func:`mla_backends.step.metadata.dcp_local_len` counts a rank's rows). Each rank still holds only
its own ``H = heads / T`` heads of the projections.

The collectives (all over the DCP group, the engine's ``torch.distributed`` ``ProcessGroup``):

- **absorbed path** (query length 1): the absorbed queries ``[n, H, R + P]`` are all-gathered into
  ``[n, D * H, R + P]`` (the group's heads, in DCP-rank order); each rank runs ``forward_mqa`` over its local
  rows for all of them; the LSEs ``[n, D * H]`` are all-gathered, each rank weighs its partial output by
  :func:`~mla_backends.core.attention_math.lse_merge_weights`, and a reduce-scatter over the head axis sums the
  weighted partials and hands every rank its own heads' merged ``[n, H, R]``. A rank holding no row of a
  request contributes LSE ``-inf`` and output 0.
- **expanded path** (prefill): every context chunk's latent rows are all-gathered (:func:`context_rows`) and
  up-projected with the rank's own heads; the new tokens attend each other causally as without DCP.

Every decision that shapes a collective (the runs, the requests, the chunks) is made from the global lengths
in :class:`~mla_backends.step.metadata.BatchMetadata`, identical on every rank of the group, so all ranks issue the
same collectives in the same order.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..backends.contract import Capabilities, MLABackend, QueryLenSupport
from ..backends.reasons import Reason, ReasonKind
from ..core.attention_math import lse_merge_weights
from ..core.dtypes import accumulate_dtype
from ..core.validation import require_int
from ..step.cache import LatentKVCache, position_slots
from ..step.metadata import BatchMetadata
from ..step.plan import StepPlan
from .prefill import ContextRows

__all__ = ["DCPGroup", "dcp_group_for", "dispatch_capabilities", "check_dcp_metadata", "absorbed_attention",
           "context_rows", "local_decode_metadata", "LSE_REASON"]

#: why a backend that returns no LSE cannot run under DCP
LSE_REASON = Reason(ReasonKind.LSE, "LSE", text="decode context parallelism needs the softmax LSE")


@dataclass(frozen=True)
class DCPGroup:
    """This rank's place in its DCP group: ``size`` ranks, this one ``rank``, ``group`` the ProcessGroup."""

    size: int
    rank: int
    group: Any


def dcp_group_for(tp_rank: int, tp_size: int, dcp_size: int, dcp_group: Any, *,
                  sparse: bool = False) -> DCPGroup | None:
    """Check the layer's DCP arguments; None when ``dcp_size`` is 1 (no DCP, today's behaviour).

    Raises ValueError naming the argument: ``dcp_size`` not dividing ``tp_size``, a sparse (V3.2) layer, no
    group, a group whose size is not ``dcp_size``, or a process whose rank in the group is not
    ``tp_rank % dcp_size``; TypeError naming ``dcp_group`` when it is not a ``ProcessGroup``.
    """
    import torch.distributed as dist

    require_int("dcp_size", dcp_size, minimum=1)
    if tp_size % dcp_size:
        raise ValueError(f"dcp_size: got {dcp_size}; supported a divisor of tp_size {tp_size}")
    if dcp_group is not None and dist.is_available() and not isinstance(dcp_group, dist.ProcessGroup):
        raise TypeError(f"dcp_group: got {type(dcp_group).__name__}; supported a torch.distributed "
                        "ProcessGroup (or None without decode context parallelism)")
    if dcp_size == 1:
        return None
    if sparse:
        raise ValueError(f"dcp_size: got {dcp_size} for a DeepSeek-V3.2 sparse layer; supported 1 (sparse "
                         "attention under decode context parallelism is not implemented)")
    want = f"the ProcessGroup of TP ranks g*{dcp_size} .. g*{dcp_size} + {dcp_size - 1} (g = tp_rank // {dcp_size})"
    if dcp_group is None:
        raise ValueError(f"dcp_group: got None with dcp_size {dcp_size}; supported {want}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"dcp_group: got a group but torch.distributed is not initialised; supported {want} "
                         "after init_process_group")
    size = dist.get_world_size(dcp_group)
    if size != dcp_size:
        raise ValueError(f"dcp_group: got a group of {size} ranks; supported dcp_size {dcp_size} ranks ({want})")
    rank = dist.get_rank(dcp_group)
    if rank != tp_rank % dcp_size:
        raise ValueError(f"dcp_group: this process is rank {rank} of the group; supported tp_rank % dcp_size = "
                         f"{tp_rank % dcp_size} (tp_rank {tp_rank})")
    return DCPGroup(dcp_size, rank, dcp_group)


def dispatch_capabilities(capabilities: Capabilities, dcp: DCPGroup | None) -> Capabilities:
    """The declarations dispatch works with: under DCP the absorbed path takes query length 1 only (a longer
    query's causal limit is not "the last rows" in local index space), so longer queries run expanded."""
    if dcp is None:
        return capabilities
    return replace(capabilities, query_len=QueryLenSupport.SINGLE,
                   decode_threshold=min(1, capabilities.decode_threshold))


def check_dcp_metadata(dcp: DCPGroup | None, meta: BatchMetadata) -> None:
    """``meta`` must be built for this rank's DCP place (``dcp_rank``, ``dcp_size``)."""
    size, rank = (1, 0) if dcp is None else (dcp.size, dcp.rank)
    if (meta.dcp_size, meta.dcp_rank) != (size, rank):
        raise ValueError(f"meta: got dcp_rank {meta.dcp_rank} of dcp_size {meta.dcp_size}; supported dcp_rank "
                         f"{rank} of dcp_size {size} (this layer's; BatchMetadata.build(..., dcp_rank=tp_rank % "
                         "dcp_size, dcp_size=dcp_size))")


def _all_gather(x: torch.Tensor, dcp: DCPGroup) -> torch.Tensor:
    """``x [...]`` of every rank of the group -> ``[D, ...]`` in DCP-rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dcp.size)]
    dist.all_gather(parts, x.contiguous(), group=dcp.group)
    return torch.stack(parts)


def _reduce_scatter(x: torch.Tensor, dcp: DCPGroup) -> torch.Tensor:
    """``x [D, ...]`` summed over the group; this rank gets slice ``x[rank]``'s sum ``[...]``."""
    import torch.distributed as dist

    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    with warnings.catch_warnings():  # torch 2.13 renames it (reduce_scatter_single); older ones lack that name
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out.view(-1), x.contiguous().view(-1), group=dcp.group)
    return out


def local_decode_metadata(meta: BatchMetadata, dcp: DCPGroup) -> BatchMetadata | None:
    """This rank's local decode metadata for ``meta``'s absorbed requests (what it runs ``forward_mqa`` on;
    None when it holds no row of any): :meth:`BatchMetadata.local_decode`, which the step plan keeps."""
    return meta.local_decode(dcp.rank, dcp.size)[0]


def absorbed_attention(dcp: DCPGroup, backend: MLABackend, q_latent: torch.Tensor, q_rope: torch.Tensor,
                       cache: LatentKVCache, meta: BatchMetadata, *, scale: float, plan: StepPlan,
                       run: tuple[int, int]) -> torch.Tensor:
    """The absorbed kernel under DCP: ``q_latent [n, H, R]``, ``q_rope [n, H, P]`` of this rank's heads (query
    length 1 per request, processing order of ``meta``) -> this rank's heads' merged output ``[n, H, R]``.

    All-gather of the queries, ``backend.forward_mqa`` over the local rows for the group's ``D * H`` heads,
    all-gather of the LSEs, LSE weighting and a reduce-scatter back to the heads' owners (module docstring).
    ``meta`` is the plan's batch of requests ``run`` (``(start, stop)``); the rank's local metadata for it
    comes from ``plan`` (:meth:`~mla_backends.step.plan.StepPlan.local_decode`).
    """
    n, H, R = q_latent.shape
    D = dcp.size
    q_all = _all_gather(torch.cat([q_latent, q_rope], dim=-1), dcp)  # [D, n, H, R + P]
    q_all = q_all.permute(1, 0, 2, 3).reshape(n, D * H, -1)  # the group's heads in DCP-rank order
    local, tokens = plan.local_decode(run[0], run[1], dcp.rank, dcp.size)
    o = torch.zeros(n, D * H, R, dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.full((n, D * H), float("-inf"), dtype=accumulate_dtype(q_latent.dtype), device=q_latent.device)
    if local is not None:
        q_mine = q_all[tokens]
        o_l, lse_l = backend.forward_mqa(q_mine[..., :R].contiguous(), q_mine[..., R:].contiguous(), cache, local,
                                         scale=scale, plan=plan)
        o[tokens] = o_l.to(o.dtype)
        lse[tokens] = lse_l.to(lse.dtype)
    weights, _ = lse_merge_weights(_all_gather(lse, dcp))  # [D, n, D * H]
    part = o * weights[dcp.rank].unsqueeze(-1).to(o.dtype)  # [n, D * H, R]
    return _reduce_scatter(part.view(n, D, H, R).transpose(0, 1), dcp)  # [n, H, R]


def context_rows(dcp: DCPGroup, cache: LatentKVCache, meta: BatchMetadata) -> ContextRows:
    """The ``forward_mha`` chunk reader under DCP: each rank reads its rows of the chunk's positions (local
    index ``p // D`` through its own block table), the group all-gathers them (padded to the largest share)
    and every rank reassembles ``[rows, R + P]`` in the chunk's position order."""
    D, r = dcp.size, dcp.rank
    bt = meta.block_table.long()

    def read(chunk: list[tuple[int, int, int]], dtype: torch.dtype) -> torch.Tensor:
        dev = cache.device
        # which chunk rows each rank holds, and this rank's (request, local index) of its own: arithmetic on the
        # chunk's host bounds (ranges with step D), so nothing reads the device or has a data-dependent shape
        where: list[list[torch.Tensor]] = [[] for _ in range(D)]
        mine_req: list[torch.Tensor] = []
        mine_local: list[torch.Tensor] = []
        off = 0
        for b, a, z in chunk:
            for j in range(D):
                first = a + (j - a) % D  # the chunk's first position rank j holds
                if first < z:
                    where[j].append(torch.arange(off + first - a, off + z - a, D))
                    if j == r:
                        n = len(range(first, z, D))
                        mine_req.append(torch.full((n,), b, dtype=torch.long))
                        mine_local.append(torch.arange(first // D, first // D + n))
            off += z - a
        counts = [sum(t.numel() for t in w) for w in where]
        share = torch.zeros(max(counts), cache.row_width, dtype=dtype, device=dev)
        if counts[r]:
            slots = position_slots(bt, torch.cat(mine_req).to(dev), torch.cat(mine_local).to(dev), cache.block_size)
            share[: counts[r]] = cache.read_slots(slots, dtype)
        gathered = _all_gather(share, dcp)  # [D, max share, R + P]
        rows = torch.empty(off, cache.row_width, dtype=dtype, device=dev)
        for j in range(D):
            if counts[j]:
                rows.index_copy_(0, torch.cat(where[j]).to(dev), gathered[j, : counts[j]])
        return rows

    return read
