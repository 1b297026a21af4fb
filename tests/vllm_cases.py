"""Shared pieces of the vLLM adapter tests: a small paged decode case and its float64 reference, written
plainly (one request at a time, softmax over the visible rows)."""

from __future__ import annotations

import torch

R, ROPE, BS = 8, 4, 4  # latent width, rope width, page size (tiny: the adapter takes any dims REF_TORCH does)


def decode_case(seq_lens: list[int], heads: int = 3, num_blocks: int = 9, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cache [num_blocks, BS, R + ROPE], block_table [B, max_pages] int32, q_latent [B, H, R], q_rope [B, H,
    ROPE])`` with every request's pages spread over the cache in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, BS, R + ROPE, generator=g).to(dtype)
    pages = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    q_latent = torch.randn(len(seq_lens), heads, R, generator=g).to(dtype)
    q_rope = torch.randn(len(seq_lens), heads, ROPE, generator=g).to(dtype)
    return cache, table, q_latent, q_rope


def reference(cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int], q_latent: torch.Tensor,
              q_rope: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(out [B, H, R], lse [B, H])``: each request's single token sees all its ``seq_lens[b]`` rows."""
    outs, lses = [], []
    for b, s in enumerate(seq_lens):
        rows = torch.stack([cache[int(table[b, p // BS]), p % BS] for p in range(s)]).double()  # [s, R + ROPE]
        q = torch.cat([q_latent[b], q_rope[b]], dim=-1).double()  # [H, R + ROPE]
        scores = q @ rows.T * scale  # [H, s]
        outs.append(torch.softmax(scores, dim=-1) @ rows[:, :R])
        lses.append(torch.logsumexp(scores, dim=-1))
    return torch.stack(outs), torch.stack(lses)
