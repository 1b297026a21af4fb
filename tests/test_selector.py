"""select_backend on simulated devices: choices, exact reasons, page-size notes, failures, cache, threads."""

from __future__ import annotations

import threading

import pytest
import torch
from selector_fakes import FakeTrtllm, FakeXqa, fake_registry, install

from mla_backends.backends.contract import Capabilities
from mla_backends.core.dims import MLADims
from mla_backends.ref_torch import RefTorchBackend
from selector.select import NoBackendError, Selection, clear_cache, select_backend

V3_TP8 = MLADims.deepseek_v3().tensor_parallel(8)  # 16 heads per rank

ARCHS = ["sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "cpu"]
PAGES = [None, 16, 32, 64, 128]

# the ladder each case walks (fakes registry: every built-in name is registered)
LADDER = {
    ("sm80", "auto"): ["FLASHINFER_MLA", "TRITON_MLA", "REF_TORCH"],
    ("sm80", "fp8"): ["TRITON_MLA", "REF_TORCH"],
    ("sm90", "auto"): ["FLASHINFER_MLA", "TRITON_MLA", "REF_TORCH"],
    ("sm90", "fp8"): ["FLASHINFER_MLA", "TRITON_MLA", "REF_TORCH"],
    ("sm100", "auto"): ["FLASHINFER_MLA_TRTLLM", "FLASHINFER_MLA_CUTLASS", "TRITON_MLA", "REF_TORCH"],
    ("sm100", "fp8"): ["FLASHINFER_MLA_TRTLLM", "TRITON_MLA", "REF_TORCH"],
    ("sm120", "auto"): ["FLASHINFER_MLA_XQA", "TRITON_MLA", "REF_TORCH"],
    ("sm120", "fp8"): ["FLASHINFER_MLA_XQA", "TRITON_MLA", "REF_TORCH"],
    ("cpu", "auto"): ["CPU_FUSED", "REF_TORCH"],
    ("cpu", "fp8"): ["CPU_FUSED", "REF_TORCH"],
}
FAMILY = {"sm80": "sm80", "sm86": "sm80", "sm89": "sm80", "sm90": "sm90", "sm100": "sm100", "sm103": "sm100",
          "sm120": "sm120", "cpu": "cpu"}


def expected_choice(arch: str, kv: str, page: int | None) -> tuple[str, int]:
    """The documented outcome for V3 at TP=8, bf16, single-token decode."""
    trtllm_page_ok = page in (None, 32, 64)
    if arch == "cpu":  # the fakes' CPU_FUSED is built (any page size, bf16, fp8)
        return "CPU_FUSED", page or 16
    if arch in ("sm80", "sm86"):
        return ("FLASHINFER_MLA", page or 64) if kv == "auto" else ("REF_TORCH", page or 16)
    if arch == "sm89":
        return ("FLASHINFER_MLA" if kv == "auto" else "TRITON_MLA"), page or 64
    if arch == "sm90":
        return "FLASHINFER_MLA", page or 64
    if arch in ("sm100", "sm103"):
        if trtllm_page_ok:
            return "FLASHINFER_MLA_TRTLLM", page or 64
        return ("FLASHINFER_MLA_CUTLASS" if kv == "auto" else "TRITON_MLA"), page
    # sm120: XQA takes every page size of the matrix (16, 32, 64, 128)
    return "FLASHINFER_MLA_XQA", page or 64


def expected_rejections(arch: str, kv: str, page: int | None) -> dict[str, list[str]]:
    """Every rejected candidate and its exact reasons, written out from the declarations' rules."""
    out: dict[str, list[str]] = {}
    if kv == "fp8" and arch in ("sm80", "sm86"):
        out["TRITON_MLA"] = [f"fp8 cache: got {arch.upper()}; supported SM89+ (native fp8 conversion)"]
    if arch in ("sm100", "sm103") and page in (16, 128):
        out["FLASHINFER_MLA_TRTLLM"] = [f"page size: got {page}; supported 32, 64"]
    return out


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_simulated_matrix_choice_and_exact_reasons(fakes, arch, kv, page):
    sel = select_backend(V3_TP8, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3" if kv == "fp8" else "auto",
                         block_size=page, device=arch)
    name, block = expected_choice(arch, kv, page)
    assert (sel.name, sel.block_size) == (name, block)
    assert sel.backend is fakes.get(name)
    assert sel.spec.block_size == block and sel.device.arch_label == arch
    assert [v.name for v in sel.verdicts] == LADDER[(FAMILY[arch], kv)]
    rejected = {v.name: list(v.reasons) for v in sel.verdicts if v.reasons}
    assert rejected == expected_rejections(arch, kv, page)
    assert [v.name for v in sel.verdicts if v.selected] == [name]
    # a page size that knocked out a higher-ranked backend is named, and only then
    knocked = [v for v in sel.verdicts if v.page_size_hint is not None]
    if page in (16, 128) and FAMILY[arch] == "sm100":
        assert [(v.name, v.page_size_hint) for v in knocked] == [(sel.verdicts[0].name, 64)]
        assert f"rejected only because of block_size={page}; block_size=64 would select it" in sel.explain()
    else:
        assert knocked == []
        assert "would select it" not in sel.explain()


def test_explain_table_lists_every_candidate_and_reason(fakes):
    sel = select_backend(V3_TP8, dtype="bfloat16", block_size=16, device="sm100")
    text = sel.explain()
    lines = text.splitlines()
    assert lines[0].startswith("Device:  NVIDIA B200 / GB200 [SM100] (simulated)")
    assert "page size 16" in lines[1] and "16 heads" in lines[1]
    assert lines[2] == "Ladder:  sm100/dense"
    row = next(line for line in lines if "FLASHINFER_MLA_TRTLLM" in line)
    assert "rejected" in row and row.endswith("page size: got 16; supported 32, 64")
    assert any("FLASHINFER_MLA_CUTLASS" in line and "SELECTED" in line for line in lines)
    assert "Chosen: FLASHINFER_MLA_CUTLASS, block_size 16 (as requested)" in text
    none_given = select_backend(V3_TP8, device="sm100").explain()
    assert "Chosen: FLASHINFER_MLA_TRTLLM, block_size 64 (its preferred page size)" in none_given


def test_to_dict_has_the_documented_shape(fakes):
    doc = select_backend(V3_TP8, device="sm120", kv_cache_dtype="fp8").to_dict()
    assert doc["backend"] == "FLASHINFER_MLA_XQA" and doc["block_size"] == 64
    assert doc["device"]["compute_capability"] == [12, 0] and doc["device"]["simulated"] is True
    assert [c["name"] for c in doc["candidates"]] == ["FLASHINFER_MLA_XQA", "TRITON_MLA", "REF_TORCH"]
    assert [c["selected"] for c in doc["candidates"]] == [True, False, False]
    assert all(isinstance(c["reasons"], list) for c in doc["candidates"])


def test_sparse_uses_the_sparse_ladder(fakes):
    sel = select_backend(V3_TP8, device="sm100", sparse=True)
    assert [v.name for v in sel.verdicts] == ["TRITON_MLA", "REF_TORCH"] and sel.name == "TRITON_MLA"
    assert sel.ladder == "sm100/sparse"
    assert select_backend(V3_TP8, device="sm80", sparse=True, kv_cache_dtype="fp8").name == "REF_TORCH"


def test_request_fields_reach_the_checks(fakes):
    # a prefill-sized query rules out the single-token kernels; needing the LSE rules out cutlass/xqa
    sel = select_backend(V3_TP8, device="sm120", max_query_len=4, uniform_query_len=False)
    assert sel.name == "TRITON_MLA"
    assert sel.verdicts[0].reasons == ("query length: got 4; supported 1 (single-token decode)",)
    sel = select_backend(V3_TP8, device="sm100", block_size=16, need_lse=True)
    assert sel.name == "TRITON_MLA"
    assert "LSE: got a request for it; supported output only (no LSE)" in sel.verdicts[1].reasons


# ---- no backend fits ------------------------------------------------------------------------------------
def test_no_backend_lists_every_reason_and_a_page_size_hint(monkeypatch):
    install(monkeypatch, fake_registry(FakeTrtllm))  # TRITON/REF not registered here
    with pytest.raises(NoBackendError) as info:
        select_backend(V3_TP8, device="sm100", kv_cache_dtype="fp8", block_size=16)
    err = info.value
    assert err.hint == "use block_size=64 (or leave it unset) to run FLASHINFER_MLA_TRTLLM."
    msg = str(err)
    assert msg.startswith("No MLA backend fits this request.")
    assert "page size: got 16; supported 32, 64" in msg
    assert msg.count("registry: got no backend registered under this name") == 2
    assert msg.rstrip().endswith("Hint: " + err.hint)
    assert [v.name for v in err.verdicts] == ["FLASHINFER_MLA_TRTLLM", "TRITON_MLA", "REF_TORCH"]


def test_no_backend_hint_names_the_extra_when_only_a_package_is_missing(monkeypatch):
    class NeedsPkg(RefTorchBackend):  # not a FlashInfer class: its own package reason, not FlashInfer's
        name = "FLASHINFER_MLA"
        capabilities = Capabilities(dtypes=frozenset({torch.bfloat16}),
                                    kv_cache_dtypes=frozenset({"bfloat16"}),
                                    compute_capabilities=frozenset({(9, 0)}),
                                    requires=("no_such_pkg_mla_xyz",), extra="flashinfer")

    install(monkeypatch, fake_registry(NeedsPkg))
    with pytest.raises(NoBackendError) as info:
        select_backend(V3_TP8, device="sm90")
    assert info.value.hint == "pip install 'mla-backends[flashinfer]' to enable FLASHINFER_MLA."
    assert ("package: got no_such_pkg_mla_xyz not installed; supported with it installed: "
            "pip install 'mla-backends[flashinfer]'") in info.value.verdicts[0].reasons


def test_no_backend_hint_suggests_a_dtype(monkeypatch):
    install(monkeypatch, fake_registry(FakeXqa))
    with pytest.raises(NoBackendError) as info:
        select_backend(V3_TP8, device="sm120", dtype="float16")
    assert info.value.hint == "use dtype=bfloat16 to run FLASHINFER_MLA_XQA."


def test_no_backend_on_a_gpu_below_every_minimum(monkeypatch):
    install(monkeypatch, fake_registry())
    with pytest.raises(NoBackendError) as info:
        select_backend(V3_TP8, device="sm61")
    assert info.value.verdicts[0].reasons == ("compute capability: got SM61; supported SM70+",)
    assert "device='cpu'" in info.value.hint


def test_a_crashing_capability_check_becomes_a_reason(monkeypatch):
    class Crashes(FakeXqa):
        @classmethod
        def not_supported_reasons(cls, spec):
            raise KeyError("boom")

    install(monkeypatch, fake_registry(Crashes, RefTorchBackend))
    sel = select_backend(V3_TP8, device="sm120")
    assert sel.name == "REF_TORCH"
    assert sel.verdicts[0].reasons == ("capability check: got KeyError: 'boom'; supported a check that "
                                       "returns reasons",)


# ---- input validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,text", [
    ({"dims": 3}, TypeError, "dims: got int"),
    ({"dims": "gpt2"}, ValueError, "preset: got 'gpt2'"),
    ({"dtype": "int8"}, ValueError, "dtype: got 'int8'"),
    ({"kv_cache_dtype": "int4"}, ValueError, "kv_cache_dtype: got 'int4'"),
    ({"block_size": 0}, ValueError, "block_size: got 0; supported >= 1"),
    ({"block_size": 16.0}, TypeError, "block_size: got float"),
    ({"max_query_len": 0}, ValueError, "max_query_len: got 0"),
    ({"sparse": 1}, TypeError, "sparse: got int; supported bool"),
    ({"device": "tpu"}, ValueError, "device: got 'tpu'"),
    ({"backend": 3}, TypeError, "backend: got int"),
])
def test_malformed_arguments_are_named(fakes, kwargs, exc, text):
    args = {"dims": V3_TP8, **kwargs}
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
        select_backend(args.pop("dims"), **args)


