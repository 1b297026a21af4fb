"""CUDA-graph decode: the batch padded with dummy requests (slot -1), a fixed block-table width, metadata
tensors rewritten in place (:class:`DecodeGraphMetadata`). On the CPU the padded static step runs eagerly
under the Triton interpreter and must equal the unpadded step; on a GPU a 2-layer decode step is captured
with ``torch.cuda.CUDAGraph`` and replayed over new lengths and block tables."""

from __future__ import annotations

import pytest
import torch

from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.loading.hf import random_hf_state_dict
from mla_backends.step.graph import DecodeGraphMetadata
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step
from mla_backends.testing import no_host_sync

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.cuda.is_available()
DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
               q_lora_rank=24, hidden_size=48, num_layers=2, max_position_embeddings=512)
BS, NUM_BLOCKS, WIDTH, MAX_BATCH = 16, 40, 6, 4


def two_layers(device: str, dtype: torch.dtype):
    layers, caches = [], []
    for i in range(2):
        layer = MLAAttention(DIMS, backend="TRITON_MLA", dtype=dtype, device=device, layer_idx=i)
        layer.load_hf_state_dict(random_hf_state_dict(DIMS, dtype=dtype, seed=i, std=0.1))
        layer.backend.num_kv_splits = 2  # a fixed grid, as capture needs
        layers.append(layer)
        caches.append(layer.allocate_cache(NUM_BLOCKS, BS))
    return layers, caches


def tables(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g)[: n * WIDTH].view(n, WIDTH).int()


def prefill(layers, caches, bt, lens, device):
    meta = BatchMetadata.build(lens, [0] * len(lens), bt, BS, device=device)
    x = torch.randn(sum(lens), DIMS.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    for layer, cache in zip(layers, caches, strict=True):
        x = layer(x, None, cache, plan_step(meta, [layer]))


def step(layers, caches, x, meta):
    for layer, cache in zip(layers, caches, strict=True):
        x = layer(x, None, cache, plan_step(meta, [layer]))
    return x


def test_padded_static_step_equals_the_unpadded_step_and_keeps_addresses():
    layers, caches = two_layers("cpu", torch.float32)
    assert layers[0].backend_cls.capabilities.cuda_graphs
    gm = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NUM_BLOCKS)
    addresses = [t.data_ptr() for t in (gm.meta.block_table, gm.meta.slot_mapping, gm.meta.token_positions)]
    bt = tables(3, seed=2)
    prefill(layers, caches, bt, [30, 9, 50], "cpu")
    for ctx, table in (([30, 9, 50], bt), ([31, 10, 51], bt)):  # then new lengths over the same tables
        x = torch.randn(3, DIMS.hidden_size)
        real = gm.update(ctx, table)
        padded_x = torch.cat([x, torch.zeros(MAX_BATCH - 3, DIMS.hidden_size)])
        snapshot = [c.rows_with_sink().clone() for c in caches]
        with torch.inference_mode(), no_host_sync():  # what a capture would record: no sync
            padded = step(layers, caches, padded_x, gm.meta)
        written = [c.rows_with_sink().clone() for c in caches]
        for c, s in zip(caches, snapshot, strict=True):
            c.rows_with_sink().copy_(s)
        with torch.inference_mode():
            eager = step(layers, caches, x, real)
        torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
        slots = real.slot_mapping  # the three real tokens' rows: computed over 4 rows vs 3, so BLAS may round
        others = torch.ones(snapshot[0].shape[0], dtype=torch.bool)  # every other row, the sink included
        others[slots] = False
        for c, w, s in zip(caches, written, snapshot, strict=True):
            rows = c.rows_with_sink()
            torch.testing.assert_close(w[slots], rows[slots], rtol=1e-5, atol=1e-5)
            assert not torch.equal(w[slots], s[slots])  # the step did write them
            assert torch.equal(w[others], rows[others])  # dummies wrote nothing but the sink row (zero input)
            assert torch.equal(w[others], s[others])
    assert [t.data_ptr() for t in (gm.meta.block_table, gm.meta.slot_mapping, gm.meta.token_positions)] \
        == addresses


def test_update_validates_before_copying():
    gm = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NUM_BLOCKS)
    gm.update([5, 6], tables(2, seed=3))
    before = gm.meta.block_table.clone()
    bad = tables(2, seed=4)
    bad[0, 0] = NUM_BLOCKS
    with pytest.raises(ValueError, match="block id"):
        gm.update([5, 6], bad)
    with pytest.raises(ValueError, match="supported 1..4"):
        gm.update([1] * 5, tables(5, seed=5)[:, :WIDTH])
    assert torch.equal(gm.meta.block_table, before)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: captures a decode step with torch.cuda.CUDAGraph")
@pytest.mark.gpu
def test_gpu_two_layer_decode_step_captured_and_replayed():
    dev = "cuda"
    layers, caches = two_layers(dev, torch.bfloat16)
    gm = DecodeGraphMetadata(MAX_BATCH, WIDTH, BS, NUM_BLOCKS, device=dev)
    bt = tables(3, seed=6)
    prefill(layers, caches, bt, [40, 7, 60], dev)
    static_x = torch.zeros(MAX_BATCH, DIMS.hidden_size, dtype=torch.bfloat16, device=dev)
    gm.update([40, 7, 60], bt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():  # warm-up: kernels compiled outside capture
        step(layers, caches, static_x.clone(), gm.meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        static_y = step(layers, caches, static_x, gm.meta)
    g = torch.Generator().manual_seed(7)
    for ctx, table in (([41, 8, 61], bt), ([12, 70, 3], tables(3, seed=8))):
        x = torch.randn(3, DIMS.hidden_size, generator=g).to(dev, torch.bfloat16)
        if table is not bt:  # new tables: their pages must hold the context first
            prefill(layers, caches, table, [c for c in ctx], dev)
        real = gm.update(ctx, table)
        static_x.zero_()
        static_x[:3].copy_(x)
        snapshot = [c.data.clone() for c in caches]
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_y[:3].clone()
        for c, s in zip(caches, snapshot, strict=True):
            c.data.copy_(s)
        with torch.inference_mode():
            eager = step(layers, caches, x, real)
        torch.testing.assert_close(replayed.float(), eager.float(), rtol=2e-2, atol=2e-2)
