"""Fake backends for the selector tests: the real built-ins' declarations, without their packages.

The selector reads declarations, so tests that assert exact choices and reasons use these stand-ins (plus
the real REF_TORCH). Each copies its real backend's ``capabilities`` and rules (so the tests follow what the
real backends declare) but requires no package, so the answers do not depend on what this machine has
installed; tests that patch the package probe use the real classes.
"""

from __future__ import annotations

import dataclasses

from mla_backends.backends.contract import MLABackend
from mla_backends.cpu_fused import CpuFusedBackend
from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
)
from mla_backends.flashinfer_mla._common import FlashInferBackendBase
from mla_backends.plugins.registry import Registry
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.triton_mla import TritonMLABackend


def _fake_of(real: type[MLABackend]) -> type[MLABackend]:
    """A subclass of ``real`` keeping its declarations and rules (``capabilities``, device rule, extra rules)
    but requiring no package: ``requires``/``extra`` are dropped and FlashInfer's installed-version check
    answers "fine" (and CPU_FUSED's build check "built"), so no test depends on what this machine has installed
or built. It never runs a kernel."""

    def forward_mqa_kernel(self, *args, **kwargs):  # never run: the selector only reads declarations
        raise AssertionError("fake backends are for selection tests only")

    body = {"capabilities": dataclasses.replace(real.capabilities, requires=(), extra=None),
            "forward_mqa_kernel": forward_mqa_kernel, "__module__": __name__}
    if issubclass(real, FlashInferBackendBase):
        body["installed_reasons"] = classmethod(lambda cls: [])
    if issubclass(real, CpuFusedBackend):  # as on a machine where `mla-backends build` ran
        body["build_reasons"] = classmethod(lambda cls: [])
    return type("Fake" + real.__name__.removesuffix("Backend"), (real,), body)


FakeCpuFused = _fake_of(CpuFusedBackend)
FakeTriton = _fake_of(TritonMLABackend)
FakeFlashInfer = _fake_of(FlashInferMLABackend)
FakeCutlass = _fake_of(FlashInferCutlassMLABackend)
FakeTrtllm = _fake_of(FlashInferTrtllmMLABackend)
FakeXqa = _fake_of(FlashInferXqaMLABackend)


FAKES: tuple[type[MLABackend], ...] = (RefTorchBackend, FakeCpuFused, FakeTriton, FakeFlashInfer, FakeCutlass,
                                       FakeTrtllm, FakeXqa)


def fake_registry(*classes: type[MLABackend]) -> Registry:
    """A registry holding ``classes`` (default: REF_TORCH and every fake) as if registered by ``builtin``."""
    reg = Registry()
    for cls in classes or FAKES:
        reg.add(cls, source="builtin")
    reg.mark_loaded("builtin")
    return reg


def install(monkeypatch, registry: Registry) -> Registry:
    """Make ``registry`` the process-wide one for a test (restored by monkeypatch), with a clean selector
    state: no ``TRITON_INTERPRET`` (the conftest sets it on CPU machines), no ``MLA_BACKEND``, empty cache."""
    import mla_backends.plugins.loading as reg_mod
    from selector.select import clear_cache

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.setattr(reg_mod, "_REGISTRY", registry)
    clear_cache()
    return registry


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``mla-backends ARGV...`` in-process: ``(exit status, captured stdout)``."""
    from mla_backends.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().out
