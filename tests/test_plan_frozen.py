"""Frozen means consistent, and a plan is bound to what it was planned for (issues 42 and 48).

Every public frozen object checks itself on construction, so ``dataclasses.replace`` runs the same checks: mirrored
fields that disagree are refused, naming the field. A ``StepPlan`` carried to other metadata (``replace(plan,
meta=next)``, another step's batch) or to a backend configured otherwise is a ``StepPlanError`` before anything
is written. The cases of issue 48 ("frozen objects that can be made to disagree, and then run") are reproduced
here with the calls of 0.4, so they fail on 0.4 and pass now.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import pytest
import torch
from layer_cases import scattered_block_tables, tiny_config

from mla_backends import (
    AttentionSpec,
    BatchMetadata,
    MLAAttention,
    PlanRequest,
    RefTorchBackend,
    Run,
    StepPlanError,
    Tolerance,
    configure_backend,
    plan_step,
)
from mla_backends.testing import random_hf_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4


def _layer(seed: int = 0, **kw) -> MLAAttention:
    layer = MLAAttention.from_hf_config(tiny_config(heads=2).to_dict(), backend="REF_TORCH", dtype=torch.float64,
                                        **kw)
    layer.load_hf_state_dict(random_hf_state_dict(layer.dims, dtype=torch.float64, seed=seed))
    return layer


def _meta(qlens, ctxs, bt, nb, layer):
    return BatchMetadata.build(list(qlens), list(ctxs), bt, BS, num_blocks=nb,
                               decode_threshold=layer.decode_threshold)


# ---- a plan is bound to its metadata ---------------------------------------------------------------------------
def test_a_plan_given_the_next_steps_metadata_is_refused_before_anything_runs():
    """Issue 48: ``replace(plan, meta=next)`` ran step 1's runs and prepared states on step 2's metadata."""
    layer = _layer()
    bt, nb = scattered_block_tables(3, 12, BS)
    cache = layer.allocate_cache(nb, BS)
    step1 = _meta((1, 5, 1), (6, 0, 3), bt, nb, layer)
    step2 = _meta((1, 1, 4), (7, 5, 3), bt, nb, layer)
    plan = plan_step(step1, [layer])
    cache.data.normal_()
    before = cache.data.clone()
    with pytest.raises(StepPlanError, match=r"plan.meta: got metadata this plan was not made for"):
        moved = dataclasses.replace(plan, meta=step2)
        layer(torch.randn(step2.num_tokens, layer.dims.hidden_size, dtype=torch.float64), None, cache, moved)
    assert torch.equal(cache.data, before)  # nothing written
    with pytest.raises(StepPlanError, match="plan.batches: got a batch for requests 0:2 that is not those"):
        dataclasses.replace(plan, meta=step2, batches={**plan.batches, (0, 3): step2})
    with pytest.raises(StepPlanError, match="plan.states: got a prepared state of a batch that is not this plan's"):
        dataclasses.replace(plan, meta=step2, batches={(0, 3): step2}, runs={}, members={})
    assert dataclasses.replace(plan).meta is step1  # an unchanged copy is still the same step's plan


def test_a_plan_made_for_a_backend_configured_otherwise_is_refused_before_the_cache_write():
    layer, other = _layer(0), _layer(1)
    bt, nb = scattered_block_tables(3, 12, BS)
    layer.allocate_cache(nb, BS)
    cache = other.allocate_cache(nb, BS, "fp8_e4m3", scale=0.5)  # configured for an fp8 cache
    meta = _meta((1, 5, 1), (6, 0, 3), bt, nb, layer)
    plan = plan_step(meta, [layer])
    assert other.backend is not layer.backend and other.runs_key() == layer.runs_key()
    cache.data.view(torch.uint8).random_(0, 120)
    before = cache.data.view(torch.uint8).clone()
    with pytest.raises(StepPlanError, match="made without backend REF_TORCH"):
        other(torch.randn(meta.num_tokens, other.dims.hidden_size, dtype=torch.float64), None, cache, plan)
    assert torch.equal(cache.data.view(torch.uint8), before)


def test_a_configured_backend_refuses_calls_it_was_not_configured_for():
    layer = _layer()
    bt, nb = scattered_block_tables(2, 8, BS)
    cache = layer.allocate_cache(nb, BS)
    meta = _meta((1, 1), (5, 3), bt, nb, layer)
    plan = plan_step(meta, [layer])
    d = layer.dims
    q = torch.randn(2, d.num_heads, d.kv_lora_rank, dtype=torch.float64)
    qr = torch.randn(2, d.num_heads, d.qk_rope_head_dim, dtype=torch.float64)
    out, _ = layer.backend.forward_mqa(q, qr, cache, meta, scale=layer.scale, plan=plan)
    assert torch.isfinite(out).all()
    with pytest.raises(StepPlanError, match=r"got a call with scale 0.5 \(configured"):
        layer.backend.forward_mqa(q, qr, cache, meta, scale=0.5, plan=plan)
    with pytest.raises(StepPlanError, match=r"got a call with heads 1 \(configured 2\)"):
        layer.backend.forward_mqa(q[:, :1].contiguous(), qr[:, :1].contiguous(), cache, meta, scale=layer.scale,
                                  plan=plan)


# ---- metadata: the host lists are the source of truth ----------------------------------------------------------
def test_metadata_whose_lists_disagree_with_its_tensors_is_refused():
    """Issue 48: a BatchMetadata whose context_lens_list or query_lens_list no longer matched its tensors gave
    an answer matching neither."""
    bt, nb = scattered_block_tables(3, 12, BS)
    meta = BatchMetadata.build([1, 5, 1], [6, 0, 3], bt, BS, num_blocks=nb)
    with pytest.raises(ValueError, match=r"^context_lens: got \[6, 3, 0\]"):
        dataclasses.replace(meta, context_lens_list=(6, 3, 1))
    with pytest.raises(ValueError, match=r"^query_lens: got"):
        dataclasses.replace(meta, query_lens_list=(1, 2, 4))  # same token count, other split
    with pytest.raises(ValueError, match=r"^token_order: got shape \[7\] .* supported \[8\]"):
        dataclasses.replace(meta, query_lens_list=(1, 1, 6))
    with pytest.raises(ValueError, match=r"^seq_lens: got"):
        dataclasses.replace(meta, seq_lens=meta.seq_lens + 1)
    with pytest.raises(ValueError, match=r"^context_lens_list: got 2 entries"):
        dataclasses.replace(meta, context_lens_list=(6, 3))
    with pytest.raises(TypeError, match=r"^query_lens_list: got list"):
        dataclasses.replace(meta, query_lens_list=[1, 1, 5])
    with pytest.raises(ValueError, match=r"^block_table: got shape \[2, 3\]"):
        dataclasses.replace(meta, block_table=meta.block_table[:2])
    same = dataclasses.replace(meta, context_lens_list=tuple(meta.context_lens_list))  # equal values: fine
    assert same.context_lens_list == meta.context_lens_list
    fixed = dataclasses.replace(meta, context_lens=meta.context_lens.clone())  # checked again, and agreeing
    assert fixed.verified_lengths[1] is fixed.context_lens


def test_the_engine_constructors_check_shapes_only():
    """build / for_decode / select_requests make their tensors from the lists (or take an engine's own with its
    host copy): nothing is compared value by value, so no device read is added on the engine paths."""
    bt, nb = scattered_block_tables(3, 12, BS)
    meta = BatchMetadata.build([1, 5, 1], [6, 0, 3], bt, BS, num_blocks=nb)
    sub = meta.select_requests(1, 3)
    dec = BatchMetadata.for_decode(bt.to(torch.int32), torch.tensor([7, 4, 9], dtype=torch.int32), [7, 4, 9], BS)
    for m in (meta, sub, dec):
        assert m.verified_lengths[0] is m.query_lens and m.verified_lengths[6] is m.query_lens_list


# ---- the other frozen objects ---------------------------------------------------------------------------------
def test_tolerance_refuses_negative_and_non_finite_bounds():
    """Issue 48: ``Tolerance(atol=-1)`` was accepted."""
    for bad in (-1, -1e-9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="atol: got"):
            Tolerance(atol=bad, rtol=0.0)
    with pytest.raises(TypeError, match="rtol: got str"):
        Tolerance(1e-3, "1e-3")  # type: ignore[arg-type]
    tol = Tolerance(1e-3, 1e-3)
    with pytest.raises(ValueError, match="rtol: got -0.5"):
        dataclasses.replace(tol, rtol=-0.5)


def test_attention_spec_and_runs_check_themselves():
    spec = AttentionSpec(num_heads=4)
    with pytest.raises(TypeError, match="num_heads: got str"):
        dataclasses.replace(spec, num_heads="4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size: got 0"):
        dataclasses.replace(spec, block_size=0)
    with pytest.raises(TypeError, match="sparse: got 1"):
        dataclasses.replace(spec, sparse=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop: got 1; supported >= 3"):
        Run(True, 3, 1)
    with pytest.raises(TypeError, match="absorbed: got 1"):
        Run(1, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop: got -1"):
        Run(True, 0, 2)._replace(stop=-1)
    assert Run._make([False, 0, 2]) == (False, 0, 2)
    with pytest.raises(ValueError, match=r"runs\[1\]: got \(False, 3, 4\), starting at request 3"):
        PlanRequest(runs_key="k", runs=(Run(True, 0, 2), Run(False, 3, 4)), backend=RefTorchBackend())
    with pytest.raises(TypeError, match="backend: got type"):
        PlanRequest(runs_key="k", runs=(Run(True, 0, 2),), backend=RefTorchBackend)  # type: ignore[arg-type]


# ---- configure once -------------------------------------------------------------------------------------------
def test_one_configured_backend_per_configuration_and_it_is_immutable():
    spec = AttentionSpec(num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, dtype=torch.float64, block_size=BS)
    a = configure_backend(RefTorchBackend, spec, 0.25)
    assert configure_backend(RefTorchBackend, spec, 0.25) is a  # the builder and every layer: one object
    assert configure_backend(a, spec, 0.25) is a
    assert configure_backend(RefTorchBackend, spec, 0.5) is not a
    assert configure_backend(RefTorchBackend, dataclasses.replace(spec, block_size=8), 0.25) is not a
    with pytest.raises(AttributeError, match="layer_spec: REF_TORCH is configured"):
        a.layer_spec = dataclasses.replace(spec, block_size=8)
    with pytest.raises(ValueError, match="scale: got -1"):
        configure_backend(RefTorchBackend, spec, -1)
    with pytest.raises(TypeError, match="spec: got dict"):
        configure_backend(RefTorchBackend, {}, 0.25)  # type: ignore[arg-type]
    assert copy.deepcopy(a) is a and pickle.loads(pickle.dumps(a)) is a  # copies are the configuration again
    bare = RefTorchBackend()
    with pytest.warns(DeprecationWarning, match="configure_backend"):
        bare.configure(spec, 0.25)  # the 0.4 call: configures in place, once
    assert bare.prepare_key() == a.prepare_key() and bare is not a
    with warnings.catch_warnings(), pytest.raises(ValueError, match="spec: got another configuration"):
        warnings.simplefilter("ignore", DeprecationWarning)
        bare.configure(spec, 0.5)


def test_the_layer_configures_once_and_refuses_another_cache_after_planning():
    layer = _layer()
    first = layer.backend
    assert first.layer_spec.block_size is None  # not yet known
    bt, nb = scattered_block_tables(2, 8, BS)
    layer.allocate_cache(nb, BS)
    assert layer.backend is not first and layer.backend.layer_spec.block_size == BS
    twin = _layer(1)
    twin.allocate_cache(nb, BS)
    assert twin.backend is layer.backend  # configured alike: one configured backend
    plan_step(_meta((1, 1), (5, 3), bt, nb, layer), [layer])
    layer.allocate_cache(nb, BS)  # the same configuration again (a bigger pool, say): fine
    with pytest.raises(ValueError, match=r"allocate_cache: got page size 8 .* has taken part in a step plan"):
        layer.allocate_cache(nb, 8)
    assert layer.backend.layer_spec.block_size == BS


def test_a_racing_allocate_of_the_same_configuration_after_another_thread_planned_is_fine():
    """Threads sharing a model each allocate a cache: one reads the layer's first (incomplete) configuration,
    then, before it looks whether the layer has planned, another thread completes the configuration and plans.
    The late one must get the very object the other swapped in (configured backends are one per
    configuration), not a "configured once" refusal; another page size is still refused."""
    layer = _layer()
    bt, nb = scattered_block_tables(2, 8, BS)
    raced = []

    class Racing(type(layer)):
        @property
        def _planned(self):  # the late thread's look at "planned": the other thread runs first
            if not raced:
                raced.append(True)
                type(layer).__bases__[0].allocate_cache(layer, nb, BS)  # completes the configuration ...
                plan_step(_meta((1, 1), (5, 3), bt, nb, layer), [layer])  # ... and plans
            return self.__dict__["_planned"]

        @_planned.setter
        def _planned(self, value):
            self.__dict__["_planned"] = value

    layer.__class__ = Racing
    real = layer.backend  # the incomplete configuration the late thread starts from
    layer.__dict__["_planned"] = False
    assert real.layer_spec.block_size is None
    layer.allocate_cache(nb, BS)
    assert raced and layer.backend.layer_spec.block_size == BS
    with pytest.raises(ValueError, match=r"allocate_cache: got page size 8 .* has taken part in a step plan"):
        layer.allocate_cache(nb, 8)


# ---- one protocol: an engine reads the layer's split from the plan ---------------------------------------------
@pytest.mark.parametrize("dispatch", ["per-request", "per-batch"])
def test_an_engine_gets_the_runs_a_layer_with_its_policy_gets(dispatch):
    layer = _layer(dispatch=dispatch)
    bt, nb = scattered_block_tables(4, 12, BS)
    layer.allocate_cache(nb, BS)
    meta = _meta((1, 5, 1, 3), (6, 0, 3, 9), bt, nb, layer)
    backend = layer.backend
    plan = plan_step(meta, [layer, backend], dispatch=None)
    engine = plan_step(meta, [backend], dispatch=dispatch)
    assert [tuple(rb.run) for rb in engine.runs_of(backend)] == [tuple(r) for r in plan.member_runs(layer)]
    for run, batch in engine.runs_of(backend):
        assert batch is engine.batch(run.start, run.stop)
        assert batch.query_lens_list == meta.query_lens_list[run.start:run.stop]
    assert engine.absorbed_batches(backend) == tuple(b for r, b in engine.runs_of(backend) if r.absorbed)
    assert [tuple(rb.run) for rb in plan.runs_of(backend)] == [(True, 0, 4)]  # no dispatch: the whole step
    with pytest.raises(ValueError, match=r"dispatch: got 'per-request' with layer 0 among the participants"):
        plan_step(meta, [layer], dispatch="per-request")
    with pytest.raises(StepPlanError, match="made without REF_TORCH"):
        engine.runs_of(RefTorchBackend())  # took no part
