"""The ladders as data: shape, justification, plugin placement, and no dead entries."""

from __future__ import annotations

import itertools

import pytest
import torch
from selector_fakes import FAKES, FakeXqa, fake_registry, install

from mla_backends.backends.contract import MLABackend
from mla_backends.core.device import CPU_DEVICE, simulated_device
from mla_backends.core.dims import MLADims
from mla_backends.cpu_fused import CpuFusedBackend
from mla_backends.plugins.loading import load_registry
from mla_backends.plugins.registry import BackendName, Registry
from selector.ladders import LADDERS, candidates, ladder_for
from selector.select import NoBackendError, clear_cache, select_backend

BUILTIN = {m.value for m in BackendName}


def test_every_family_is_well_formed():
    seen = set()
    for lad in LADDERS:
        assert lad.family not in seen and lad.why.strip()
        seen.add(lad.family)
        for label, names in lad.variants().items():
            assert names and len(set(names)) == len(names), (lad.family, label)
            assert set(names) <= BUILTIN, (lad.family, label)
            if lad.family != "cpu":
                assert names[-1] == "REF_TORCH", "the reference is last on GPUs"
        for cc in lad.archs:
            assert ladder_for(simulated_device(*cc)) is lad
    assert {"sm80", "sm90", "sm100", "sm110", "sm120", "cpu"} <= seen
    assert ladder_for(CPU_DEVICE).dense == ("CPU_FUSED", "REF_TORCH")  # the compiled kernel where built
    assert ladder_for(CPU_DEVICE).sparse == ("REF_TORCH",)
    assert {lad.family for lad in LADDERS if "FLASHINFER_MLA_XQA" in lad.dense} == {"sm120"}


def _registry_with_real_declarations() -> Registry:
    """The real built-ins (the kernel packages they need are simulated by each test)."""
    real = load_registry(autoload=False)
    reg = Registry()
    for fake in FAKES:
        reg.add(real.get(fake.name), source="builtin")
    return reg


_DIMS = MLADims.deepseek_v3()
_GRID = list(itertools.product(
    [torch.bfloat16, torch.float16, torch.float32, torch.float64],
    [None, 1, 16, 32, 64, 128, 256],
    [16, 96, 128],  # heads
    [(1, True, False), (4, True, True), (4, False, False)],  # max_query_len, uniform, need_lse
))
_INSTALLED = [frozenset({"triton", "flashinfer"}), frozenset({"flashinfer"}), frozenset({"triton"}),
              frozenset()]


@pytest.mark.parametrize("lad", LADDERS, ids=lambda lad: lad.family)
def test_no_dead_entries(monkeypatch, lad):
    """Every entry of every ordering wins for some request on some architecture of its family.

    The configurations vary dtype, page size, heads, query length, LSE and which kernel packages are
    installed (simulated by patching the package probe); declarations are the real built-ins'.
    """
    reg = install(monkeypatch, _registry_with_real_declarations())
    installed: set[str] = set()
    monkeypatch.setattr(MLABackend, "missing_requirements",
                        classmethod(lambda cls: [m for m in cls.capabilities.requires if m not in installed]))
    monkeypatch.setattr(CpuFusedBackend, "build_reasons", classmethod(lambda cls: []))  # as if built here
    archs = lad.archs or ((None),)
    for label, names in lad.variants().items():
        fp8, sparse = "fp8" in label, label.startswith("sparse")
        kvs = ["fp8_e4m3", "fp8_e5m2"] if fp8 else ["auto"]
        todo = set(names)
        for pkgs, cc in itertools.product(_INSTALLED, archs):
            installed.clear()
            installed.update(pkgs)
            clear_cache()
            device = "cpu" if cc is None else simulated_device(*cc)
            for (dtype, page, heads, (mql, uniform, lse)), kv in itertools.product(_GRID, kvs):
                if not todo:
                    break
                try:
                    sel = select_backend(MLADims(**{**_DIMS.__dict__, "num_heads": heads}), dtype=dtype,
                                         kv_cache_dtype=kv, block_size=page, sparse=sparse, max_query_len=mql,
                                         uniform_query_len=uniform, need_lse=lse, device=device)
                except NoBackendError:
                    continue
                assert sel.verdicts[0].name == names[0] and len(sel.verdicts) == len(names)
                todo.discard(sel.name)
        assert not todo, f"{lad.family} / {label}: never selected: {sorted(todo)}"
    assert reg.plugins == ()


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm110", "sm120",
                                  "sm121"])
