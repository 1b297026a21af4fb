"""Fake backends for the selector tests: declarations only, mirroring the intended built-in capabilities.

The selector reads declarations, so tests that assert exact choices and reasons use these stand-ins (plus
the real REF_TORCH). They never depend on how the real kernel backends evolve; a few tests check the real
built-ins separately.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from mla_backends.backend import AttentionSpec, Capabilities, MLABackend, QueryLenSupport
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.registry import Registry

BF16_FP16 = frozenset({torch.bfloat16, torch.float16})


class _Fake(MLABackend):
    def forward_mqa(self, *args, **kwargs):  # never run: the selector only reads declarations
        raise AssertionError("fake backends are for selection tests only")


class FakeTriton(_Fake):
    name: ClassVar[str] = "TRITON_MLA"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
        min_compute_capability=(8, 0), fp8_min_compute_capability=(8, 9), preferred_page_size=64,
        sparse=True)

    @classmethod
    def device_reasons(cls, device):
        if not device.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
            return []
        return super().device_reasons(device)


class FakeFlashInfer(_Fake):
    name: ClassVar[str] = "FLASHINFER_MLA"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=BF16_FP16, kv_cache_dtypes=frozenset({"bfloat16", "float16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(8, 0), (8, 6), (8, 9), (9, 0)}), preferred_page_size=64,
        dims=frozenset({(512, 64)}))

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().not_supported_reasons(spec)
        if spec.resolved_kv_cache_dtype == "fp8_e4m3" and spec.device.compute_capability != (9, 0):
            reasons.append(f"fp8 cache: got {spec.device.arch_label.upper()}; supported SM90 only (fa3)")
        return reasons


class FakeCutlass(_Fake):
    name: ClassVar[str] = "FLASHINFER_MLA_CUTLASS"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=BF16_FP16, kv_cache_dtypes=frozenset({"bfloat16", "float16"}),
        compute_capabilities=frozenset({(10, 0), (10, 3), (11, 0)}), page_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
        preferred_page_size=128, dims=frozenset({(512, 64)}), max_num_heads=128,
        query_len=QueryLenSupport.SINGLE, returns_lse=False)


class FakeTrtllm(_Fake):
    name: ClassVar[str] = "FLASHINFER_MLA_TRTLLM"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(10, 0), (10, 3)}), page_sizes=(32, 64), preferred_page_size=64,
        dims=frozenset({(512, 64)}), max_num_heads=128, query_len=QueryLenSupport.UNIFORM)


class FakeXqa(_Fake):
    name: ClassVar[str] = "FLASHINFER_MLA_XQA"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
        compute_capabilities=frozenset({(12, 0), (12, 1)}), page_sizes=(32, 64), preferred_page_size=64,
        dims=frozenset({(512, 64)}), query_len=QueryLenSupport.SINGLE, returns_lse=False)


FAKES: tuple[type[MLABackend], ...] = (RefTorchBackend, FakeTriton, FakeFlashInfer, FakeCutlass, FakeTrtllm,
                                       FakeXqa)


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
    import mla_backends.registry as reg_mod
    from selector.select import clear_cache

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.setattr(reg_mod, "_REGISTRY", registry)
    clear_cache()
    return registry
