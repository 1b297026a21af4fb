"""The plan owns the step for real (issue 42) and is safe to share (issue 48).

After ``plan_step`` nothing in a layer call prepares, plans, fills a state lazily or allocates the planning
thread's working buffers: each spy below fails the test if it runs during the layers (REF_TORCH through
``MLAAttention``; TRITON_MLA under the interpreter, tiny shapes; FlashInfer's wrappers are covered with the
recording stand-in in ``test_flashinfer_api.py``). The prepared states are frozen: writing to one fails. Two
threads running the layers (or ``forward_mqa``) of one plan at once get exactly what each gets alone.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest
import torch
from layer_cases import scattered_block_tables, tiny_config

from mla_backends import AttentionSpec, BatchMetadata, LatentKVCache, MLAAttention, configure_backend, plan_step
from mla_backends.ref_torch import RefTorchBackend, plans
from mla_backends.testing import random_hf_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4


def _layers(n: int) -> list[MLAAttention]:
    out = []
    for i in range(n):
        layer = MLAAttention.from_hf_config(tiny_config(heads=2).to_dict(), backend="REF_TORCH",
                                            dtype=torch.float64, layer_idx=i)
        layer.load_hf_state_dict(random_hf_state_dict(layer.dims, dtype=torch.float64, seed=i))
        out.append(layer)
    return out


def _step(layers, qlens=(1, 6, 1, 3), ctxs=(9, 0, 14, 5)):
    bt, nb = scattered_block_tables(len(qlens), max(q + c for q, c in zip(qlens, ctxs, strict=True)), BS)
    caches = [layer.allocate_cache(nb, BS) for layer in layers]
    for c in caches:
        c.data.normal_()
    meta = BatchMetadata.build(list(qlens), list(ctxs), bt, BS, num_blocks=nb,
                               decode_threshold=layers[0].decode_threshold)
    x = torch.randn(meta.num_tokens, layers[0].dims.hidden_size, dtype=torch.float64)
    return meta, caches, x


def _run(layers, caches, x, plan):
    for layer, cache in zip(layers, caches, strict=True):
        x = layer(x, None, cache, plan)
    return x


class Forbidden:
    """Counts calls of the wrapped functions while armed (armed: the layers run)."""

    def __init__(self, monkeypatch, owner, *names):
        self.calls: list[str] = []
        self.armed = False
        for name in names:
            inner = getattr(owner, name)

            def spy(*a, _inner=inner, _name=name, **k):
                if self.armed:
                    self.calls.append(_name)
                return _inner(*a, **k)

            static = isinstance(inspect.getattr_static(owner, name), staticmethod)
            monkeypatch.setattr(owner, name, staticmethod(spy) if static else spy)


# ---- REF_TORCH ---------------------------------------------------------------------------------------------
def test_ref_torch_layers_only_read_the_plan(monkeypatch):
    layers = _layers(3)
    meta, caches, x = _step(layers)
    spies = Forbidden(monkeypatch, plans, "dense_groups", "prepare_step")
    backend_spies = Forbidden(monkeypatch, RefTorchBackend, "prepare", "dense_parts")
    plan = plan_step(meta, layers)
    state = plan.state(layers[0].backend, plan.batch(0, 2))  # the two decodes, absorbed
    assert isinstance(state, plans.RefStep) and state.groups and state.parts is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.parts = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        state.groups[("more",)] = ()  # type: ignore[index]
    arena = layers[0].backend.resources
    held = {k: t.data_ptr() for k, t in arena.thread_buffers().items()}  # reserved when the step was planned
    assert {k[0] for k in held} >= {"q", "dense_s", "dense_kv"}
    spies.armed = backend_spies.armed = True
    y = _run(layers, caches, x, plan)
    assert not spies.calls and not backend_spies.calls, spies.calls + backend_spies.calls
    assert {k: t.data_ptr() for k, t in arena.thread_buffers().items()} == held  # nothing allocated or grown
    assert torch.isfinite(y).all()


def _threads_agree(work, runs: int = 6) -> None:
    """``work()`` alone, then in two threads at once (``runs`` times each): every result equals the alone one."""
    alone = work()
    barrier = threading.Barrier(2)
    results: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(runs):
                results[i].append(work())
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    differ = sum(not torch.equal(r, alone) for rs in results for r in rs)
    assert differ == 0, f"{differ} of {2 * runs} outputs differ from the same call made alone"


def test_two_threads_run_the_layers_of_one_plan():
    """Issue 48: concurrent calls under one plan shared its working buffers and gave wrong answers."""
    layers = _layers(2)
    meta, caches, x = _step(layers, qlens=(1, 1, 1, 1, 2), ctxs=(30, 9, 41, 17, 12))
    plan = plan_step(meta, layers)
    with torch.no_grad():
        _threads_agree(lambda: _run(layers, caches, x, plan))


def test_two_threads_run_forward_mqa_of_one_plan():
    H, r, rope = 4, 32, 8
    spec = AttentionSpec(num_heads=H, kv_lora_rank=r, qk_rope_head_dim=rope, dtype=torch.float32, block_size=BS)
    backend = configure_backend(RefTorchBackend, spec, 0.2)
    bt, nb = scattered_block_tables(6, 40, BS)
    cache = LatentKVCache(nb, BS, kv_lora_rank=r, qk_rope_head_dim=rope, model_dtype=torch.float32)
    cache.data.normal_()
    meta = BatchMetadata.build([1, 1, 2, 1, 3, 1], [33, 4, 17, 28, 9, 12], bt, BS, num_blocks=nb, reorder=False)
    q = torch.randn(meta.num_tokens, H, r)
    qr = torch.randn(meta.num_tokens, H, rope)
    plan = plan_step(meta, [backend])
    _threads_agree(lambda: backend.forward_mqa(q, qr, cache, meta, scale=0.2, plan=plan)[0], runs=10)


# ---- TRITON_MLA (interpreter, tiny shapes) -----------------------------------------------------------------
@pytest.fixture
def triton_backend():
    pytest.importorskip("triton")
    from mla_backends.triton_mla import TritonMLABackend

    if not TritonMLABackend.is_available():
        pytest.skip("triton is not usable here")
    spec = AttentionSpec(num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, dtype=torch.float32, block_size=BS)
    return configure_backend(TritonMLABackend, spec, 0.25)


def _triton_step():
    bt, nb = scattered_block_tables(3, 12, BS)
    cache = LatentKVCache(nb, BS, kv_lora_rank=32, qk_rope_head_dim=16, model_dtype=torch.float32)
    cache.data.normal_()
    meta = BatchMetadata.build([1, 2, 1], [5, 3, 9], bt, BS, num_blocks=nb, reorder=False)
    g = torch.Generator().manual_seed(3)
    return cache, meta, torch.randn(meta.num_tokens, 2, 32, generator=g), torch.randn(meta.num_tokens, 2, 16,
                                                                                      generator=g)


def test_triton_forward_only_reads_its_prepared_launch(monkeypatch, triton_backend):
    from mla_backends.triton_mla import TritonMLABackend
    from mla_backends.triton_mla.backend import TritonStep

    cache, meta, q, qr = _triton_step()
    spies = Forbidden(monkeypatch, TritonMLABackend, "launch_config", "kv_splits_for", "rows_splits_for",
                      "prepare")
    plan = plan_step(meta, [triton_backend])
    state = plan.state(triton_backend, meta)
    assert isinstance(state, TritonStep)
    spies.armed = True
    out, lse = triton_backend.forward_mqa(q, qr, cache, meta, scale=0.25, plan=plan)
    assert not spies.calls, spies.calls
    ref, ref_lse = RefTorchBackend().forward_mqa(q, qr, cache, meta, scale=0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_two_threads_run_triton_under_one_plan(triton_backend):
    cache, meta, q, qr = _triton_step()
    plan = plan_step(meta, [triton_backend])
    _threads_agree(lambda: triton_backend.forward_mqa(q, qr, cache, meta, scale=0.25, plan=plan)[0], runs=2)
