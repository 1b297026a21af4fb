"""The property decode context parallelism (DCP) needs from a backend, checked in one process.

Under DCP the ranks of a group hold interleaved shares of every sequence (position ``p`` on rank ``p % D``),
each rank runs ``forward_mqa`` over its own rows only, and the partial results are merged by their LSEs
(:func:`~mla_backends.core.attention_math.lse_merge_weights`). That is right only if the backend's output and LSE
over any subset of a sequence's rows are exact for that subset. :func:`check_context_split` splits a
decode case's cache the way DCP does over ``ranks`` virtual ranks (copying the stored rows bit for bit into one
cache per rank, with a block table of its own), runs the backend on each share, merges, and compares with the
float64 reference over the whole sequence. A rank that holds no row of a request (a sequence shorter than the
group: length 1 with two ranks) contributes LSE ``-inf`` and output 0, as :mod:`mla_backends.layer.dcp` does; the
suite's guard cases include such a request.
"""

from __future__ import annotations

import torch

from ..backends.contract import MLABackend
from ..core.attention_math import lse_merge_weights
from ..step.cache import LatentKVCache, position_slots
from ..step.metadata import BatchMetadata, dcp_local_len
from .cases import Case
from .checks import assert_judged, make_backend, standard_for
from .inputs import Prepared, prepare

__all__ = ["check_context_split", "context_split_skip_reason", "rank_share"]


def context_split_skip_reason(cls: type[MLABackend], case: Case) -> str | None:
    """Why ``case`` cannot take the DCP split (DCP's absorbed path is single-token, dense, with an LSE)."""
    if not cls.capabilities.returns_lse:
        return f"{cls.name} returns no LSE (decode context parallelism needs it)"
    if case.topk is not None:
        return "sparse attention is out of scope for decode context parallelism"
    if any(q != 1 for q in case.query_lens):
        return "decode context parallelism runs single-token queries on the absorbed path"
    return None


def rank_share(p: Prepared, rank: int, ranks: int) -> tuple[LatentKVCache, BatchMetadata, list[int]] | None:
    """Rank ``rank``'s share of ``p``'s step under DCP over ``ranks``: a cache holding exactly its rows
    (local index ``position // ranks``, copied bit for bit), local metadata (one query token per request it
    holds rows of; context ``local rows - 1``), and the processing-order token of each of those requests.
    None when the rank holds no row at all."""
    meta, src = p.meta, p.cache
    P = meta.block_size
    held = [dcp_local_len(s, rank, ranks) for s in meta.seq_lens_list]
    requests = [i for i, h in enumerate(held) if h]
    if not requests:
        return None
    pages = [-(-held[i] // P) for i in requests]
    cache = LatentKVCache(sum(pages), P, src.kv_lora_rank, src.qk_rope_head_dim, kv_cache_dtype=src.kv_cache_dtype,
                          model_dtype=src.model_dtype, device=src.device, scale=src.scale_value)
    table = torch.full((len(requests), max(pages)), -1, dtype=torch.int32)
    first = 0
    for j, n in enumerate(pages):
        table[j, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    dev = src.device
    req = torch.cat([torch.full((held[i],), i, dtype=torch.long) for i in requests]).to(dev)
    local = torch.cat([torch.arange(held[i]) for i in requests]).to(dev)
    req_local = torch.cat([torch.full((held[i],), j, dtype=torch.long) for j, i in enumerate(requests)]).to(dev)
    src_slots = position_slots(meta.block_table, req, local * ranks + rank, P)
    dst_slots = position_slots(table.to(dev), req_local, local, P)
    width = src.row_width
    cache.data.view(-1, width)[dst_slots] = src.data.view(-1, width)[src_slots]
    local_meta = BatchMetadata.build([1] * len(requests), [held[i] - 1 for i in requests], table.to(dev), P,
                                     num_blocks=cache.num_blocks, reorder=False, device=dev, read_only=True)
    return cache, local_meta, [meta.query_starts_list[i] for i in requests]


def check_context_split(cls: type[MLABackend], case: Case, device: torch.device, ranks: int = 2) -> None:
    """Outputs and LSEs over the ``ranks`` interleaved shares of every sequence, merged by LSE, match the
    float64 reference over whole sequences (a share without rows counts as LSE ``-inf``, output 0)."""
    p = prepare(case, device)
    backend = make_backend(cls, device)
    T, H, R = p.q_latent.shape
    outs = torch.zeros(ranks, T, H, R, dtype=torch.float64)
    lses = torch.full((ranks, T, H), float("-inf"), dtype=torch.float64)
    for rank in range(ranks):
        share = rank_share(p, rank, ranks)
        if share is None:
            continue
        cache, meta, tokens = share
        idx = torch.tensor(tokens, dtype=torch.long, device=device)
        o, lse = backend.forward_mqa(p.q_latent[idx], p.q_rope[idx], cache, meta, scale=p.scale)
        assert lse is not None  # returns_lse (context_split_skip_reason)
        outs[rank, tokens] = o.detach().cpu().to(torch.float64)
        lses[rank, tokens] = lse.detach().cpu().to(torch.float64)
    weights, merged_lse = lse_merge_weights(lses)
    merged = (weights.unsqueeze(-1) * outs).sum(dim=0)
    standard = standard_for(cls, p)
    where = f"{cls.name} {case.id}, context split over {ranks} ranks, on {device}"
    assert_judged("output merged over context shares", merged, standard, where, p.meta, hint=lambda got: "")
    assert_judged("LSE merged over context shares", merged_lse, standard, where, p.meta, lse=True)
