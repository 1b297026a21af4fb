"""Overrides: argument beats MLA_BACKEND, 'auto' means none, forced-but-unfit raises, unknown suggests."""

from __future__ import annotations

import pytest

from mla_backends.core.dims import MLADims
from mla_backends.plugins.registry import BackendName, UnknownBackendError
from selector.select import BackendNotSupportedError, select_backend

V3 = MLADims.deepseek_v3().tensor_parallel(8)


def test_argument_forces_and_takes_the_preferred_page(fakes):
    sel = select_backend(V3, device="sm90", backend="triton_mla")
    assert (sel.name, sel.block_size, sel.forced_by, sel.ladder) == ("TRITON_MLA", 64, "argument", "forced")
    assert [v.name for v in sel.verdicts] == ["TRITON_MLA"] and sel.verdicts[0].selected
    assert "forced by the backend argument" in sel.explain()
    assert select_backend(V3, device="sm90", backend=BackendName.REF_TORCH).name == "REF_TORCH"
    assert select_backend(V3, device="sm90", backend=fakes.get("REF_TORCH")).name == "REF_TORCH"


def test_environment_forces_and_the_argument_beats_it(fakes, monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "Ref_Torch")
    sel = select_backend(V3, device="sm90")
    assert (sel.name, sel.forced_by) == ("REF_TORCH", "MLA_BACKEND")
    assert "forced by the MLA_BACKEND environment variable" in sel.explain()
    sel = select_backend(V3, device="sm90", backend="TRITON_MLA")
    assert (sel.name, sel.forced_by) == ("TRITON_MLA", "argument")


@pytest.mark.parametrize("env", ["auto", "AUTO", " ", ""])
def test_auto_in_the_environment_means_no_override(fakes, monkeypatch, env):
    monkeypatch.setenv("MLA_BACKEND", env)
    sel = select_backend(V3, device="sm90")
    assert (sel.name, sel.forced_by, sel.ladder) == ("FLASHINFER_MLA", None, "sm90/dense")


def test_auto_argument_defers_to_the_environment(fakes, monkeypatch):
    assert select_backend(V3, device="sm90", backend="auto").forced_by is None
    monkeypatch.setenv("MLA_BACKEND", "REF_TORCH")
    assert select_backend(V3, device="sm90", backend="auto").forced_by == "MLA_BACKEND"


def test_forced_but_unfit_raises_with_every_reason(fakes):
    with pytest.raises(BackendNotSupportedError) as info:
        select_backend(V3, device="sm90", backend="FLASHINFER_MLA_XQA", block_size=8, max_query_len=2)
    err = info.value
    assert err.backend == "FLASHINFER_MLA_XQA" and err.forced_by == "argument"
    assert err.reasons == ("compute capability: got SM90; supported SM120, SM121",
                           "page size: got 8; supported 16, 32, 64, 128",
                           "query length: got 2; supported 1 (single-token decode)")
    msg = str(err)
    assert msg.startswith("The forced backend FLASHINFER_MLA_XQA does not fit this request.")
    assert all(str(r) in msg for r in err.reasons) and "no silent fallback" in msg
    assert err.to_dict()["backend"] is None


def test_forced_by_environment_says_how_to_undo(fakes, monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "FLASHINFER_MLA_TRTLLM")
    with pytest.raises(BackendNotSupportedError, match=r"unset MLA_BACKEND \(or set it to 'auto'\)"):
        select_backend(V3, device="cpu")


def test_forced_page_size_mismatch_is_not_papered_over(fakes):
    # forcing a backend with a page size it cannot use raises instead of crashing in the kernel
    with pytest.raises(BackendNotSupportedError) as info:
        select_backend(V3, device="sm100", backend="FLASHINFER_MLA_TRTLLM", block_size=16)
    assert info.value.reasons == ("page size: got 16; supported 32, 64",)


def test_unknown_names_list_the_valid_ones_and_suggest(fakes, monkeypatch):
    with pytest.raises(UnknownBackendError) as info:
        select_backend(V3, device="sm90", backend="flashinfer_mla_trtlm")
    msg = str(info.value)
    assert "backend: got 'flashinfer_mla_trtlm'; supported CPU_FUSED, FLASHINFER_MLA, FLASHINFER_MLA_CUTLASS" in msg
    assert msg.endswith("(did you mean FLASHINFER_MLA_TRTLLM?)")
    assert isinstance(info.value, ValueError)
    monkeypatch.setenv("MLA_BACKEND", "tritonmla")
    with pytest.raises(UnknownBackendError,
                       match=r"^MLA_BACKEND environment variable: .*did you mean TRITON_MLA"):
        select_backend(V3, device="sm90")
