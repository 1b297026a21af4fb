"""Metadata that is a view over rows already cached (``read_only``), a copy with another block table, and the
local decode metadata of a DCP rank when requests share prefix pages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.layer.dcp import DCPGroup, local_decode_metadata
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import StepPlanError, plan_step

BLOCK = 4


def test_read_only_views_skip_the_one_writer_check_and_write_nothing():
    # two requests whose last cached row sits in one shared page: as new tokens they would both "write" slot 3
    with pytest.raises(ValueError, match="both write slot 3"):
        BatchMetadata.build([1, 1], [3, 3], [[0], [0]], BLOCK)
    view = BatchMetadata.build([1, 1], [3, 3], [[0], [0]], BLOCK, read_only=True)
    assert view.slot_mapping.tolist() == [-1, -1]
    assert view.token_positions.tolist() == [3, 3]
    with pytest.raises(TypeError, match="read_only: got int"):
        BatchMetadata.build([1], [0], [[0]], BLOCK, read_only=1)


def test_dcp_local_decode_with_shared_prefix_pages():
    # 8 cached tokens in a shared prefix, then one new token each: DCP rank 1 of 2 holds positions 1, 3, 5, 7
    # (local 0..3, one page shared by both requests) and none of the new tokens (position 8 is rank 0's)
    meta = BatchMetadata.build([1, 1], [8, 8], [[0, 1], [0, 2]], BLOCK, dcp_rank=1, dcp_size=2)
    local = local_decode_metadata(meta, DCPGroup(size=2, rank=1, group=None))
    assert local is not None and local.seq_lens_list == (4, 4)
    assert local.slot_mapping.tolist() == [-1, -1]  # a read-only view: it writes nothing
    again = local_decode_metadata(meta, DCPGroup(size=2, rank=1, group=None))  # a pure function of the metadata
    assert again is not local and again.seq_lens_list == local.seq_lens_list
    assert torch.equal(again.block_table, local.block_table)


def test_a_copy_with_another_table_is_checked_again():
    meta = BatchMetadata.build([1], [0], [[0]], BLOCK, num_blocks=4)
    cache = LatentKVCache(4, BLOCK, 8, 4, kv_cache_dtype="float32", model_dtype=torch.float32)
    meta.check_cache(cache)
    swapped = dataclasses.replace(meta, block_table=torch.tensor([[100]], dtype=torch.int32))
    with pytest.raises(ValueError, match="got block id 100"):
        swapped.check_cache(cache)
    sub = meta.select_requests(0, 1)
    assert sub.verified_block_table is sub.block_table  # sub-batches keep build's verdicts


def test_hand_made_dcp_metadata_reads_its_local_table():
    meta = BatchMetadata.build([1, 1], [8, 8], [[0, 1], [0, 2]], BLOCK, dcp_rank=1, dcp_size=2)
    cache = LatentKVCache(3, BLOCK, 8, 4, kv_cache_dtype="float32", model_dtype=torch.float32)
    unverified = dataclasses.replace(meta, verified_block_table=None, max_block_ids=None)
    unverified.check_cache(cache)  # local pages: 4 rows -> 1 page per request on rank 1; ids 0 and 0 fit
    small = LatentKVCache(1, BLOCK, 8, 4, kv_cache_dtype="float32", model_dtype=torch.float32)
    dataclasses.replace(meta, verified_block_table=None, max_block_ids=None).check_cache(small)


def test_plan_step_prepares_exactly_the_absorbed_batch():
    """``plan_step(meta, layers)``, the engine's one call: the backend's ``prepare`` sees the sub-batch the
    layer's forward hands to ``forward_mqa`` (the decodes of a mixed step, not the prefill), once for several
    layers alike, and the forward does not prepare again (it reads the plan)."""
    from layer_cases import scattered_block_tables, tiny_config

    from mla_backends.layer.attention import MLAAttention
    from mla_backends.loading.hf import random_hf_state_dict
    from mla_backends.ref_torch import RefTorchBackend

    seen: list[tuple[int, ...]] = []
    kernel_states: list[object] = []

    class Preparing(RefTorchBackend):
        name = "PREPARING"

        def prepare(self, meta):
            seen.append(meta.query_lens_list)
            return "state"

        def forward_mqa_kernel(self, *args, state, **kw):
            kernel_states.append(state)
            super().forward_mqa_kernel(*args, state=None, **kw)

    cfg = tiny_config(heads=2).to_dict()
    layer = MLAAttention.from_hf_config(cfg, backend=Preparing, dtype=torch.float32)
    layer.load_hf_state_dict(random_hf_state_dict(layer.dims, attention_bias=layer.attention_bias))
    twin = MLAAttention.from_hf_config(cfg, backend=Preparing, dtype=torch.float32, layer_idx=1)
    qlens, ctxs = [1, 6, 1], [5, 0, 3]
    bt, nb = scattered_block_tables(3, 8, BLOCK)
    cache = layer.allocate_cache(nb, BLOCK)
    twin.allocate_cache(nb, BLOCK)  # configures the twin's backend alike (page size)
    meta = BatchMetadata.build(qlens, ctxs, bt, BLOCK, num_blocks=nb, decode_threshold=layer.decode_threshold)
    plan = plan_step(meta, [layer, twin])
    assert seen == [(1, 1)]  # the two decodes (processing order puts them first), not the 6-token prefill
    x = torch.randn(sum(qlens), cfg["hidden_size"])
    layer(x, None, cache, plan)
    assert seen == [(1, 1)] and kernel_states == ["state"]  # the forward read the planned state
    with pytest.raises(StepPlanError, match="made for other metadata|made without"):
        other = BatchMetadata.build(qlens, ctxs, bt, BLOCK, num_blocks=nb, decode_threshold=layer.decode_threshold)
        d = layer.dims
        layer.backend.forward_mqa(torch.zeros(2, d.num_heads, d.kv_lora_rank),
                                  torch.zeros(2, d.num_heads, d.qk_rope_head_dim), cache, other.select_requests(0, 2),
                                  scale=0.1, plan=plan)
