"""Issue 21: the selection cache under a racing environment, and the four tests sampled mutation testing
showed missing (each kills one surviving mutant)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from layer_cases import tiny_config

import selector.select as select_mod
from mla_backends.backends.contract import QueryLenSupport
from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dispatch import PerRequestPolicy, step_runs
from mla_backends.planning import costs
from mla_backends.plugins.registry import BackendName
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import Run
from selector.select import BackendNotSupportedError, clear_cache, select_backend

V3 = MLADims.deepseek_v3()


def _racing(monkeypatch, name: str, value: str) -> None:
    """Another thread sets ``name`` right after a selection took its snapshot of the environment."""
    real = select_mod._env_state

    def snapshot_then_change():
        snap = real()
        monkeypatch.setenv(name, value)  # (restored at teardown)
        return snap

    monkeypatch.setattr(select_mod, "_env_state", snapshot_then_change)


def test_selection_follows_the_environment_it_was_cached_under(monkeypatch):
    """Class: the environment is read once per call, so a cached selection matches its key."""
    clear_cache()
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    _racing(monkeypatch, "MLA_BACKEND", "ref_torch")
    sel = select_backend(V3, device="cpu")
    assert sel.forced_by is None, "read MLA_BACKEND again after the cache key was taken"
    monkeypatch.undo()
    clear_cache()
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU switch of TRITON_MLA, unset in the key
    _racing(monkeypatch, "TRITON_INTERPRET", "1")
    with pytest.raises(BackendNotSupportedError, match="device: got CPU"):
        select_backend(V3.tensor_parallel(8), device="cpu", backend=BackendName.TRITON_MLA.value)
    monkeypatch.undo()
    clear_cache()
    assert "MLA_BACKEND" not in os.environ or os.environ["MLA_BACKEND"] != "ref_torch"


def test_fp8_e5m2_cache_saturates_instead_of_overflowing():
    """torch's e5m2 cast turns 1e6 into inf (unlike e4m3's, which saturates by itself): the clamp matters."""
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()
    cache = LatentKVCache(1, 4, 8, 4, kv_cache_dtype="fp8_e5m2", model_dtype=torch.float32, scale=2.0)
    cache.write(torch.full((1, 8), 1e6), torch.full((1, 4), -1e6), torch.tensor([0]))
    row = cache.read_slots(torch.tensor([0]), torch.float32)[0]
    assert torch.equal(row[:8], torch.full((8,), 57344.0 * 2.0))  # e5m2's largest finite value, times scale
    assert torch.equal(row[8:], torch.full((4,), -57344.0 * 2.0))


class SingleTokenFake(RefTorchBackend):
    """REF_TORCH declaring single-token queries (a CPU stand-in for a decode-only kernel)."""

    name = "SINGLE_TOKEN_FAKE"
    capabilities = dataclasses.replace(RefTorchBackend.capabilities, query_len=QueryLenSupport.SINGLE,
                                       decode_threshold=1)


@pytest.mark.parametrize(("threshold", "want"), [(8, 1), (1, 1), (0, 0)])
def test_layer_decode_threshold_on_a_single_token_backend(threshold, want):
    layer = MLAAttention.from_hf_config(tiny_config(), backend=SingleTokenFake, dtype=torch.float64,
                                        dispatch=PerRequestPolicy(threshold=threshold))
    assert layer.decode_threshold == want


def test_uniform_query_length_backend_gets_a_run_per_query_length():
    caps = dataclasses.replace(RefTorchBackend.capabilities, query_len=QueryLenSupport.UNIFORM)
    bt = torch.arange(16, dtype=torch.int32).view(4, 4)
    meta = BatchMetadata.build([1, 1, 2, 2], [3, 3, 3, 3], bt, 4, decode_threshold=2)
    assert step_runs(meta, PerRequestPolicy(threshold=2), caps) == (Run(True, 0, 2), Run(True, 2, 4))
    varlen = RefTorchBackend.capabilities
    meta = BatchMetadata.build([1, 1, 2, 2], [3, 3, 3, 3], bt, 4, decode_threshold=2)
    assert step_runs(meta, PerRequestPolicy(threshold=2), varlen) == (Run(True, 0, 4),)


def test_min_context_for_absorption_tie_point():
    """V3, 128 query tokens: 513 is the first context where absorbed is strictly cheaper; at 512 the two paths
    cost the same and the expanded path is chosen."""
    assert costs.min_context_for_absorption(V3, 128) == 513
    assert costs.absorbed_path_flops(V3, 128, 512) == costs.expanded_path_flops(V3, 128, 512)
    assert costs.cheaper_path(V3, 128, 512) == "expanded"
    assert costs.cheaper_path(V3, 128, 513) == "absorbed"
