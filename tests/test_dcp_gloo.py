"""Decode context parallelism on spawned CPU processes (gloo, float64, tiny dims).

Each TP rank holds ``H / T`` heads; each DCP group of ``D`` consecutive ranks splits every sequence's cache
(token ``p`` on DCP rank ``p % D``, local index ``p // D``). After the TP all-reduce every rank's output must
equal the unsharded single-process layer over a schedule of prefills, decodes (including requests so short
that some ranks hold none of their rows), a mixed step and a prefill over cached context whose tiny workspace
splits requests across chunks; and each rank's cache must hold exactly its own rows.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from layer_cases import hf_attention, scattered_block_tables, tiny_config

from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dcp import LSE_REASON, dcp_group_for
from mla_backends.step.metadata import BatchMetadata, dcp_local_len
from mla_backends.step.plan import plan_step
from mla_backends.testing import no_host_sync

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch")

#: steps[s][b] = new tokens of request b: a prefill (request 3 waits), two decode steps (request 3's first
#: token: a query over one row, which ranks 1.. do not hold), a mixed step, a prefill over cached context
#: (workspace 5 rows: chunks split requests), decodes; lengths not multiples of D
STEPS = [[5, 11, 3, 0], [1, 1, 1, 1], [1, 1, 1, 1], [4, 1, 9, 1], [7, 0, 6, 2], [1, 1, 1, 1]]
LENGTHS = [sum(s[b] for s in STEPS) for b in range(4)]
#: tokens (schedule order) of requests with more than one new token: under DCP they run forward_mha
BLOCK = 4
WORKSPACE = 5
HEADS = 8


def _run(config: dict, state_dict: dict, tp_rank: int, tp_size: int, dcp_size: int, group: object
         ) -> tuple[torch.Tensor, int, list[list[str]]]:
    """The schedule's outputs ``[tokens, hidden]`` (caller order, step by step), the cache rows written and the
    host syncs of each step's layer call (``no_host_sync(count=True)``)."""
    layer = MLAAttention.from_hf_config(config, dtype=torch.float64, tp_rank=tp_rank, tp_size=tp_size,
                                        dcp_size=dcp_size, dcp_group=group, workspace_rows=WORKSPACE)
    layer.load_hf_state_dict(state_dict)
    dcp_rank = tp_rank % dcp_size
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, config["hidden_size"], generator=g, dtype=torch.float64) for n in LENGTHS]
    local_max = max(dcp_local_len(n, dcp_rank, dcp_size) for n in LENGTHS)
    bt, nb = scattered_block_tables(len(LENGTHS), local_max, BLOCK, seed=dcp_rank)  # this rank's pages
    cache = layer.allocate_cache(nb, BLOCK)
    done = [0] * len(LENGTHS)
    outs, syncs = [], []
    for qlens in STEPS:
        meta = BatchMetadata.build(qlens, list(done), bt, BLOCK, num_blocks=nb, decode_threshold=layer.decode_threshold,
                                   dcp_rank=dcp_rank, dcp_size=dcp_size)
        hidden = torch.cat([xs[b][done[b]: done[b] + q] for b, q in enumerate(qlens)])
        positions = torch.cat([torch.arange(done[b], done[b] + q) for b, q in enumerate(qlens)])
        with no_host_sync(count=True) as seen:
            outs.append(layer(hidden, positions, cache, plan_step(meta, [layer])))
        syncs.append(seen.ops)
        done = [d + q for d, q in zip(done, qlens, strict=True)]
    written = int((cache.data.view(-1, cache.row_width) != 0).any(dim=1).sum())
    return torch.cat(outs), written, syncs


def _errors(config: dict, state_dict: dict, rank: int, world: int, group: object, other: object) -> dict:
    """The messages of the bad-input cases a spawned rank can raise (TP = world, DCP = 2)."""
    msgs: dict[str, str] = {}

    def catch(key: str, fn) -> None:
        try:
            fn()
        except (ValueError, TypeError) as e:
            msgs[key] = str(e)

    build = MLAAttention.from_hf_config
    catch("no_group", lambda: build(config, dtype=torch.float64, tp_rank=rank, tp_size=world, dcp_size=2))
    catch("wrong_size", lambda: build(config, dtype=torch.float64, tp_rank=rank, tp_size=world, dcp_size=2,
                                      dcp_group=dist.group.WORLD if world != 2 else other))
    catch("wrong_rank", lambda: build(config, dtype=torch.float64, tp_rank=(rank + 1) % world, tp_size=world,
                                      dcp_size=2, dcp_group=group))
    catch("no_lse", lambda: build(config, dtype=torch.float64, tp_rank=rank, tp_size=world, dcp_size=2,
                                  dcp_group=group, backend="FLASHINFER_MLA_XQA"))
    layer = build(config, dtype=torch.float64, tp_rank=rank, tp_size=world, dcp_size=2, dcp_group=group)
    layer.load_hf_state_dict(state_dict)
    cache = layer.allocate_cache(4, BLOCK)
    meta = BatchMetadata.build([2], [0], [[0]], BLOCK, dcp_rank=(rank + 1) % 2, dcp_size=2)
    x = torch.zeros(2, config["hidden_size"], dtype=torch.float64)
    catch("meta_rank", lambda: layer(x, None, cache, plan_step(meta, [layer])))
    return msgs