def test_every_arch_gets_its_first_choice_for_a_plain_request(monkeypatch, arch):
    """With every package present, a default V3 (TP=8) bf16 request takes the top of the dense ladder."""
    install(monkeypatch, _registry_with_real_declarations())
    monkeypatch.setattr(MLABackend, "missing_requirements", classmethod(lambda cls: []))
    sel = select_backend(MLADims.deepseek_v3().tensor_parallel(8), device=arch)
    assert sel.name == ladder_for(sel.device).dense[0]
    assert sel.block_size == sel.backend.capabilities.preferred_page_size


# ---- plugin placement -----------------------------------------------------------------------------------
class PluginMLA(FakeXqa):
    name = "PLUGIN_MLA"


def test_placement_inserts_without_reordering_builtins(monkeypatch):
    reg = install(monkeypatch, fake_registry())
    reg.add(PluginMLA, source="p", before="TRITON_MLA", archs=["sm90", "sm121"])
    sm90 = candidates(simulated_device(9, 0), fp8=False, sparse=False, registry=reg)
    assert sm90 == ("FLASHINFER_MLA", "PLUGIN_MLA", "TRITON_MLA", "REF_TORCH")
    assert candidates(simulated_device(9, 0), fp8=False, sparse=True, registry=reg) == (
        "PLUGIN_MLA", "TRITON_MLA", "REF_TORCH")
    assert "PLUGIN_MLA" not in candidates(simulated_device(8, 0), fp8=False, sparse=False, registry=reg)
    assert "PLUGIN_MLA" in candidates(simulated_device(12, 1), fp8=False, sparse=False, registry=reg)
    assert "PLUGIN_MLA" not in candidates(simulated_device(12, 0), fp8=False, sparse=False, registry=reg)
    for dev in [(8, 0), (9, 0), (10, 0), (12, 1)]:
        d = simulated_device(*dev)
        placed = candidates(d, fp8=False, sparse=False, registry=reg)
        assert [n for n in placed if n in BUILTIN] == list(ladder_for(d).dense)


def test_after_placement_and_several_plugins_keep_registration_order(monkeypatch):
    reg = install(monkeypatch, fake_registry())
    reg.add(PluginMLA, source="p", after="REF_TORCH")
    reg.add(type("SECOND_MLA", (FakeXqa,), {"name": "SECOND_MLA"}), source="q", after="REF_TORCH")
    reg.add(type("THIRD_MLA", (FakeXqa,), {"name": "THIRD_MLA"}), source="r", before="REF_TORCH")
    assert candidates(CPU_DEVICE, fp8=False, sparse=False, registry=reg) == (
        "CPU_FUSED", "THIRD_MLA", "REF_TORCH", "PLUGIN_MLA", "SECOND_MLA")


def test_variant_picks_the_ordering_named_by_fp8_and_sparse():
    from selector.ladders import Ladder

    lad = Ladder(family="t", archs=(), dense=("D",), dense_fp8=("DF",), sparse=("S",), sparse_fp8=("SF",),
                 why="test")
    assert lad.variant(fp8=False, sparse=False) == ("D",)
    assert lad.variant(fp8=True, sparse=False) == ("DF",)
    assert lad.variant(fp8=False, sparse=True) == ("S",)
    assert lad.variant(fp8=True, sparse=True) == ("SF",)
