"""Selecting a backend for DeepSeek-V4: the V4 orderings name the kernels vLLM runs V4 on and refuse them by
name until a plugin provides one; backends without sinks, windows or compressed keys say so."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from selector_fakes import FAKES, FakeTriton, fake_registry, install

from mla_backends.backends.contract import Capabilities, MLABackend
from mla_backends.core.v4dims import V4Dims
from mla_backends.layer.v4 import V4Attention
from selector.select import BackendNotSupportedError, select_backend

DIMS = V4Dims.deepseek_v4_flash()
UNREGISTERED = "registry: got no backend registered under this name"


@pytest.mark.parametrize(("device", "named"), [
    ("sm90", ["FLASHMLA_SPARSE_DSV4"]),
    ("sm100", ["FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4"]),
    ("sm120", ["FLASHINFER_MLA_SPARSE_DSV4"]),
    ("sm80", []),
    ("cpu", []),
])
def test_the_v4_ladders_name_vllms_v4_kernels_and_refuse_them_by_name(monkeypatch, device, named):
    install(monkeypatch, fake_registry())
    sel = select_backend(DIMS, device=device)
    assert sel.name == "REF_TORCH" and sel.ladder.endswith("/deepseek-v4")
    assert [v.name for v in sel.verdicts] == [*named, "REF_TORCH"]
    for v in sel.verdicts[:-1]:
        assert [str(r) for r in v.reasons][0].startswith(UNREGISTERED)
    assert sel.spec.sinks and sel.spec.window and sel.spec.compressed and sel.spec.kv_lora_rank == 512


def test_a_forced_backend_without_v4_gives_every_reason(monkeypatch):
    install(monkeypatch, fake_registry())
    with pytest.raises(BackendNotSupportedError) as err:
        select_backend(DIMS, device="sm90", backend="TRITON_MLA")
    text = str(err.value)
    for want in ("sinks: got required; supported none", "sliding window: got required; supported none",
                 "compressed keys: got required; supported none"):
        assert want in text
    with pytest.raises(ValueError, match="sinks: got required"):
        V4Attention(DIMS, layer_idx=0, backend=FakeTriton)


class _PluginDsv4(MLABackend):
    """A plugin registering a V4 kernel under vLLM's name: the ladder then takes it on Hopper."""

    name = "FLASHMLA_SPARSE_DSV4"
    capabilities = dataclasses.replace(
        Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}),
                     min_compute_capability=(9, 0), max_compute_capability=(10, 3), preferred_page_size=64),
        sinks=True, window=True, compressed=True)

    def forward_mqa_kernel(self, *args, **kwargs):  # pragma: no cover - selection only
        raise AssertionError


def test_a_plugin_under_a_named_v4_kernel_is_chosen(monkeypatch):
    install(monkeypatch, fake_registry(*FAKES, _PluginDsv4))
    sel = select_backend(DIMS, device="sm90")
    assert sel.name == "FLASHMLA_SPARSE_DSV4" and sel.block_size == 64
    assert select_backend(DIMS, device="sm80").name == "REF_TORCH"  # not in the Ampere ordering
