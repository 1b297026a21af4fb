"""The step plan has one owner: ``plan_step`` works a step out once, before the first layer, and the layers only
read it. A step without its own plan is refused before anything is written; the plan never changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from layer_cases import scattered_block_tables, tiny_config

from mla_backends import BatchMetadata, MLAAttention, StepPlan, StepPlanError, plan_step
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import random_hf_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4


class Counting(RefTorchBackend):
    """REF_TORCH counting its prepare calls and failing loudly if one comes after planning."""

    name = "COUNTING_PLAN"
    prepares = 0
    planning = True

    def prepare(self, meta):
        if not Counting.planning:
            raise AssertionError("prepare() ran in the middle of a step")
        Counting.prepares += 1
        return super().prepare(meta)


def _layers(n: int, **kw) -> list[MLAAttention]:
    cfg = tiny_config(heads=2).to_dict()
    out = []
    for i in range(n):
        layer = MLAAttention.from_hf_config(cfg, backend=Counting, dtype=torch.float64, layer_idx=i, **kw)
        layer.load_hf_state_dict(random_hf_state_dict(layer.dims, dtype=torch.float64, seed=i))
        out.append(layer)
    return out


def _step(layers, qlens=(1, 5, 1), ctxs=(6, 0, 3)):
    bt, nb = scattered_block_tables(len(qlens), 12, BS)
    caches = [layer.allocate_cache(nb, BS) for layer in layers]
    meta = BatchMetadata.build(list(qlens), list(ctxs), bt, BS, num_blocks=nb,
                               decode_threshold=layers[0].decode_threshold)
    x = torch.randn(sum(qlens), layers[0].dims.hidden_size, dtype=torch.float64)
    return meta, caches, x


def test_one_plan_serves_every_layer_and_nothing_is_prepared_after_it():
    layers = _layers(3)
    meta, caches, x = _step(layers)
    Counting.prepares, Counting.planning = 0, True
    plan = plan_step(meta, layers)
    assert Counting.prepares == 1  # three layers configured alike share the decodes' one prepared state
    Counting.planning = False
    try:
        for layer, cache in zip(layers, caches, strict=True):
            x = layer(x, None, cache, plan)
    finally:
        Counting.planning = True
    assert torch.isfinite(x).all()


def test_a_step_without_its_own_plan_is_refused_before_anything_is_written():
    layers = _layers(2)
    meta, caches, x = _step(layers)
    layer, cache = layers[0], caches[0]
    cache.data.normal_()
    before = cache.data.clone()
    with pytest.raises(TypeError, match=r"plan: got BatchMetadata for MLAAttention.forward; supported the "
                                        r"step's StepPlan \(plan = plan_step\(meta, layers\)"):
        layer(x, None, cache, meta)
    other = dataclasses.replace(meta)  # the same numbers, another step: its plan does not hold this batch
    with pytest.raises(StepPlanError, match="made for other metadata"):
        d = layer.dims
        layer.backend.forward_mqa(torch.zeros(2, d.num_heads, d.kv_lora_rank, dtype=torch.float64),
                                  torch.zeros(2, d.num_heads, d.qk_rope_head_dim, dtype=torch.float64), cache,
                                  meta.select_requests(0, 2), scale=0.1, plan=plan_step(other, [layer]))
    per_batch = MLAAttention.from_hf_config(tiny_config(heads=2).to_dict(), backend=Counting, dtype=torch.float64,
                                            dispatch="per-batch", layer_idx=5)
    per_batch.load_hf_state_dict(random_hf_state_dict(per_batch.dims, dtype=torch.float64))
    with pytest.raises(StepPlanError, match="made without layer 5"):
        per_batch(x, None, cache, plan_step(meta, [layer]))  # planned for another dispatch
    assert torch.equal(cache.data, before), "a refused step wrote the cache"


def test_the_plan_is_frozen():
    layers = _layers(1)
    meta, _, _ = _step(layers)
    plan = plan_step(meta, layers)
    assert isinstance(plan, StepPlan) and plan.meta is meta
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.meta = meta  # type: ignore[misc]
    for table in (plan.runs, plan.batches, plan.states, plan.local):
        with pytest.raises(TypeError):
            table[object()] = None  # type: ignore[index]
    assert isinstance(plan.accepted, frozenset) and plan.accepted  # the layer's combination, accepted once


def test_plan_step_names_bad_participants():
    meta, _, _ = _step(_layers(1))
    with pytest.raises(TypeError, match="participants: got RefTorchBackend"):
        plan_step(meta, RefTorchBackend())  # not an iterable of them
    with pytest.raises(TypeError, match="participants: got type"):
        plan_step(meta, [RefTorchBackend])  # the class, not an instance
    with pytest.raises(TypeError, match="meta: got dict"):
        plan_step({}, [RefTorchBackend()])


def test_layers_configured_alike_are_asked_once_and_every_one_runs_on_the_plan(monkeypatch):
    layers = _layers(4)
    other = _layers(1, dispatch="per-batch")[0]  # another dispatch: a request of its own
    meta, caches, x = _step(layers + [other])
    asked: list[int] = []
    real = MLAAttention.plan_request

    def spy(self, m):
        asked.append(self.layer_idx)
        return real(self, m)

    monkeypatch.setattr(MLAAttention, "plan_request", spy)
    plan = plan_step(meta, layers + [other])
    assert asked == [0, 0]  # the first of the four alike, then the per-batch one (also layer_idx 0)
    assert len({layer.plan_key() for layer in layers}) == 1 and other.plan_key() != layers[0].plan_key()
    y = x
    for layer, cache in zip(layers + [other], caches, strict=True):
        y = layer(y, None, cache, plan)  # every layer finds its runs and its backend's state in the plan
    assert torch.isfinite(y).all()


def test_a_plan_key_that_cannot_be_hashed_is_named():
    meta, _, _ = _step(_layers(1))

    class Unhashable(RefTorchBackend):
        def plan_key(self):
            return [1]

    with pytest.raises(TypeError, match=r"participants: Unhashable.plan_key returned list, which cannot be hashed"):
        plan_step(meta, [Unhashable()])
