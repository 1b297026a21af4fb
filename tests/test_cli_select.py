"""``mla-backends select`` and ``mla-backends list``: options, JSON format, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from selector_fakes import install, run_cli

from mla_backends.cli import main


def test_select_json_document(fakes, capsys):
    code, out = run_cli(capsys, "select", "--device", "sm100", "--tp", "8", "--block-size", "16", "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["backend"] == "FLASHINFER_MLA_CUTLASS" and doc["block_size"] == 16
    assert doc["device"]["compute_capability"] == [10, 0] and doc["device"]["simulated"] is True
    assert [(c["name"], c["selected"]) for c in doc["candidates"]] == [
        ("FLASHINFER_MLA_TRTLLM", False), ("FLASHINFER_MLA_CUTLASS", True), ("TRITON_MLA", False),
        ("REF_TORCH", False)]
    assert doc["candidates"][0]["reasons"] == ["page size: got 16; supported 32, 64"]
    assert doc["candidates"][0]["page_size_hint"] == 64
    assert doc["request"]["num_heads"] == 16


def test_select_text_output_is_the_explanation(fakes, capsys):
    code, out = run_cli(capsys, "select", "--device", "sm120", "--kv-cache-dtype", "fp8", "--model",
                        "deepseek-v2-lite")
    assert code == 0
    assert out.splitlines()[0] == "Device:  NVIDIA RTX PRO 6000 / RTX 5090 [SM120] (simulated)"
    assert "Chosen: FLASHINFER_MLA_XQA, block_size 64 (its preferred page size)" in out
    assert "kv cache fp8_e4m3" in out


def test_select_exit_2_when_nothing_fits(fakes, capsys):
    code, out = run_cli(capsys, "select", "--device", "sm61", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["backend"] is None and doc["block_size"] is None
    assert doc["candidates"] == [{"name": "REF_TORCH", "source": "builtin", "selected": False, "fits": False,
                                  "reasons": ["compute capability: got SM61; supported SM70+"],
                                  "reason_details": [{"text": "compute capability: got SM61; supported SM70+",
                                                      "kind": "device", "what": "compute capability",
                                                      "got": "SM61", "supported": "SM70+", "hint": None}],
                                  "block_size": 16, "page_size_hint": None}]
    assert "device='cpu'" in doc["hint"]
    code, out = run_cli(capsys, "select", "--device", "sm61")
    assert code == 2 and out.startswith("No MLA backend fits this request.") and "Hint:" in out


def test_select_forced_backend(fakes, capsys, monkeypatch):
    code, out = run_cli(capsys, "select", "--device", "sm90", "--backend", "flashinfer_mla_xqa")
    assert code == 2 and "compute capability: got SM90; supported SM120, SM121" in out
    code, out = run_cli(capsys, "select", "--device", "sm90", "--backend", "triton_mla", "--json")
    assert code == 0 and json.loads(out)["forced_by"] == "argument"
    monkeypatch.setenv("MLA_BACKEND", "REF_TORCH")
    code, out = run_cli(capsys, "select", "--device", "sm90", "--json")
    assert json.loads(out)["backend"] == "REF_TORCH"


def test_select_bad_arguments_exit_2(fakes, capsys):
    assert main(["select", "--device", "tpu"]) == 2
    assert "device: got 'tpu'" in capsys.readouterr().err
    assert main(["select", "--backend", "tritn_mla"]) == 2
    assert "did you mean TRITON_MLA" in capsys.readouterr().err
    # --model and --tp are read as kv-cache/crossover/tune read them, and the errors name the flag
    assert main(["select", "--model", "missing/config.json"]) == 2
    assert "--model: got 'missing/config.json', which does not exist" in capsys.readouterr().err
    assert main(["select", "--tp", "3"]) == 2
    assert "--tp: got 3; supported a positive divisor of the model's 128 heads" in capsys.readouterr().err


def test_select_reads_a_config_json(fakes, capsys, tmp_path: Path):
    cfg = {"model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_size": 7168}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out = run_cli(capsys, "select", "--model", str(path), "--device", "sm90", "--tp", "4", "--json")
    assert code == 0 and json.loads(out)["request"]["num_heads"] == 32


def test_list_shows_backends_and_json(fakes, capsys):
    code, out = run_cli(capsys, "list", "--device", "sm100")
    assert code == 0
    assert "FLASHINFER_MLA_TRTLLM  [builtin]  importable, runs here" in out
    assert "pages: 32, 64 (preferred 64)" in out
    code, out = run_cli(capsys, "list", "--json", "--device", "sm100")
    doc = json.loads(out)
    assert [b["name"] for b in doc["backends"]][:3] == ["REF_TORCH", "CPU_FUSED", "TRITON_MLA"]
    assert doc["device"]["compute_capability"] == [10, 0]


def test_list_says_importable_and_runs_here_separately(fakes, capsys):
    """A backend whose packages are present but whose device is absent is importable and does not run here."""
    code, out = run_cli(capsys, "list", "--device", "cpu")
    assert code == 0
    assert "REF_TORCH  [builtin]  importable, runs here" in out
    assert ("FLASHINFER_MLA_TRTLLM  [builtin]  importable; does not run here: device: got CPU; supported a CUDA "
            "device (SM100, SM103)") in out
    rows = {b["name"]: b for b in json.loads(run_cli(capsys, "list", "--json", "--device", "cpu")[1])["backends"]}
    assert rows["FLASHINFER_MLA"]["importable"] is True and rows["FLASHINFER_MLA"]["runs_here"] is False
    assert rows["FLASHINFER_MLA"]["device_reasons"] == [
        "device: got CPU; supported a CUDA device (SM80, SM86, SM89, SM90)"]
    assert rows["REF_TORCH"]["runs_here"] is True and rows["REF_TORCH"]["device_reasons"] == []


def test_list_json_gives_capabilities_as_data(fakes, capsys):
    rows = {b["name"]: b["capabilities"] for b in json.loads(run_cli(capsys, "list", "--json")[1])["backends"]}
    ref, trt, fi = rows["REF_TORCH"], rows["FLASHINFER_MLA_TRTLLM"], rows["FLASHINFER_MLA"]
    assert ref["cpu"] is True and ref["min_compute_capability"] == [7, 0] and ref["page_sizes"] is None
    assert trt["compute_capabilities"] == [[10, 0], [10, 3]] and trt["page_sizes"] == [32, 64]
    assert trt["preferred_page_size"] == 64 and trt["dims"] == [[512, 64]]
    assert fi["compute_capabilities"] == [[8, 0], [8, 6], [8, 9], [9, 0]] and fi["num_heads"] is None
    assert rows["TRITON_MLA"]["cpu_env_switch"] == "TRITON_INTERPRET"
    assert rows["TRITON_MLA"]["fp8_min_compute_capability"] == [8, 9]
    for caps in rows.values():  # nothing is a display string but the names
        assert isinstance(caps["dtypes"], list) and isinstance(caps["decode_threshold"], int)
        assert isinstance(caps["dense"], bool) and isinstance(caps["returns_lse"], bool)


def test_list_and_select_with_the_real_entry_points(capsys, monkeypatch):
    """Real entry points: the example plugin is listed and selectable, the broken one reported."""
    from importlib.metadata import entry_points

    from mla_backends.plugins.loading import load_registry

    monkeypatch.delenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    install(monkeypatch, load_registry())
    names = {ep.name for ep in entry_points(group="mla_backends")}
    if not {"example", "broken"} <= names:
        pytest.skip("test plugin packages not installed (make install installs them)")
    code, out = run_cli(capsys, "list")
    assert code == 0
    assert "EXAMPLE_MLA  [example]  importable" in out and "ladder: before REF_TORCH on sm100" in out
    assert "plugin 'broken' (import): RuntimeError" in out
    code, out = run_cli(capsys, "select", "--backend", "example_mla", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["backend"] == "EXAMPLE_MLA"
    assert any("plugin 'broken'" in p for p in json.loads(out)["plugin_problems"])