# ---- cache and threads ----------------------------------------------------------------------------------
def test_results_are_cached_per_request_device_and_environment(fakes, monkeypatch):
    a = select_backend(V3_TP8, device="sm90")
    assert select_backend(V3_TP8, device="sm90") is a
    assert select_backend(V3_TP8, device="sm90", block_size=32) is not a
    assert select_backend(V3_TP8, device="sm100") is not a
    monkeypatch.setenv("MLA_BACKEND", "REF_TORCH")
    forced = select_backend(V3_TP8, device="sm90")
    assert forced.name == "REF_TORCH" and forced.forced_by == "MLA_BACKEND"
    monkeypatch.delenv("MLA_BACKEND")
    assert select_backend(V3_TP8, device="sm90") is a
    clear_cache()
    b = select_backend(V3_TP8, device="sm90")
    assert b is not a and b == a
    gen = fakes.generation
    fakes.add(type("LATE_MLA", (FakeXqa,), {"name": "LATE_MLA"}), source="late", before="FLASHINFER_MLA")
    assert fakes.generation > gen
    c = select_backend(V3_TP8, device="sm90")
    assert c is not b and [v.name for v in c.verdicts][:2] == ["LATE_MLA", "FLASHINFER_MLA"]


def test_sixteen_threads_get_one_consistent_answer(monkeypatch):
    import mla_backends.plugins.loading as reg_mod

    install(monkeypatch, fake_registry())
    monkeypatch.setattr(reg_mod, "_REGISTRY", None)  # threads race to load the real registry too
    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", "1")
    cases = [("sm90", None), ("sm100", 16), ("sm120", 32), ("cpu", None)]
    results: list[list[Selection]] = [[] for _ in range(16)]
    barrier = threading.Barrier(16)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(20):
            for dev, page in cases:
                results[i].append(select_backend(V3_TP8, device=dev, block_size=page))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = results[0]
    for res in results:
        assert len(res) == len(first)
        assert all(a is b for a, b in zip(res, first, strict=True))  # the very same cached Selection objects
    assert first[3].name == "CPU_FUSED" and first[1].block_size == 16
    assert reg_mod._REGISTRY.plugins == ("builtin",)  # loaded exactly once


