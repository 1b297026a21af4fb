"""Hardening (issue 28): metadata an entry would misread is refused by name, and the tests sampled mutation
testing showed missing.

- item 4: ``DecodeGraphMetadata``'s persistent metadata (host lists = the captured bounds) on a backend that
  does not declare ``cuda_graphs``, or on an entry that reads host lengths;
- item 5: DCP metadata (a rank-local block table under global lengths) outside the layer;
- item 6: ``dcp_local_len`` outside its domain;
- the mutants: the graph capacity limit off by one, the dummy slot ``-1`` replaced by ``0``, the step-plan reset
  dropped from ``update()``, the chunk bound dropped from the shared-workspace key, a reason equality that
  ignores the kind, a step-plan reset that leaves DCP state behind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.backends.naive import expanded_decode
from mla_backends.backends.reasons import Reason, ReasonKind
from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dcp import DCPGroup, local_decode_metadata
from mla_backends.layer.dispatch import PerRequestPolicy
from mla_backends.layer.prefill import forward_mha
from mla_backends.layer.sparse import IndexerKeyCache
from mla_backends.layer.sparse.indexer import causal_topk
from mla_backends.layer.workspace import clear_shared_workspaces, shared_workspace, shared_workspaces, workspace_key
from mla_backends.loading.hf import random_hf_state_dict
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.graph import DecodeGraphMetadata
from mla_backends.step.metadata import BatchMetadata, dcp_local_len
from mla_backends.step.plan import PlanRequest, Run, StepPlanError, plan_step

pytestmark = pytest.mark.usefixtures("one_thread")

R, P, H, BS, NB, WIDTH, MAX_BATCH = 32, 16, 4, 16, 12, 4, 4
DIMS = MLADims(num_heads=H, kv_lora_rank=R, qk_nope_head_dim=16, qk_rope_head_dim=P, v_head_dim=16,
               q_lora_rank=24, hidden_size=48, num_layers=1, max_position_embeddings=512)
TABLE = [[3, 4, 5, 6], [7, 8, 9, 10]]  # page 0 is never a real request's page


def _cache(seed: int = 0) -> LatentKVCache:
    cache = LatentKVCache(NB, BS, R, P, model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def _queries(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, R, generator=g), torch.randn(n, H, P, generator=g)


def _graph_meta(ctx=(20, 33)) -> DecodeGraphMetadata:
    gm = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NB)
    gm.update(list(ctx), TABLE)
    return gm


# ---- item 4: graph metadata only where its device tensors are read -------------------------------------
def test_graph_metadata_on_a_backend_without_cuda_graphs_is_refused_naming_backend_and_flag():
    assert not RefTorchBackend.capabilities.cuda_graphs
    gm, cache = _graph_meta(), _cache()
    ql, qr = _queries(MAX_BATCH)
    for meta in (gm.meta, gm.meta.select_requests(0, 2)):  # sub-batches keep the mark
        with pytest.raises(ValueError, match=r"^meta: .*DecodeGraphMetadata.*backend REF_TORCH, which declares "
                                             r"cuda_graphs=False"):
            RefTorchBackend().forward_mqa(ql[: meta.num_tokens], qr[: meta.num_tokens], cache, meta, scale=0.1)
    real = gm.update([20, 33], TABLE)  # the step's own metadata runs, and is not marked
    assert not real.graph_static and gm.meta.graph_static
    RefTorchBackend().forward_mqa(ql[:2], qr[:2], cache, real, scale=0.1)


def test_graph_metadata_on_a_layer_is_refused_before_the_cache_is_written():
    gm = _graph_meta()
    x = torch.randn(MAX_BATCH, DIMS.hidden_size)
    ref = MLAAttention(DIMS, backend="REF_TORCH", dtype=torch.float32, device="cpu")
    mha = MLAAttention(DIMS, backend="TRITON_MLA", dtype=torch.float32, device="cpu",  # cuda_graphs, but a
                       dispatch=PerRequestPolicy(threshold=0))  # policy that sends every decode to forward_mha
    assert mha.backend_cls.capabilities.cuda_graphs
    for layer, match in ((ref, "backend REF_TORCH, which declares cuda_graphs=False"),
                         (mha, "for forward_mha \\(the dispatch policy")):
        layer.load_hf_state_dict(random_hf_state_dict(DIMS, dtype=torch.float32, seed=0, std=0.1))
        cache = layer.allocate_cache(NB, BS)
        cache.rows_with_sink().copy_(torch.randn(cache.rows_with_sink().shape))
        before = cache.rows_with_sink().clone()
        with pytest.raises(ValueError, match=match):
            layer(x, None, cache, plan_step(gm.meta, [layer]))
        assert torch.equal(cache.rows_with_sink(), before), "a refused step wrote the cache"


def test_graph_metadata_is_refused_by_the_entries_that_read_host_lengths():
    gm, cache = _graph_meta(), _cache()
    n = MAX_BATCH
    ql, qr = _queries(n)
    kv_b = torch.randn(H * 32, R)
    q = torch.randn(n, H, 32)
    with pytest.raises(ValueError, match="^meta: .*DecodeGraphMetadata.* for forward_mha"):
        forward_mha(q, ql[:, 0], qr[:, 0], cache, gm.meta, kv_b, scale=0.1)
    with pytest.raises(ValueError, match="^meta: .*DecodeGraphMetadata.* for expanded_decode"):
        expanded_decode(torch.randn(n, H, 16), qr, torch.randn(H, 16, R), torch.randn(H, R, 16), cache, gm.meta,
                        0.1)
    keys = IndexerKeyCache(NB, BS, 128)
    with pytest.raises(ValueError, match="^meta: .*DecodeGraphMetadata.* for causal_topk"):
        causal_topk(torch.randn(n, 2, 128), torch.randn(n, 2), keys, gm.meta, 4)


# ---- item 5: DCP metadata outside the layer -------------------------------------------------------------
def _dcp_meta(rank: int) -> BatchMetadata:
    # global lengths 21 and 34 over dcp_size 2: rank 0 holds 11 and 17 rows, rank 1 holds 10 and 17
    return BatchMetadata.build([1, 1], [20, 33], TABLE, BS, num_blocks=NB, dcp_rank=rank, dcp_size=2)


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_metadata_given_straight_to_forward_mqa_is_refused(rank):
    meta, cache = _dcp_meta(rank), _cache()
    ql, qr = _queries(2)
    with pytest.raises(ValueError, match=f"^meta: got metadata of DCP rank {rank} of dcp_size 2 for forward_mqa; "
                                         "supported dcp_size 1"):
        RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=0.1)
    with pytest.raises(ValueError, match=r"for plan_step\(meta, backends\)"):
        plan_step(meta, [RefTorchBackend()])
    with pytest.raises(ValueError, match="of dcp_size 2 for expanded_decode"):
        expanded_decode(torch.randn(2, H, 16), qr, torch.randn(H, 16, R), torch.randn(H, R, 16), cache, meta, 0.1)
    with pytest.raises(ValueError, match="of dcp_size 2 for causal_topk"):
        causal_topk(torch.randn(2, 2, 128), torch.randn(2, 2), IndexerKeyCache(NB, BS, 128), meta, 4)
    local = local_decode_metadata(meta, DCPGroup(2, rank, None))  # what the layer hands forward_mqa
    assert local is not None and local.dcp_size == 1
    assert local.seq_lens_list == tuple(dcp_local_len(s, rank, 2) for s in meta.seq_lens_list)
    RefTorchBackend().forward_mqa(ql, qr, cache, local, scale=0.1)


# ---- item 6: dcp_local_len -------------------------------------------------------------------------------
def test_dcp_local_len_counts_a_ranks_positions_and_refuses_what_is_outside_its_domain():
    for length in range(12):
        for size in range(1, 5):
            for rank in range(size):
                assert dcp_local_len(length, rank, size) == len(range(rank, length, size)), (length, rank, size)
    for args, name in (((5, 2, 2), "dcp_rank"), ((5, 7, 2), "dcp_rank"), ((5, -1, 2), "dcp_rank"),
                       ((5, 0, 0), "dcp_size"), ((5, 0, -2), "dcp_size"), ((-1, 0, 1), "length")):
        with pytest.raises(ValueError, match=f"^{name}: got "):
            dcp_local_len(*args)
    for args, name in (((5, True, 2), "dcp_rank"), ((5.0, 0, 1), "length"), ((5, 0, "2"), "dcp_size")):
        with pytest.raises(TypeError, match=f"^{name}: got "):
            dcp_local_len(*args)


# ---- mutants ----------------------------------------------------------------------------------------------
def test_graph_capacity_is_exactly_the_table_less_one_token():
    limit = WIDTH * BS - 1  # the new token needs a row too
    gm = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NB)
    assert gm.max_context == limit and gm.meta.context_lens_list == (limit,) * MAX_BATCH
    assert DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NB, max_context=limit).max_context == limit
    with pytest.raises(ValueError, match=f"max_context: got {limit + 1}; supported <= {limit}"):
        DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NB, max_context=limit + 1)
    gm.update([limit, 0], TABLE)  # the longest context fits
    small = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NB, max_context=40)
    small.update([40, 3], TABLE)
    with pytest.raises(ValueError, match="context_lens: got 41; supported <= 40"):
        small.update([41, 3], TABLE)
    assert small.meta.context_lens[:2].tolist() == [40, 3]  # the refused step copied nothing


def test_padding_requests_write_the_sink_never_page_0():
    gm, cache = _graph_meta(), _cache(seed=3)
    page0 = cache.data[0].clone()
    assert page0.abs().sum() > 0  # page 0 holds data (dummies read it: the padded block table points there)
    assert gm.meta.block_table[2:].eq(0).all() and gm.meta.slot_mapping[2:].eq(-1).all()
    kv, pe = torch.randn(MAX_BATCH, R), torch.randn(MAX_BATCH, P)
    cache.write(kv, pe, gm.meta)
    assert torch.equal(cache.data[0], page0), "a padding request wrote into page 0"
    for t, ctx in enumerate((20, 33)):  # the real tokens' rows, at position ctx of their pages
        assert torch.equal(cache.data[TABLE[t][ctx // BS], ctx % BS], torch.cat([kv[t], pe[t]]))
    assert torch.equal(cache.rows_with_sink()[-1], torch.cat([kv[-1], pe[-1]]))  # the last dummy's row


class _Recording(RefTorchBackend):
    """REF_TORCH whose per-step state is the context lengths it was prepared with."""

    def prepare(self, meta: BatchMetadata) -> object:
        return tuple(meta.context_lens.tolist())


def test_each_graph_update_is_planned_afresh():
    gm, backend = _graph_meta((20, 33)), _Recording()
    first = plan_step(gm.meta, [backend])
    assert first.state(backend, gm.meta)[:2] == (20, 33)
    gm.meta.check_cache(_cache())  # the persistent table was verified by update(): a host comparison
    gm.update([21, 34, 5], [*TABLE, [1, 2]])
    assert first.state(backend, gm.meta)[:2] == (20, 33)  # a made plan never changes
    assert plan_step(gm.meta, [backend]).state(backend, gm.meta)[:3] == (21, 34, 5)  # the new step's plan


class _DcpParticipant:
    """What a DCP layer of rank ``rank`` of 2 tells plan_step: every request absorbed, on REF_TORCH."""

    def __init__(self, rank: int) -> None:
        self.rank, self.backend = rank, RefTorchBackend()

    def plan_request(self, meta: BatchMetadata) -> PlanRequest:
        return PlanRequest(runs_key="dcp", runs=(Run(True, 0, meta.num_requests),), backend=self.backend,
                           dcp=(self.rank, 2))


def test_a_step_plan_is_frozen_and_keeps_dcp_local_metadata():
    meta = _dcp_meta(1)
    plan = plan_step(meta, [_DcpParticipant(1)])
    local, tokens = plan.local_decode(0, 2, 1, 2)
    assert local is not None and local.dcp_size == 1 and tokens.tolist() == [0, 1]
    assert plan.local_decode(0, 2, 1, 2)[0] is local  # read back, never rebuilt
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.max_block_id = 0  # type: ignore[misc]
    for mapping in (plan.runs, plan.batches, plan.local, plan.states):
        with pytest.raises(TypeError):
            mapping["k"] = None  # type: ignore[index]
    with pytest.raises(StepPlanError, match="no DCP-local metadata"):
        plan.local_decode(0, 2, 0, 2)


def test_shared_workspaces_with_different_chunk_bounds_are_different_workspaces():
    clear_shared_workspaces()
    try:
        assert workspace_key(torch.device("cpu"), torch.float32, 64) != workspace_key(torch.device("cpu"),
                                                                                      torch.float32, 128)
        small = shared_workspace("cpu", torch.float32, 64)
        big = shared_workspace("cpu", torch.float32, 128)
        assert small is not big and (small.rows, big.rows) == (64, 128)
        assert shared_workspace("cpu", torch.float32, 64) is small and len(shared_workspaces()) == 2
    finally:
        clear_shared_workspaces()


def test_reasons_of_different_kinds_are_different_reasons():
    dtype = Reason(ReasonKind.DTYPE, "dtype", "float16", "bfloat16")
    other = Reason(ReasonKind.OTHER, "dtype", "float16", "bfloat16")
    assert str(dtype) == str(other) and dtype == str(other)  # a reason still equals its text
    assert dtype != other and other not in [dtype]
    assert dtype == Reason(ReasonKind.DTYPE, "dtype", "float16", "bfloat16")
