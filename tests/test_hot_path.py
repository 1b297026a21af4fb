"""The engine hot path (issue 14): one shared prefill workspace, no host sync after ``BatchMetadata.build``,
the step validated whole before the first write, and the sync guard itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.workspace import PrefillWorkspace, clear_shared_workspaces, shared_workspace
from mla_backends.loading.hf import random_hf_state_dict
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import plan_step
from mla_backends.testing import HostSyncError, host_sync_allowed, no_host_sync

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               q_lora_rank=24, hidden_size=48, num_layers=8, max_position_embeddings=512)
BS = 8


def make_layer(layer_idx: int = 0, **kw) -> MLAAttention:
    layer = MLAAttention(DIMS, backend="REF_TORCH", dtype=torch.float32, layer_idx=layer_idx, **kw)
    layer.load_hf_state_dict(random_hf_state_dict(DIMS, dtype=torch.float32, seed=layer_idx, std=0.1))
    return layer


def block_table(num_requests: int, pages: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[: num_requests * pages].view(num_requests, pages).int()


def run(layer, cache, bt, q, c, **build):
    meta = BatchMetadata.build(q, c, bt, BS, decode_threshold=layer.decode_threshold, **build)
    x = torch.randn(sum(q), DIMS.hidden_size, generator=torch.Generator().manual_seed(sum(q) + sum(c)))
    return layer(x, None, cache, plan_step(meta, [layer]))


# ---- one workspace per device ------------------------------------------------------------------------------
def test_eight_layers_share_one_workspace():
    clear_shared_workspaces()
    layers = [make_layer(i) for i in range(8)]
    caches = [layer.allocate_cache(40, BS) for layer in layers]
    bt = block_table(2, 10, 40)
    sizes = []
    with torch.inference_mode():
        for layer, cache in zip(layers, caches, strict=True):
            run(layer, cache, bt, [20, 30], [0, 0])  # cold prefill fills the cache
            run(layer, cache, bt, [5, 9], [20, 30])  # prefill over cached context: uses the workspace
            sizes.append(layer.workspace.nbytes)
    first = layers[0].workspace
    assert first is not None and all(layer.workspace is first for layer in layers)
    # 50 context rows of (32 + 8) latent and 4 * (16 + 16) up-projected values, float32: one layer's worth
    assert sizes == [50 * (40 + 128) * 4] * 8
    assert first.allocations == 1


def test_layer_given_its_own_workspace_uses_it():
    own = PrefillWorkspace(16)
    layer, other = make_layer(0, workspace=own), make_layer(1)
    cache = layer.allocate_cache(40, BS)
    bt = block_table(2, 10, 40)
    with torch.inference_mode():
        run(layer, cache, bt, [20, 30], [0, 0])
        run(layer, cache, bt, [5, 9], [20, 30])
    assert layer.workspace is own and own.allocations == 1 and own.kv.shape[0] == 16  # chunks of 16 rows
    assert other.workspace is None or other.workspace is not own
    assert shared_workspace("cpu", torch.float32, layer.workspace_rows(BS)) is not own
    with pytest.raises(TypeError, match="workspace: got int"):
        make_layer(0, workspace=3)


# ---- no host sync after build ------------------------------------------------------------------------------
@pytest.mark.parametrize("q,c", [([1, 1, 1], [20, 7, 33]),  # decode only
                                 ([1, 6, 1], [20, 7, 33]),  # mixed: two decodes and a prefill over cache
                                 ([9, 4, 12], [20, 7, 33])],  # prefill over cached context
                         ids=["decode", "mixed", "prefill-over-cache"])
def test_layer_forward_makes_no_host_sync(q, c):
    # REF_TORCH's backend call is included: it declares host_sync_free (its shapes come from host lists)
    layer = make_layer()
    assert layer.backend_cls.capabilities.host_sync_free
    cache = layer.allocate_cache(40, BS)
    bt = block_table(3, 7, 40)
    with torch.inference_mode():
        run(layer, cache, bt, c, [0, 0, 0])
        meta = BatchMetadata.build(q, c, bt, BS)
        x = torch.randn(sum(q), DIMS.hidden_size)
        plan = plan_step(meta, [layer])  # the engine's once-per-step call, outside the guard
        with no_host_sync():
            y = layer(x, None, cache, plan)
    assert y.shape == (sum(q), DIMS.hidden_size) and bool(torch.isfinite(y).all())


def test_raw_slot_write_keeps_its_checks_and_the_meta_write_trusts_build():
    layer = make_layer()
    cache = layer.allocate_cache(4, BS)
    kv, pe = torch.randn(2, 32), torch.randn(2, 8)
    with pytest.raises(HostSyncError):  # a raw slot tensor is range-checked: it reads the values
        with no_host_sync():
            cache.write(kv, pe, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.write(kv, pe, torch.tensor([0, 4 * BS]))
    meta = BatchMetadata.build([2], [0], [[1]], BS)
    with no_host_sync():
        cache.write(kv, pe, meta)
    assert torch.equal(cache.data[1, :2, :32], kv) and torch.equal(cache.data[1, :2, 32:], pe)


def test_skipped_slots_go_to_the_sink_with_static_shapes():
    layer = make_layer()
    cache = layer.allocate_cache(2, BS)
    before = cache.data.clone()
    rows = torch.randn(3, 40)
    with no_host_sync():  # trusted path: no mask, one index_copy_
        cache._write_rows(rows, torch.tensor([-1, 3, -1]), trusted=True)
    assert torch.equal(cache.data.view(-1, 40)[3], rows[1])
    changed = (cache.data != before).view(-1, 40).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3]  # the two skipped rows landed in the sink, outside data


# ---- validation before write -------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [[1, 1], [3, 5], [1, 4]], ids=["decode", "prefill", "mixed"])
def test_bad_block_id_is_rejected_before_anything_is_written(q):
    layer = make_layer()
    cache = layer.allocate_cache(12, BS)
    bt = block_table(2, 4, 12)
    with torch.inference_mode():
        run(layer, cache, bt, [12, 20], [0, 0])
    bad = bt.clone()
    bad[1, 0] = 12  # the cached prefix of request 1 points past the cache
    snapshot = cache.data.clone()
    meta = BatchMetadata.build(q, [12, 20], bad, BS)  # no num_blocks: the layer checks against its cache
    with pytest.raises(ValueError, match="block id 12"):
        layer(torch.randn(sum(q), DIMS.hidden_size), None, cache, plan_step(meta, [layer]))
    assert torch.equal(cache.data.view(torch.int32), snapshot.view(torch.int32))  # bit-identical


def test_two_new_tokens_on_one_slot_are_rejected_but_shared_prefix_pages_are_fine():
    shared = [[0, 1], [0, 2]]  # both requests hold page 0 as their cached prefix
    meta = BatchMetadata.build([1, 1], [BS, BS], shared, BS)
    assert meta.max_block_ids == (1, 2)
    with pytest.raises(ValueError, match="both write slot"):
        BatchMetadata.build([1, 1], [0, 0], [[3], [3]], BS)


def test_cache_verdict_is_a_host_comparison_with_builds_maxima():
    layer = make_layer()
    cache = layer.allocate_cache(12, BS)
    meta = BatchMetadata.build([3], [0], [[1]], BS)
    assert meta.max_live_block_id() == 1  # from build's host maxima
    with no_host_sync():
        meta.check_cache(cache)
        plan_step(meta, [layer]).check_cache(cache)
    small = layer.allocate_cache(1, BS)
    with pytest.raises(ValueError, match=r"supported \[0, 0\]"):
        meta.check_cache(small)


# ---- the guard itself ----------------------------------------------------------------------------------------
X = torch.arange(6.0)
MASK = X > 2

SYNCS = {
    "item": lambda: X[0].item(),
    "bool": lambda: bool(X.sum()),
    "int": lambda: int(X[1]),
    "is_nonzero": lambda: X[:1].is_nonzero(),
    "equal": lambda: torch.equal(X, X),
    "nonzero": lambda: X.nonzero(),
    "masked_select": lambda: X.masked_select(MASK),
    "unique": lambda: torch.unique(X),
    "unique_consecutive": lambda: torch.unique_consecutive(X),
    "bool-mask index": lambda: X[MASK],
    "bool-mask index_put": lambda: X.clone().__setitem__(MASK, 0.0),
    "repeat_interleave": lambda: torch.repeat_interleave(X, torch.ones(6, dtype=torch.long)),
    "tolist": lambda: X.tolist(),
    "cpu": lambda: X.cpu(),
    "numpy": lambda: X.numpy(),
    "__array__": lambda: np.asarray(X),
}


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("name", list(SYNCS))
def test_guard_catches(name, inference):
    with torch.inference_mode(inference), pytest.raises(HostSyncError, match="host sync"):
        with no_host_sync():
            SYNCS[name]()


def test_guard_passes_clean_code_and_counts_and_pauses():
    with no_host_sync():
        torch.repeat_interleave(X, torch.ones(6, dtype=torch.long), output_size=6)
        X.masked_fill(MASK, 0.0)
        X[torch.tensor([0, 2])]
        torch.where(MASK, X, 0.0).sum()
        with host_sync_allowed():
            X.tolist()
    with no_host_sync(count=True) as rec:
        X.tolist()
        X[0].item()
    assert rec.count == 2 and rec.ops == ["Tensor.tolist", "Tensor.item"]
    assert torch.Tensor.tolist is not None and X.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # restored


def test_kv_cache_report_shows_the_shared_workspace(capsys):
    import json

    from mla_backends.cli import main

    assert main(["kv-cache", "--model", "deepseek-v3", "--tp", "8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    per_row = (512 + 64 + 16 * (128 + 128)) * 2  # latent row + this rank's 16 heads of K-nope and V, bf16
    assert rep["prefill_workspace_bytes"] == 65536 * per_row  # 584 MiB, once per device
    assert rep["prefill_workspace_bytes_if_per_layer"] == 61 * 65536 * per_row
    assert main(["kv-cache", "--model", "deepseek-v3", "--tp", "8"]) == 0
    assert "prefill workspace" in capsys.readouterr().out