def test_the_cache_key_includes_the_cache_dtype(fakes):
    bf16 = select_backend(V3_TP8, device="sm80")
    fp8 = select_backend(V3_TP8, device="sm80", kv_cache_dtype="fp8_e4m3")
    assert bf16.name == "FLASHINFER_MLA" and bf16.ladder == "sm80/dense"
    assert fp8.name == "REF_TORCH" and fp8.ladder == "sm80/dense, fp8 cache"
    assert fp8.spec.kv_cache_dtype == "fp8_e4m3"


def test_page_size_hints_are_kept_only_above_the_chosen_backend(fakes):
    # LATE_MLA ranks below the winner and only its page size is wrong: no hint for it
    fakes.add(type("LATE_MLA", (FakeTrtllm,), {"name": "LATE_MLA"}), source="late", after="TRITON_MLA")
    sel = select_backend(V3_TP8, device="sm100", block_size=16)
    hints = {v.name: v.page_size_hint for v in sel.verdicts}
    assert sel.name == "FLASHINFER_MLA_CUTLASS"
    assert "LATE_MLA" in hints and hints["LATE_MLA"] is None
    assert hints["FLASHINFER_MLA_TRTLLM"] == 64


@pytest.mark.parametrize(("arch", "fits"), [("sm75", False), ("sm80", True), ("sm90", True), ("sm100", False)])
def test_min_and_max_compute_capability_are_inclusive_bounds(arch, fits):
    from mla_backends.backends.contract import AttentionSpec
    from selector.detect import resolve_device

    class Bounded(FakeXqa):
        capabilities = Capabilities(dtypes=frozenset({torch.bfloat16}),
                                    kv_cache_dtypes=frozenset({"bfloat16"}),
                                    min_compute_capability=(8, 0), max_compute_capability=(9, 0))

    reasons = Bounded.device_reasons(resolve_device(arch))
    assert reasons == ([] if fits else [f"compute capability: got {arch.upper()}; supported SM80..SM90"])
    spec = AttentionSpec(num_heads=16, device=resolve_device(arch))
    assert (Bounded.not_supported_reasons(spec) == []) is fits
