"""Plugins through pluggy: the installed example and broken plugins, and every failure mode isolated."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from importlib.metadata import entry_points

import pytest
import torch
from selector_fakes import FakeXqa, install

from mla_backends.backends.contract import Capabilities, MLABackend
from mla_backends.backends.reasons import ReasonKind
from mla_backends.core.dims import MLADims
from mla_backends.plugins.hookspecs import hookimpl
from mla_backends.plugins.loading import add_plugin, load_registry, run_plugin
from mla_backends.plugins.registry import BackendName, RegistrationError
from mla_backends.ref_torch import RefTorchBackend
from selector.select import select_backend

V3 = MLADims.deepseek_v3().tensor_parallel(8)
EPS = {ep.name for ep in entry_points(group="mla_backends")}
needs_plugins = pytest.mark.skipif(
    not {"example", "broken"} <= EPS,
    reason="test plugin packages not installed: `make install` puts examples/mla_backends_example_plugin and "
           "tests/plugins/broken_plugin in .test-site (see the Makefile)")


@pytest.fixture
def loaded(monkeypatch):
    """A freshly loaded process-wide registry with entry-point autoload on."""
    monkeypatch.delenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return install(monkeypatch, load_registry())


@needs_plugins
def test_example_plugin_registers_through_its_entry_point(loaded):
    entry = loaded.entry("example_mla")
    assert entry is not None and entry.source == "example"
    assert entry.cls.__module__ == "mla_backends_example_plugin" and issubclass(entry.cls, RefTorchBackend)
    assert entry.placement.before == "REF_TORCH" and "cpu" not in entry.placement.archs
    assert "example" in loaded.plugins
    for m in BackendName:  # the plugin took no built-in name and moved no built-in
        assert loaded.entry(m.value).source == "builtin"


@needs_plugins
def test_example_plugin_is_selectable_by_override_and_by_its_placement(loaded, monkeypatch):
    sel = select_backend(V3, device="cpu", backend="example_mla")
    assert (sel.name, sel.block_size) == ("EXAMPLE_MLA", 32)
    assert sel.verdicts[0].source == "example"
    # on a GPU it sits right before the reference: float32 on SM120 skips xqa, and with triton "missing"
    # the plugin wins
    monkeypatch.setattr(MLABackend, "missing_requirements",
                        classmethod(lambda cls: [m for m in cls.capabilities.requires if m == "triton"]))
    sel = select_backend(V3, device="sm120", dtype="float32", block_size=32)
    assert [v.name for v in sel.verdicts] == ["FLASHINFER_MLA_XQA", "TRITON_MLA", "EXAMPLE_MLA", "REF_TORCH"]
    assert sel.name == "EXAMPLE_MLA" and sel.verdicts[2].source == "example"
    assert str(sel.verdicts[1].reasons[0]).startswith("package: got triton not installed")
    assert sel.verdicts[1].reasons[0].kind is ReasonKind.PACKAGE
    # ... and a page size the plugin does not accept gives its own declared reason
    sel = select_backend(V3, device="sm90", dtype="float64", block_size=40)
    ex = next(v for v in sel.verdicts if v.name == "EXAMPLE_MLA")
    assert "page size: got 40; supported multiples of 16" in ex.reasons and sel.name == "REF_TORCH"
    # the CPU ladder does not include it (its placement names GPU families only)
    assert [v.name for v in select_backend(V3, device="cpu").verdicts] == ["CPU_FUSED", "REF_TORCH"]


@needs_plugins
def test_broken_plugin_is_recorded_and_harmless(loaded):
    probs = [p for p in loaded.problems if p.plugin == "broken"]
    assert len(probs) == 1 and probs[0].stage == "import"
    assert "RuntimeError: mla_backends_broken_plugin: deliberately broken on import" in probs[0].error
    sel = select_backend(V3, device="sm90")
    assert sel.name in {"FLASHINFER_MLA", "TRITON_MLA", "REF_TORCH"}
    assert "plugin 'broken' (import): RuntimeError" in sel.explain()


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = load_registry()
    assert reg.plugins == ("builtin",) and reg.entry("EXAMPLE_MLA") is None
    assert not [p for p in reg.problems if p.plugin == "broken"]


# ---- in-process plugins: each failure mode ----------------------------------------------------------------
def _plugin(fn) -> types.SimpleNamespace:
    return types.SimpleNamespace(register_mla_backends=hookimpl(fn))


class GoodMLA(FakeXqa):
    name = "GOOD_MLA"


def test_hook_raising_discards_its_registrations(monkeypatch, cpu_fused_not_built):
    reg = install(monkeypatch, load_registry(autoload=False))

    def boom(register):
        register(GoodMLA)
        raise RuntimeError("hook exploded")

    assert run_plugin(reg, "boom", _plugin(boom)) is False
    assert reg.entry("GOOD_MLA") is None
    assert reg.problems[-1].describe() == "plugin 'boom' (hook): RuntimeError: hook exploded"
    assert select_backend(V3, device="cpu").name == "REF_TORCH"


def test_duplicate_and_malformed_registrations_are_recorded_others_kept(monkeypatch):
    reg = install(monkeypatch, load_registry(autoload=False))
    shadow = type("Shadow", (RefTorchBackend,), {})  # name REF_TORCH
    caps = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}), cpu=True)
    object.__setattr__(caps, "dense", False)  # neither dense nor sparse
    malformed = type("Malformed", (FakeXqa,), {"name": "MALFORMED_MLA", "capabilities": caps})

    def mixed(register):
        register(shadow)
        register(malformed)
        register(GoodMLA, after="REF_TORCH")
        register("mla_backends.ref_torch:Missing")

    assert run_plugin(reg, "mixed", _plugin(mixed)) is False
    stages = [(p.stage, p.error) for p in reg.problems if p.plugin == "mixed"]
    assert stages[0] == ("register", "Shadow: RegistrationError: name: got 'REF_TORCH', already registered "
                                     "by 'builtin'; supported a unique name")
    assert stages[1] == ("register", "Malformed: RegistrationError: capabilities: dense/sparse: got neither; "
                                     "supported at least one")
    assert stages[2][0] == "register" and "AttributeError" in stages[2][1]
    assert reg.get("REF_TORCH") is RefTorchBackend and reg.entry("MALFORMED_MLA") is None
    assert reg.entry("GOOD_MLA").source == "mixed" and "mixed" in reg.plugins
    assert select_backend(V3, device="sm120", backend="good_mla").name == "GOOD_MLA"
    assert "plugin 'mixed' (register)" in select_backend(V3, device="cpu").explain()


def test_plugin_without_a_hook_or_with_a_bad_signature(monkeypatch):
    reg = install(monkeypatch, load_registry(autoload=False))
    assert run_plugin(reg, "empty", types.SimpleNamespace()) is False
    assert reg.problems[-1].error == "no @hookimpl register_mla_backends(register) found in the plugin"
    assert run_plugin(reg, "badsig", _plugin(lambda registrar: None)) is False
    assert reg.problems[-1].stage == "hook" and "PluginValidationError" in reg.problems[-1].error


def test_builtin_errors_are_not_hidden(monkeypatch):
    reg = install(monkeypatch, load_registry(autoload=False))
    with pytest.raises(RegistrationError, match="already registered"):
        run_plugin(reg, "builtin", _plugin(lambda register: register(type("S", (RefTorchBackend,), {}))),
                   strict=True)
    # a built-in module that is simply absent is recorded as "missing", not raised
    absent = _plugin(lambda register: register("mla_backends.nope_xyz:B", name="NOPE"))
    assert run_plugin(reg, "builtin", absent, strict=True) is False
    assert reg.problems[-1].stage == "missing"


def test_add_plugin_feeds_the_process_registry(monkeypatch):
    install(monkeypatch, load_registry(autoload=False))
    module = types.ModuleType("engine_backends")
    module.register_mla_backends = hookimpl(lambda register: register(GoodMLA, before="TRITON_MLA"))
    assert add_plugin(module) is True
    sel = select_backend(V3, device="sm90", dtype="float32", kv_cache_dtype="bfloat16")
    assert [v.name for v in sel.verdicts][:3] == ["FLASHINFER_MLA", "GOOD_MLA", "TRITON_MLA"]


@needs_plugins
def test_plugins_load_lazily_and_kernels_are_never_imported():
    code = textwrap.dedent("""
        import sys
        import mla_backends
        assert "mla_backends_example_plugin" not in sys.modules, "plugins loaded at import"
        assert "pluggy" not in sys.modules
        from mla_backends import select_backend
        sel = select_backend("deepseek-v3", device="sm100", kv_cache_dtype="fp8")
        select_backend("deepseek-v3")
        mla_backends.registered_backends()
        assert "mla_backends_example_plugin" in sys.modules, "plugins not loaded on first use"
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "flashinfer"))
        assert not bad, bad
        print(sel.name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "FLASHINFER_MLA_TRTLLM"
