"""The hot path of ``forward_mqa``: a configured backend's dense call that the step's plan vouched for skips the full
input checks (:func:`~mla_backends.backends.inputs.is_vouched_call` compares each fact once). Every input that
differs from what the configuration and the plan say must leave that path and meet the full checks, which raise
the same errors as before; a call the full checks accept (an int scale) still runs."""

from __future__ import annotations

import pytest
import torch

from mla_backends.backends import contract
from mla_backends.backends.contract import AttentionSpec, configure_backend
from mla_backends.backends.inputs import is_vouched_call
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import StepPlan, StepPlanError, plan_step

HEADS, SCALE = 4, 0.125


def _step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = LatentKVCache(4, 16, model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 1], [5, 20], [[2, -1], [0, 3]], 16, num_blocks=4)
    q = torch.randn(2, HEADS, 512, generator=g)
    qr = torch.randn(2, HEADS, 64, generator=g)
    backend = configure_backend(RefTorchBackend, AttentionSpec(num_heads=HEADS, dtype=torch.float32, block_size=16),
                                SCALE)
    return backend, cache, meta, q, qr, plan_step(meta, [backend])


def _outputs(q: torch.Tensor):
    return torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))


def test_a_plain_planned_call_takes_the_hot_path_and_matches_the_full_checks(monkeypatch):
    backend, cache, meta, q, qr, plan = _step()
    out, lse = _outputs(q)
    assert is_vouched_call(backend._planned_call, q, qr, cache, meta, SCALE, out, lse, plan)
    assert is_vouched_call(backend._planned_call, q, qr, cache, meta, SCALE, None, None, plan)
    want_out, want_lse = backend.forward_mqa(q, qr, cache, meta, scale=SCALE)  # no plan: checked in full

    def refuse(*args, **kwargs):
        raise AssertionError("the full checks ran on a vouched call")

    monkeypatch.setattr(contract, "check_mqa_inputs", refuse)
    got_out, got_lse = backend.forward_mqa(q, qr, cache, meta, scale=SCALE, out=out, lse_out=lse, plan=plan)
    assert got_out is out and got_lse is lse
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    fresh_out, fresh_lse = backend.forward_mqa(q, qr, cache, meta, scale=SCALE, plan=plan)  # outputs made here
    torch.testing.assert_close(fresh_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(fresh_lse, want_lse, rtol=0, atol=0)


def _perturbed(name: str):
    """A vouched call with one thing changed: (backend, kwargs of forward_mqa, what the full checks raise)."""
    backend, cache, meta, q, qr, plan = _step()
    out, lse = _outputs(q)
    kw = dict(q_latent=q, q_rope=qr, cache=cache, meta=meta, scale=SCALE, out=out, lse_out=lse, plan=plan)
    if name == "out aliases q_latent":
        kw["out"] = q
        return backend, kw, (ValueError, "out: got a buffer sharing memory with q_latent")
    if name == "lse_out aliases out":
        kw["lse_out"] = out.view(-1)[: 2 * HEADS].view(2, HEADS)
        return backend, kw, (ValueError, "lse_out: got a buffer sharing memory with out")
    if name == "out aliases the cache":
        kw["out"] = cache.data.view(-1)[: q.numel()].view(q.shape)
        return backend, kw, (ValueError, "out: got a buffer sharing memory with cache")
    if name == "lse_out float64":
        kw["lse_out"] = lse.double()
        return backend, kw, (TypeError, "lse_out: got dtype float64")
    if name == "out of another shape":
        kw["out"] = torch.empty(2, HEADS, 256)
        return backend, kw, (ValueError, r"out: got shape \[2, 4, 256\]")
    if name == "q_rope bf16":
        kw["q_rope"] = qr.bfloat16()
        return backend, kw, (TypeError, "q_rope: got dtype bfloat16")
    if name == "q_latent of other heads":
        kw["q_latent"], kw["q_rope"], kw["out"] = q[:, :2], qr[:, :2], out[:, :2]
        kw["lse_out"] = lse[:, :2]
        return backend, kw, (StepPlanError, "heads 2 .configured 4.")
    if name == "another scale":
        kw["scale"] = 0.5
        return backend, kw, (StepPlanError, "scale 0.5 .configured 0.125.")
    if name == "metadata of another step":
        kw["meta"] = BatchMetadata.build([1, 1], [5, 20], [[2, -1], [0, 3]], 16, num_blocks=4)
        return backend, kw, (StepPlanError, "plan: got a plan made for other metadata")
    if name == "a cache too small for the table":
        kw["cache"] = LatentKVCache(2, 16, model_dtype=torch.float32)
        return backend, kw, (ValueError, "block")
    if name == "a cache of another page size":
        kw["cache"] = LatentKVCache(8, 8, model_dtype=torch.float32)
        return backend, kw, (ValueError, "page size|block_size")
    if name == "a cache of another kv_lora_rank":
        kw["cache"] = LatentKVCache(4, 16, kv_lora_rank=256, model_dtype=torch.float32)
        return backend, kw, (ValueError, r"q_latent: got shape \[2, 4, 512\]; supported \[2, \*, 256\]")
    if name == "queries on the meta device":
        kw["q_latent"] = q.to("meta")
        return backend, kw, (ValueError, "q_latent: got device meta")
    if name == "q_latent not a tensor":
        kw["q_latent"] = q.tolist()
        return backend, kw, (TypeError, "q_latent: got list")
    if name == "plan not a plan":
        kw["plan"] = meta
        return backend, kw, (TypeError, "plan: got BatchMetadata")
    raise AssertionError(name)


REFUSED = ["out aliases q_latent", "lse_out aliases out", "out aliases the cache", "lse_out float64",
           "out of another shape", "q_rope bf16", "q_latent of other heads", "another scale",
           "metadata of another step", "a cache too small for the table", "a cache of another page size",
           "a cache of another kv_lora_rank", "queries on the meta device", "q_latent not a tensor", "plan not a plan"]


@pytest.mark.parametrize("name", REFUSED)
def test_every_disagreement_leaves_the_hot_path_and_raises_the_full_checks_error(name):
    backend, kw, (error, message) = _perturbed(name)
    if isinstance(kw["plan"], StepPlan):
        assert not is_vouched_call(backend._planned_call, kw["q_latent"], kw["q_rope"], kw["cache"], kw["meta"],
                                   kw["scale"], kw["out"], kw["lse_out"], kw["plan"])
    written = [t for t in (kw["out"], kw["lse_out"]) if t.device.type == "cpu" and t.is_floating_point()]
    before = [t.clone() for t in written]
    with pytest.raises(error, match=message):
        backend.forward_mqa(kw.pop("q_latent"), kw.pop("q_rope"), kw.pop("cache"), kw.pop("meta"), **kw)
    for t, b in zip(written, before, strict=True):  # refused before anything was written
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)


