"""The attention math shared by the reference backend, the expanded prefill path and the sparse indexer.

A bottom module (it imports only torch): the softmax that also returns its log-sum-exp, the merge of two
partial results by their LSE, and the cut of a batch into padded groups that fit an element budget.
All LSEs are natural logs; an empty part (nothing visible) has LSE ``-inf`` and weight 0, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GROUP_ELEMENT_BUDGET", "softmax_with_lse", "lse_merge_weights", "merge_attention_states",
           "padded_groups", "distinct_topk"]

#: most elements of one padded group's working set (gathered rows + scores): 64 Mi elements, 256 MiB in
#: float32. REF_TORCH's dense groups, its sparse token steps and the V3.2 indexer's selection groups use it.
GROUP_ELEMENT_BUDGET = 1 << 26


def softmax_with_lse(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [..., n, S]`` (masked with -inf) and ``values [..., S, V]`` -> ``(out [..., n, V], lse [..., n])``.

    Rows with nothing visible get LSE ``-inf`` and output 0.
    """
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe.unsqueeze(-1))
    return torch.matmul(p, values), lse


def lse_merge_weights(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights that merge ``K`` partial results over disjoint key sets, from their stacked LSEs.

    ``lse [K, ...]`` (natural log) -> ``(weights [K, ...], merged_lse [...])``: the merged output is
    ``sum_k weights[k] * o_k``. A part with LSE ``-inf`` (no keys) gets weight 0; when every part is empty all
    weights are 0 and the merged LSE is ``-inf`` (never NaN). Used for two parts by
    :func:`merge_attention_states` and for the ``D`` ranks of a decode-context-parallel group.
    """
    m = lse.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    total = w.sum(dim=0)
    denom = torch.where(total > 0, total, torch.ones_like(total))
    return w / denom, m + torch.log(total)


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets.

    ``o_* [n, H, V]``, ``lse_* [n, H]`` (natural log). A part with LSE ``-inf`` (no keys) gets weight 0; when
    both are empty the output is 0 and the LSE ``-inf`` (never NaN). The weights are
    :func:`lse_merge_weights`'.
    """
    w, lse = lse_merge_weights(torch.stack([lse_a, lse_b]))
    return o_a * w[0].unsqueeze(-1) + o_b * w[1].unsqueeze(-1), lse


def padded_groups(seq_lens: Sequence[int], query_lens: Sequence[int], per_pos: int, per_row: int,
                  budget: int) -> list[tuple[int, int]]:
    """Cut requests into consecutive groups ``(start, stop)`` whose padded working set, ``requests x longest
    sequence x (per_pos + longest query x per_row)`` elements, fits ``budget``; a request over the budget on
    its own still forms a group. No groups for no requests."""
    groups: list[tuple[int, int]] = []
    start = max_s = max_q = 0
    for i, (s, qn) in enumerate(zip(seq_lens, query_lens, strict=True)):
        ns, nq = max(max_s, s), max(max_q, qn)
        if i > start and (i - start + 1) * ns * (per_pos + nq * per_row) > budget:
            groups.append((start, i))
            start, ns, nq = i, s, qn
        max_s, max_q = ns, nq
    if start < len(seq_lens):
        groups.append((start, len(seq_lens)))
    return groups


def distinct_topk(topk_indices: torch.Tensor) -> torch.Tensor:
    """``topk_indices [T, K]`` with every repeated position of a row replaced by ``-1`` (padding), so that a
    position selected twice is attended once. ``forward_mqa`` counts every entry (a repeat once per repeat, as
    FlashMLA's sparse kernels do); a caller who builds its own lists and wants each position once passes them
    through this first. On the device, without a host sync: the row is sorted and an entry equal to its left
    neighbour is dropped (the order of a row's positions does not matter to attention).
    """
    if topk_indices.shape[-1] < 2:
        return topk_indices
    ordered, _ = torch.sort(topk_indices, dim=-1)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    return ordered.masked_fill(repeat, -1)
