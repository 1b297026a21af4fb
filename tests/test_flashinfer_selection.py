"""Selection-time behaviour of the FlashInfer backends (CPU only; no flashinfer import needed).

Every backend is rejected on the CPU and on the wrong architectures with exact reasons; the rules the
declarative capabilities cannot express (heads for trtllm-gen, fp8 only on SM90 with bf16 queries for fa3,
cache dtype equal to the query dtype) produce their reasons; the installed flashinfer-python version is
checked against the tested range; a missing package becomes a reason, never an exception; and the
selector's SM80/SM90/SM100/SM110/SM120 choices include these backends where their rules allow.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util

import pytest
import torch

from mla_backends.backends.contract import AttentionSpec
from mla_backends.core.device import CPU_DEVICE, DeviceInfo, simulated_device
from mla_backends.core.dims import MLADims
from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
    _install,
)
from selector import select

FA, CUTLASS, TRTLLM, XQA = (FlashInferMLABackend, FlashInferCutlassMLABackend, FlashInferTrtllmMLABackend,
                            FlashInferXqaMLABackend)
ALL = (FA, CUTLASS, TRTLLM, XQA)


def sm(major: int, minor: int = 0) -> DeviceInfo:
    return simulated_device(major, minor)


def spec(device: DeviceInfo, **kw) -> AttentionSpec:
    kw.setdefault("num_heads", 16)
    kw.setdefault("block_size", 64)
    return AttentionSpec(device=device, **kw)


# ---- devices --------------------------------------------------------------------------------------------
CPU_REASONS = {
    FA: "device: got CPU; supported a CUDA device (SM80, SM86, SM89, SM90)",
    CUTLASS: "device: got CPU; supported a CUDA device (SM100, SM103, SM110)",
    TRTLLM: "device: got CPU; supported a CUDA device (SM100, SM103)",
    XQA: "device: got CPU; supported a CUDA device (SM120, SM121)",
}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_rejected_on_cpu_with_the_base_device_reason(cls):
    assert cls.not_supported_reasons(spec(CPU_DEVICE)) == [CPU_REASONS[cls]]
    assert cls.device_reasons(CPU_DEVICE) == [CPU_REASONS[cls]]


ARCHS = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]
FITS = {
    FA: {(8, 0), (8, 6), (8, 9), (9, 0)},
    CUTLASS: {(10, 0), (10, 3), (11, 0)},
    TRTLLM: {(10, 0), (10, 3)},
    XQA: {(12, 0), (12, 1)},
}
SUPPORTED_TEXT = {FA: "SM80, SM86, SM89, SM90", CUTLASS: "SM100, SM103, SM110", TRTLLM: "SM100, SM103",
                  XQA: "SM120, SM121"}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_architectures(cls, cc):
    reasons = cls.not_supported_reasons(spec(sm(*cc)))
    if cc in FITS[cls]:
        assert reasons == []
    else:
        assert reasons == [f"compute capability: got SM{cc[0]}{cc[1]}; supported {SUPPORTED_TEXT[cls]}"]


# ---- per-backend rules ----------------------------------------------------------------------------------
def test_fa_fp8_only_on_sm90_with_bf16_queries():
    assert FA.not_supported_reasons(spec(sm(9), kv_cache_dtype="fp8_e4m3")) == []
    assert FA.not_supported_reasons(spec(sm(8, 9), kv_cache_dtype="fp8_e4m3")) == [
        "fp8 cache: got SM89; supported SM90 only (FlashInfer's fa3 fp8 path)"]
    assert FA.not_supported_reasons(spec(sm(9), dtype=torch.float16, kv_cache_dtype="fp8_e4m3")) == [
        "fp8 cache: got float16 queries; supported bfloat16 queries"]
    assert FA.not_supported_reasons(spec(sm(9), kv_cache_dtype="fp8_e5m2")) == [
        "kv cache dtype: got fp8_e5m2; supported bfloat16, float16, fp8_e4m3"]


def test_fa_accepts_any_page_and_varlen_and_lse_but_not_fp32_or_sparse():
    s = spec(sm(8), block_size=1, max_query_len=7, uniform_query_len=False, need_lse=True, num_heads=128)
    assert FA.not_supported_reasons(s) == []
    assert FA.not_supported_reasons(spec(sm(9), dtype=torch.float32)) == [
        "dtype: got float32; supported bfloat16, float16", "kv cache dtype: got float32; supported bfloat16, "
        "float16, fp8_e4m3"]
    assert FA.not_supported_reasons(spec(sm(9), sparse=True)) == [
        "attention: got sparse (top-k indices); supported dense only"]


@pytest.mark.parametrize("cls,device,fp8_text", [(FA, sm(9), " or fp8_e4m3"), (CUTLASS, sm(10), "")],
                         ids=["fa", "cutlass"])
def test_cache_dtype_must_match_a_16_bit_query(cls, device, fp8_text):
    assert cls.not_supported_reasons(spec(device, dtype=torch.bfloat16, kv_cache_dtype="float16")) == [
        f"kv cache dtype: got float16 with bfloat16 queries; supported the query dtype (bfloat16){fp8_text}"]


def test_cutlass_rules():
    assert CUTLASS.not_supported_reasons(spec(sm(10), num_heads=128, block_size=128)) == []
    assert CUTLASS.not_supported_reasons(spec(sm(10), num_heads=1, block_size=1)) == []  # padded to 128
    assert CUTLASS.not_supported_reasons(spec(sm(10), num_heads=256)) == [
        "num_heads: got 256; supported <= 128"]
    assert CUTLASS.not_supported_reasons(spec(sm(10), block_size=48)) == [
        "page size: got 48; supported 1, 2, 4, 8, 16, 32, 64, 128"]
    assert CUTLASS.not_supported_reasons(spec(sm(10), need_lse=True)) == [
        "LSE: got a request for it; supported output only (no LSE)"]
    assert CUTLASS.not_supported_reasons(spec(sm(10), max_query_len=2)) == [
        "query length: got 2; supported 1 (single-token decode)"]
    assert CUTLASS.not_supported_reasons(spec(sm(10), kv_cache_dtype="fp8_e4m3")) == [
        "kv cache dtype: got fp8_e4m3; supported bfloat16, float16"]
    assert CUTLASS.capabilities.preferred_page_size == 128


@pytest.mark.parametrize("heads,ok", [(0, False), (1, True), (16, True), (64, True), (65, False), (96, False),
                                      (127, False), (128, True), (129, False)])
def test_trtllm_heads_at_most_64_or_exactly_128(heads, ok):
    reasons = TRTLLM.not_supported_reasons(spec(sm(10), num_heads=heads))
    if ok:
        assert reasons == []
    elif heads > 128:
        assert reasons == [f"num_heads: got {heads}; supported <= 128"]
    else:
        assert reasons == [f"num_heads: got {heads}; supported <= 64 or exactly 128"]


def test_trtllm_rules():
    assert TRTLLM.not_supported_reasons(spec(sm(10, 3), kv_cache_dtype="fp8_e4m3", need_lse=True,
                                             max_query_len=4, block_size=32)) == []
    assert TRTLLM.not_supported_reasons(spec(sm(10), block_size=16)) == [
        "page size: got 16; supported 32, 64"]
    assert TRTLLM.not_supported_reasons(spec(sm(10), max_query_len=3, uniform_query_len=False)) == [
        "query length: got varying lengths per request; supported uniform lengths"]
    assert TRTLLM.not_supported_reasons(spec(sm(10), dtype=torch.float16)) == [
        "dtype: got float16; supported bfloat16", "kv cache dtype: got float16; supported bfloat16, fp8_e4m3"]
    assert TRTLLM.not_supported_reasons(spec(sm(10), kv_lora_rank=256)) == [
        "kv_lora_rank/qk_rope_head_dim: got 256/64; supported 512/64"]


def test_xqa_rules():
    assert XQA.not_supported_reasons(spec(sm(12), kv_cache_dtype="fp8_e4m3", block_size=32)) == []
    assert XQA.not_supported_reasons(spec(sm(12, 1), num_heads=128, block_size=128)) == []
    assert XQA.not_supported_reasons(spec(sm(12), max_query_len=2)) == [
        "query length: got 2; supported 1 (single-token decode)"]
    assert XQA.not_supported_reasons(spec(sm(12), need_lse=True)) == [
        "LSE: got a request for it; supported output only (no LSE)"]
    assert XQA.not_supported_reasons(spec(sm(12), block_size=8)) == [
        "page size: got 8; supported 16, 32, 64, 128"]
    assert XQA.not_supported_reasons(spec(sm(12), dtype=torch.float16, kv_cache_dtype="fp8_e4m3")) == [
        "dtype: got float16; supported bfloat16"]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_declarations(cls):
    caps = cls.capabilities
    assert caps.requires == ("flashinfer",) and caps.extra == "flashinfer"
    assert caps.dims == frozenset({(512, 64)})
    assert caps.cpu is False and caps.sparse is False
    assert caps.returns_lse is (cls in (FA, TRTLLM))
    assert cls.capabilities.page_size_reason(caps.preferred_page_size) is None


# ---- the installed package --------------------------------------------------------------------------------
def test_version_is_read_from_package_metadata_and_inside_the_tested_range():
    _install.clear_caches()
    assert _install.installed_version() == importlib.metadata.version("flashinfer-python")
    assert _install.version_reasons(_install.installed_version()) == []


@pytest.mark.parametrize("version,reason", [
    ("0.7.4", None),
    ("0.7.9.post2", None),
    ("0.7.3", "flashinfer-python version: got 0.7.3; supported >=0.7.4,<0.8.0 (older releases lack the MLA "
              "API used here)"),
    ("0.6.14", "flashinfer-python version: got 0.6.14; supported >=0.7.4,<0.8.0 (older releases lack the MLA "
               "API used here)"),
    ("0.8.0rc1", "flashinfer-python version: got 0.8.0rc1; supported >=0.7.4,<0.8.0 (newer releases are "
                 "untested)"),
    ("1.0.0", "flashinfer-python version: got 1.0.0; supported >=0.7.4,<0.8.0 (newer releases are untested)"),
    ("nightly", "flashinfer-python version: got 'nightly' (unparseable); supported >=0.7.4,<0.8.0"),
])
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_version_outside_tested_range_is_a_reason(monkeypatch, cls, version, reason):
    monkeypatch.setattr(_install, "installed_version", lambda: version)
    device = next(sm(*cc) for cc in ARCHS if cc in FITS[cls])
    reasons = cls.not_supported_reasons(spec(device))
    assert reasons == ([] if reason is None else [reason])
    assert cls.is_available() is (reason is None)


def test_entry_points_are_read_from_the_installed_source():
    for cls in ALL:
        assert cls.entry_points, cls.name
        for path, name in cls.entry_points:
            assert _install.source_defines(path, name), (cls.name, path, name)
    assert not _install.source_defines("decode.py", "no_such_function_in_flashinfer")


def test_missing_entry_point_is_a_reason(monkeypatch):
    monkeypatch.setattr(_install, "source_defines",
                        lambda path, name: name != "xqa_batch_decode_with_kv_cache_mla")
    version = _install.installed_version()
    assert XQA.not_supported_reasons(spec(sm(12))) == [
        f"flashinfer-python {version}: got no xqa_batch_decode_with_kv_cache_mla in flashinfer/decode.py; "
        "supported a release that defines it (>=0.7.4,<0.8.0)"]
    assert TRTLLM.not_supported_reasons(spec(sm(10))) == []


def test_missing_package_is_a_reason_not_an_exception(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for cls in ALL:
        device = next(sm(*cc) for cc in ARCHS if cc in FITS[cls])
        assert cls.not_supported_reasons(spec(device)) == [
            "package: flashinfer-python is not installed: pip install 'mla-backends[flashinfer]'"]
        assert not cls.is_available()
        cpu = cls.not_supported_reasons(spec(CPU_DEVICE))
        assert cpu == ["package: flashinfer-python is not installed: pip install 'mla-backends[flashinfer]'",
                       CPU_REASONS[cls]]


# ---- the selector ---------------------------------------------------------------------------------------


def v3(heads: int | None = None) -> MLADims:
    d = MLADims.preset("deepseek_v3")
    return d if heads is None else dataclasses.replace(d, num_heads=heads)


@pytest.mark.parametrize("device,kwargs,expected", [
    ("sm80", {}, "FLASHINFER_MLA"),
    ("sm86", {"dtype": "float16"}, "FLASHINFER_MLA"),
    ("sm89", {"max_query_len": 8, "uniform_query_len": False, "need_lse": True}, "FLASHINFER_MLA"),
    ("sm90", {}, "FLASHINFER_MLA"),
    ("sm90", {"kv_cache_dtype": "fp8_e4m3"}, "FLASHINFER_MLA"),
    ("sm100", {}, "FLASHINFER_MLA_TRTLLM"),
    ("sm100", {"kv_cache_dtype": "fp8_e4m3", "need_lse": True}, "FLASHINFER_MLA_TRTLLM"),
    ("sm100", {"block_size": 16}, "FLASHINFER_MLA_CUTLASS"),
    ("sm100", {"dims": v3(96)}, "FLASHINFER_MLA_CUTLASS"),
    ("sm103", {"max_query_len": 2}, "FLASHINFER_MLA_TRTLLM"),
    ("sm110", {}, "FLASHINFER_MLA_CUTLASS"),
    ("sm120", {}, "FLASHINFER_MLA_XQA"),
    ("sm120", {"kv_cache_dtype": "fp8_e4m3", "dims": v3(16)}, "FLASHINFER_MLA_XQA"),
    ("sm121", {"block_size": 128}, "FLASHINFER_MLA_XQA"),
])
def test_selector_picks_flashinfer_where_rules_allow(device, kwargs, expected):
    kwargs = dict(kwargs)
    dims = kwargs.pop("dims", v3())
    sel = select.select_backend(dims, device=device, **kwargs)
    assert sel.name == expected
    assert sel.backend.not_supported_reasons(sel.spec) == []


@pytest.mark.parametrize("device,kwargs,not_expected", [
    ("sm100", {"block_size": 16, "need_lse": True}, ("FLASHINFER_MLA_TRTLLM", "FLASHINFER_MLA_CUTLASS")),
    ("sm120", {"max_query_len": 2}, ("FLASHINFER_MLA_XQA",)),
    ("sm89", {"kv_cache_dtype": "fp8_e4m3"}, ("FLASHINFER_MLA",)),
    ("cpu", {}, ("FLASHINFER_MLA",)),
])
def test_selector_falls_back_when_rules_forbid(device, kwargs, not_expected):
    sel = select.select_backend(v3(), device=device, **kwargs)
    assert sel.name not in not_expected
    for v in sel.verdicts:
        if v.name in not_expected:
            assert v.reasons, v


def test_forcing_a_flashinfer_backend_on_the_wrong_device_explains_why():
    with pytest.raises(select.BackendNotSupportedError) as info:
        select.select_backend(v3(), device="sm90", backend="FLASHINFER_MLA_TRTLLM")
    assert "compute capability: got SM90; supported SM100, SM103" in info.value.reasons
