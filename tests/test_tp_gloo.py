"""Tensor parallelism on 2 CPU processes (gloo): each rank holds half the heads and returns its partial
``o_proj`` output; the all-reduced sum must equal the unsharded layer (float64, with ``o_proj`` bias)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from layer_cases import hf_attention, run_schedule, scattered_block_tables, tiny_config

from mla_backends.layer.attention import MLAAttention

STEPS = [[6, 9, 2], [1, 1, 1], [4, 1, 7]]


def _outputs(config: dict, state_dict: dict, tp_rank: int, tp_size: int) -> torch.Tensor:
    layer = MLAAttention.from_hf_config(config, dtype=torch.float64, tp_rank=tp_rank, tp_size=tp_size,
                                        workspace_rows=5)
    layer.load_hf_state_dict(state_dict)  # every rank reads the full checkpoint
    lengths = [sum(s[b] for s in STEPS) for b in range(3)]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, 32, generator=g, dtype=torch.float64) for n in lengths]
    bt, nb = scattered_block_tables(3, max(lengths), 4)
    cache = layer.allocate_cache(nb, 4)  # the latent cache is replicated: each rank has its own full copy
    outs = run_schedule(layer, cache, bt, xs, STEPS)
    return torch.cat([torch.cat(o) for o in outs])


def _worker(rank: int, world: int, rendezvous: str, result_dir: str) -> None:
    # no transformers here: the config dict and checkpoint come from the parent through files
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        config, state_dict = torch.load(os.path.join(result_dir, "model.pt"))
        partial = _outputs(config, state_dict, rank, world)
        torch.save(partial.clone(), os.path.join(result_dir, f"partial{rank}.pt"))
        dist.all_reduce(partial)
        torch.save(partial, os.path.join(result_dir, f"reduced{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch")
def test_two_rank_gloo_equals_unsharded(tmp_path):
    cfg = tiny_config(attention_bias=True)
    plain = (int, float, str, bool, dict, type(None))
    config = {k: v for k, v in cfg.to_dict().items() if isinstance(v, plain)}
    state_dict = hf_attention(cfg).state_dict()
    torch.save((config, state_dict), tmp_path / "model.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "rdv"), str(tmp_path)), nprocs=2, join=True)
    full = _outputs(config, state_dict, 0, 1)
    p0, p1 = (torch.load(tmp_path / f"partial{r}.pt") for r in (0, 1))
    assert not torch.allclose(p0, full, atol=1e-3)  # each rank alone is only part of the answer
    for r in (0, 1):
        reduced = torch.load(tmp_path / f"reduced{r}.pt")
        torch.testing.assert_close(reduced, full, rtol=1e-12, atol=1e-12)