def test_an_int_scale_leaves_the_hot_path_and_still_runs():
    """``scale=1`` style ints are accepted by the full checks; the hot path compares floats only."""
    g = torch.Generator().manual_seed(1)
    cache = LatentKVCache(4, 16, model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1], [7], [[1, -1]], 16, num_blocks=4)
    backend = configure_backend(RefTorchBackend, AttentionSpec(num_heads=HEADS, dtype=torch.float32, block_size=16),
                                1.0)
    plan = plan_step(meta, [backend])
    q, qr = torch.randn(1, HEADS, 512, generator=g), torch.randn(1, HEADS, 64, generator=g)
    assert not is_vouched_call(backend._planned_call, q, qr, cache, meta, 1, None, None, plan)
    got, _ = backend.forward_mqa(q, qr, cache, meta, scale=1, plan=plan)
    want, _ = backend.forward_mqa(q, qr, cache, meta, scale=1.0, plan=plan)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sparse_configurations_and_unconfigured_instances_have_no_hot_path():
    sparse = configure_backend(RefTorchBackend, AttentionSpec(num_heads=HEADS, dtype=torch.float32, sparse=True),
                               SCALE)
    dense = configure_backend(RefTorchBackend, AttentionSpec(num_heads=HEADS, dtype=torch.float32), SCALE)
    assert sparse._planned_call is None and dense._planned_call is not None
    assert RefTorchBackend()._planned_call is None  # unconfigured: every call checked in full


def test_configurations_the_shared_checks_refuse_have_no_hot_path():
    """A configuration of zero heads, or of a query dtype outside the model dtypes, may be accepted by a
    backend's declarations; its calls must still meet ``check_mqa_inputs``, which refuses them."""
    import dataclasses

    class Odd(RefTorchBackend):
        name = "ODD_DTYPES"
        capabilities = dataclasses.replace(RefTorchBackend.capabilities,
                                           dtypes=frozenset({torch.complex64, torch.float32}))

    odd = configure_backend(Odd, AttentionSpec(num_heads=HEADS, dtype=torch.complex64, kv_cache_dtype="float32",
                                               block_size=16), SCALE)
    assert odd._planned_call is None
    backend = configure_backend(RefTorchBackend, AttentionSpec(num_heads=0, dtype=torch.float32, block_size=16),
                                SCALE)
    assert backend._planned_call is None
    _, cache, meta, _, _, _ = _step()
    plan = plan_step(meta, [backend])
    with pytest.raises(ValueError, match="q_latent: got 0 heads; supported >= 1"):
        backend.forward_mqa(torch.randn(2, 0, 512), torch.randn(2, 0, 64), cache, meta, scale=SCALE, plan=plan)
    with pytest.raises(TypeError, match="q_latent: got dtype complex64"):
        odd.forward_mqa(torch.randn(2, HEADS, 512, dtype=torch.complex64),
                        torch.randn(2, HEADS, 64, dtype=torch.complex64), cache, meta, scale=SCALE,
                        plan=plan_step(meta, [odd]))
