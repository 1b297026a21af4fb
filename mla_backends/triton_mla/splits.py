"""Host-side KV splits for ``TRITON_MLA`` (no triton import): the split heuristic and the per-call scratch.

Split heuristic (:func:`choose_num_kv_splits`). Stage 1 runs ``tokens * head_blocks * splits`` programs,
``head_blocks = ceil(heads / block_h)`` (:func:`block_h_for`: 16 or 32 heads a program). More splits fill
more SMs when the batch is small, but each split adds a partial ``[heads, kv_lora_rank]`` fp32 write and
read for the merge. The count is the smallest of

* ``next_pow2(max(1, max_len // 512))``: a split covers at least ~512 positions (by context length);
* ``next_pow2(ceil(4 * sm_count / (tokens * head_blocks)))``: enough programs for ~4 per SM, no more (once
  the batch fills the GPU, splitting only adds merge traffic and scratch);
* ``2 * sm_count`` and :data:`MAX_KV_SPLITS` (64).

Powers of two keep the number of distinct launch shapes small. Only host values are used (``meta``'s host
tuples, the tensor shapes and the SM count read once per device), so no call synchronises with the GPU.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "BLOCK_H",
    "BLOCK_H_WIDE",
    "block_h_for",
    "MAX_KV_SPLITS",
    "MIN_SPLIT_LEN",
    "CPU_NOMINAL_SM_COUNT",
    "next_pow2",
    "choose_num_kv_splits",
    "PROGRAMS_PER_SM",
    "rows_split_sizes",
    "sm_count",
    "SplitScratch",
    "SCRATCH",
]

#: heads handled by one stage-1 program for up to 16 heads; more heads use BLOCK_H_WIDE (see block_h_for)
BLOCK_H = 16
BLOCK_H_WIDE = 32
#: upper bound on the number of KV splits
MAX_KV_SPLITS = 64
#: positions a split should cover at least
MIN_SPLIT_LEN = 512
#: SM count assumed for CPU (interpreted) runs, where there are no SMs to fill
CPU_NOMINAL_SM_COUNT = 4


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_h_for(num_heads: int) -> int:
    """Heads per stage-1 program: 16 for up to 16 heads, else 32.

    Every head block of a token reads the same cache rows (once from HBM, then from L2), so wider blocks cut
    L2 traffic: at 128 heads, 4 blocks instead of 8. 32 is the widest that compiles without register spills
    at 8 warps (64 spills on SM80 and SM90).
    """
    return BLOCK_H if num_heads <= BLOCK_H else BLOCK_H_WIDE


def choose_num_kv_splits(max_len: int, num_tokens: int, num_heads: int, sm_count: int) -> int:
    """Number of KV splits for one call.

    Args:
        max_len: longest list of positions a token attends (``meta.max_seq_len`` dense, top-k width sparse).
        num_tokens: query tokens in the call (one stage-1 program row each).
        num_heads: query heads.
        sm_count: streaming multiprocessors of the device (:func:`sm_count`).
    """
    block_h = block_h_for(num_heads)
    by_len = next_pow2(max(1, max_len // MIN_SPLIT_LEN))
    programs = max(1, num_tokens) * math.ceil(max(1, num_heads) / block_h)
    by_occupancy = next_pow2(math.ceil(4 * max(1, sm_count) / programs))
    return max(1, min(by_len, by_occupancy, 2 * max(1, sm_count), MAX_KV_SPLITS))


#: ``rows`` kernel: programs per SM the step's work is spread over (:func:`rows_split_sizes`)
PROGRAMS_PER_SM = 2


def rows_split_sizes(
    seq_lens: tuple[int, ...] | list[int],
    query_lens: tuple[int, ...] | list[int],
    tokens_per_program: int,
    head_blocks: int,
    sm_count: int,
    min_split_len: int,
    tile_rows: int,
) -> tuple[int, int]:
    """``(max_splits, split_len)`` for one ``rows``-kernel call, from the step's host lengths.

    The work is the cache rows the programs read: each request's ``seq_len`` once per group of
    ``tokens_per_program`` query tokens and per head block. ``split_len`` (positions a split covers before a
    request gets another) is the larger of ``min_split_len`` and that work over ``PROGRAMS_PER_SM * SMs``
    programs, rounded up to whole tiles; ``max_splits`` is what the longest request then needs (at most
    :data:`MAX_KV_SPLITS`). So one long request among short ones is cut into pieces about as long as an
    average program's share, instead of into a fixed count sized from the longest length and the batch.
    """
    groups = [-(-q // tokens_per_program) for q in query_lens]
    work = head_blocks * sum(s * g for s, g in zip(seq_lens, groups, strict=True))
    share = -(-work // (PROGRAMS_PER_SM * max(1, sm_count)))
    split_len = max(min_split_len, share)
    split_len = -(-split_len // tile_rows) * tile_rows
    max_len = max(seq_lens, default=0)
    return max(1, min(-(-max_len // split_len), MAX_KV_SPLITS)), split_len


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (read once per device; a host query, no sync), or the nominal CPU count."""
    if device.type != "cuda":
        return CPU_NOMINAL_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


class SplitScratch:
    """Float32 scratch holding stage 1's partial outputs and LSEs, allocated **per call**.

    Each call takes ``tokens * heads * splits * (kv_lora_rank + 1)`` elements from torch's caching allocator
    (on a GPU: a block tied to the current stream, reused once the stream is done with it, so the cost is a
    pointer bump, not a ``cudaMalloc``). Nothing is shared between calls, so threads and streams calling on one
    device never see each other's partials, and a call captured in a CUDA graph takes its scratch from the
    graph's private pool (kept for every replay): nothing needs reserving before capture.
    """

    @staticmethod
    def elements(tokens: int, heads: int, splits: int, rank: int) -> int:
        """float32 elements for ``tokens x heads x splits`` partial rows of width ``rank`` plus their LSEs."""
        return tokens * heads * splits * (rank + 1)

    def get(
        self, device: torch.device, tokens: int, heads: int, splits: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh views ``(partial_out [tokens, heads, splits, rank], partial_lse [tokens, heads, splits])``."""
        buf = torch.empty(self.elements(tokens, heads, splits, rank), dtype=torch.float32, device=device)
        n_o = tokens * heads * splits * rank
        part_o = buf[:n_o].view(tokens, heads, splits, rank)
        part_lse = buf[n_o : n_o + tokens * heads * splits].view(tokens, heads, splits)
        return part_o, part_lse


#: the scratch provider used by :class:`~mla_backends.triton_mla.TritonMLABackend`
SCRATCH = SplitScratch()