def _worker(rank: int, world: int, dcp_size: int, rendezvous: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        config, state_dict = torch.load(os.path.join(result_dir, "model.pt"))
        groups = [dist.new_group(list(range(g * dcp_size, (g + 1) * dcp_size))) for g in range(world // dcp_size)]
        singles = [dist.new_group([r]) for r in range(world)]  # groups of the wrong size
        group = groups[rank // dcp_size]
        out, written, syncs = _run(config, state_dict, rank, world, dcp_size, group)
        dist.all_reduce(out)  # the TP all-reduce, as the engine does
        errors = _errors(config, state_dict, rank, world, group, singles[rank]) if dcp_size == 2 else {}
        torch.save((out, written, errors, syncs), os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = tiny_config(attention_bias=True, heads=HEADS)
    plain = (int, float, str, bool, dict, type(None))
    config = {k: v for k, v in cfg.to_dict().items() if isinstance(v, plain)}
    state_dict = hf_attention(cfg).state_dict()
    single, written, _ = _run(config, state_dict, 0, 1, 1, None)
    assert written == sum(LENGTHS)
    return config, state_dict, single


@pytest.mark.parametrize(("tp", "dcp"), [(2, 2), (4, 2), (4, 4)])
def test_dcp_equals_unsharded(model, tmp_path, tp, dcp):
    config, state_dict, single = model
    torch.save((config, state_dict), tmp_path / "model.pt")
    mp.spawn(_worker, args=(tp, dcp, str(tmp_path / "rdv"), str(tmp_path)), nprocs=tp, join=True)
    for rank in range(tp):
        out, written, errors, syncs = torch.load(tmp_path / f"rank{rank}.pt")
        # steps whose requests all run forward_mha (the prefills, the prefill over cached context, whose chunks
        # are read through the DCP context-row reader) make no host sync; decode steps build the rank's local
        # decode metadata once per step (documented, docs/layer.md)
        for step, qlens in enumerate(STEPS):
            if all(q != 1 for q in qlens):
                assert syncs[step] == [], (step, syncs[step])
        # every path merges float64 LSEs (float64 queries get a float64 LSE from forward_mqa): 1e-10 throughout
        torch.testing.assert_close(out, single, rtol=1e-10, atol=1e-10)
        assert written == sum(dcp_local_len(n, rank % dcp, dcp) for n in LENGTHS)
        if dcp == 2:
            assert "dcp_group: got None with dcp_size 2" in errors["no_group"]
            assert "dcp_group: got a group of" in errors["wrong_size"]
            assert "supported dcp_size 2" in errors["wrong_size"]
            assert "supported tp_rank % dcp_size" in errors["wrong_rank"]
            assert str(LSE_REASON) in errors["no_lse"]
            assert "meta: got dcp_rank" in errors["meta_rank"]


def test_bad_dcp_arguments_without_processes(model):
    config = model[0]
    with pytest.raises(ValueError, match="dcp_size: got 3; supported a divisor of tp_size 2"):
        MLAAttention.from_hf_config(config, dtype=torch.float64, tp_rank=0, tp_size=2, dcp_size=3)
    with pytest.raises(ValueError, match="dcp_group: got None with dcp_size 2"):
        MLAAttention.from_hf_config(config, dtype=torch.float64, tp_rank=0, tp_size=2, dcp_size=2)
    with pytest.raises(ValueError, match="sparse attention under decode context parallelism"):
        dcp_group_for(0, 2, 2, None, sparse=True)
    with pytest.raises(ValueError, match="dcp_rank: got 2; supported 0..1"):
        BatchMetadata.build([1], [0], [[0]], BLOCK, dcp_rank=2, dcp_size=2)
