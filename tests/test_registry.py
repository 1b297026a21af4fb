"""The registry: built-in names, lookup, validation of registrations, placements, real built-ins."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from selector_fakes import FakeTriton, FakeXqa, fake_registry

from mla_backends.backends.contract import Capabilities, MLABackend
from mla_backends.plugins.loading import _NotBuilt, _resolve, get_backend, load_registry, registered_backends
from mla_backends.plugins.registry import (
    BackendName,
    Placement,
    RegistrationError,
    Registry,
    UnknownBackendError,
    validate_backend_class,
)
from mla_backends.ref_torch import RefTorchBackend
from selector.select import select_backend


def test_enum_names_and_case_insensitive_input():
    assert [m.value for m in BackendName] == ["REF_TORCH", "CPU_FUSED", "TRITON_MLA", "FLASHINFER_MLA",
                                              "FLASHINFER_MLA_CUTLASS", "FLASHINFER_MLA_TRTLLM",
                                              "FLASHINFER_MLA_XQA"]
    assert BackendName("triton_mla") is BackendName.TRITON_MLA
    assert BackendName(" Flashinfer_MLA_xqa ") is BackendName.FLASHINFER_MLA_XQA
    with pytest.raises(ValueError):
        BackendName("nope")


def test_builtins_register_through_the_hook():
    reg = load_registry(autoload=False)
    assert reg.plugins == ("builtin",)
    assert set(reg.names()) == {m.value for m in BackendName}, reg.problems
    assert all(e.source == "builtin" and e.placement is None for e in reg.entries())
    assert reg.get("ref_torch") is RefTorchBackend and reg.problems == ()


def test_module_level_lookup():
    assert get_backend("REF_TORCH") is RefTorchBackend
    assert get_backend(BackendName.REF_TORCH) is RefTorchBackend
    assert get_backend(RefTorchBackend) is RefTorchBackend
    assert registered_backends()["REF_TORCH"] is RefTorchBackend
    with pytest.raises(TypeError, match="backend: got int"):
        get_backend(3)


def test_unknown_name_lists_names_and_suggests():
    reg = fake_registry()
    with pytest.raises(UnknownBackendError) as info:
        reg.get("REF_TORH")
    assert str(info.value) == ("backend: got 'REF_TORH'; supported CPU_FUSED, FLASHINFER_MLA, "
                               "FLASHINFER_MLA_CUTLASS, FLASHINFER_MLA_TRTLLM, FLASHINFER_MLA_XQA, REF_TORCH, "
                               "TRITON_MLA (did you mean REF_TORCH?)")
    with pytest.raises(UnknownBackendError, match="the built-in TRITON_MLA is not registered"):
        fake_registry(RefTorchBackend).get("triton_mla")
    with pytest.raises(UnknownBackendError) as info:
        reg.get("zzzz")
    assert "did you mean" not in str(info.value)


class NoKernel(MLABackend):
    name: ClassVar[str] = "NO_KERNEL"
    capabilities = FakeXqa.capabilities


def test_validation_of_backend_classes():
    assert validate_backend_class(FakeXqa) == []
    assert validate_backend_class(object) == [
        "backend: got <class 'object'>; supported an MLABackend subclass"]
    assert validate_backend_class(NoKernel) == ["forward_mqa_kernel: got the abstract base method; supported an "
                                                "implementation"]
    bad_caps = type("BAD_CAPS", (FakeXqa,), {"name": "BAD_CAPS", "capabilities": {"dtypes": "bf16"}})
    assert validate_backend_class(bad_caps) == ["capabilities: got dict; supported a Capabilities instance"]
    # a declaration mutated after validation (frozen dataclasses can be forced) is still caught
    caps = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}), cpu=True)
    object.__setattr__(caps, "preferred_page_size", 0)
    mutated = type("MUTATED", (FakeXqa,), {"name": "MUTATED", "capabilities": caps})
    assert validate_backend_class(mutated) == [
        "capabilities: preferred_page_size: got 0; supported a positive int"]
    unnamed = type("Unnamed", (FakeXqa,), {"name": "has space"})
    assert validate_backend_class(unnamed)[0].startswith("name: got 'has space'")


def test_capabilities_reject_non_canonical_cache_dtype_names():
    """An alias ('bf16'), 'auto' or an unknown name could never match the storage name a spec resolves to."""
    for bad in ("bf16", "fp8", "FLOAT16", "int8", "auto", None):
        with pytest.raises(ValueError, match=f"kv_cache_dtypes: got {bad!r}; supported canonical names bfloat16"):
            Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16", bad}), cpu=True)
    caps = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"fp8_e4m3"}), cpu=True)
    assert caps.kv_cache_dtypes == {"fp8_e4m3"}


def test_classes_passed_directly_are_validated():
    """``get(cls)`` accepts an unregistered class but checks it as ``add`` would, before anything uses it."""
    reg = fake_registry()
    assert reg.get(FakeXqa) is FakeXqa
    with pytest.raises(ValueError, match="backend MLABackend: name: got 'ABSTRACT'.*capabilities: got NoneType"):
        reg.get(MLABackend)
    with pytest.raises(ValueError, match="backend NoKernel: forward_mqa_kernel: got the abstract base method"):
        reg.get(NoKernel)
    with pytest.raises(ValueError, match="backend MLABackend: name: got 'ABSTRACT'"):
        select_backend("v3", device="cpu", backend=MLABackend)


def test_source_is_kept_per_registry_not_on_the_class():
    a, b = Registry(), Registry()
    a.add(FakeXqa, source="x")
    b.add(FakeXqa, source="y")
    assert a.entry("FLASHINFER_MLA_XQA").source == "x" and b.entry("FLASHINFER_MLA_XQA").source == "y"
    assert not hasattr(FakeXqa, "source")  # the class is not modified by registering it


def test_add_rejects_duplicates_and_mismatched_names():
    reg = fake_registry()
    gen = reg.generation
    dup = type("Dup", (FakeTriton,), {})
    with pytest.raises(RegistrationError, match="name: got 'TRITON_MLA', already registered by 'builtin'"):
        reg.add(dup, source="other")
    with pytest.raises(RegistrationError, match="registered as 'SOMETHING_ELSE'"):
        reg.add(type("X_MLA", (FakeXqa,), {"name": "X_MLA"}), source="p", name="SOMETHING_ELSE")
    assert reg.generation == gen and reg.get("TRITON_MLA") is FakeTriton


@pytest.mark.parametrize("kwargs,text", [
    ({"before": "TRITON_MLA", "after": "REF_TORCH"}, "supported only one"),
    ({"before": "NOT_A_BUILTIN"}, "placement: got 'NOT_A_BUILTIN'; supported a built-in name"),
    ({"archs": ["sm90"]}, "placement: got archs without before/after"),
    ({"before": "TRITON_MLA", "archs": "sm90"}, "archs: got 'sm90'"),
    ({"before": "TRITON_MLA", "archs": ["hopper"]}, r"archs: got \['hopper'\]"),
])
def test_placement_validation(kwargs, text):
    with pytest.raises(RegistrationError, match=text):
        fake_registry().add(type("P_MLA", (FakeXqa,), {"name": "P_MLA"}), source="p", **kwargs)


def test_placement_applies_to_families_or_single_archs():
    p = Placement(before="TRITON_MLA", archs=frozenset({"sm90", "sm86"}))
    assert p.applies_to("sm90", "sm90") and p.applies_to("sm80", "sm86") and not p.applies_to("sm80", "sm80")
    assert Placement(after="REF_TORCH").applies_to("cpu", "cpu")
    assert p.describe() == "before TRITON_MLA on sm86, sm90"


def test_import_path_targets():
    assert _resolve("mla_backends.ref_torch:RefTorchBackend") is RefTorchBackend
    with pytest.raises(_NotBuilt):
        _resolve("mla_backends.not_written_yet:Thing")  # the module itself is absent: "not built"
    with pytest.raises(AttributeError):
        _resolve("mla_backends.ref_torch:NoSuchClass")  # a real error is not hidden
    with pytest.raises(RegistrationError, match="supported a class or 'package.module:ClassName'"):
        _resolve("no_colon_here")


def test_missing_dependency_inside_a_target_is_a_real_error(tmp_path, monkeypatch):
    (tmp_path / "mla_dep_user_xyz.py").write_text("import no_such_dependency_mla_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_mla_xyz"):
        _resolve("mla_dep_user_xyz:Backend")
    (tmp_path / "mla_namespace_xyz").mkdir()  # a folder without __init__.py imports as a namespace package
    with pytest.raises(AttributeError, match="Backend"):
        _resolve("mla_namespace_xyz:Backend")  # a target that names a missing class is a real error there too


def test_registry_is_isolated_per_instance():
    a, b = Registry(), Registry()
    a.add(FakeXqa, source="x")
    assert a.names() == ("FLASHINFER_MLA_XQA",) and b.names() == ()
