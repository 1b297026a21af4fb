"""Names a vLLM/SGLang user knows, product names for --device, uninstalled backends by import path, and the
CLI conventions: --version, env, select's JSON and flags, --context everywhere, tune's stated TP default."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from selector_fakes import FakeCutlass, run_cli

from docgen.selection import render_selection_doc
from mla_backends.cli import build_parser, main
from mla_backends.core.device import parse_device_spec, simulated_gpu
from mla_backends.core.dims import MLADims
from mla_backends.core.gpus import GPU_TABLE
from mla_backends.plugins.aliases import BACKEND_ALIASES, NOT_PROVIDED, alias_target
from mla_backends.plugins.registry import BackendName, Registry, UnknownBackendError
from selector.select import BackendNotSupportedError, select_backend

ROOT = Path(__file__).resolve().parent.parent
DIMS = MLADims.deepseek_v3().tensor_parallel(8)
BROKEN = "mla_backends.testing.broken:LatentScaleBackend"


# ---- aliases ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alias, ours", [
    ("CUTLASS_MLA", "FLASHINFER_MLA_CUTLASS"), ("cutlass_mla", "FLASHINFER_MLA_CUTLASS"),
    ("trtllm_mla", "FLASHINFER_MLA_TRTLLM"), ("flashinfer", "FLASHINFER_MLA"), ("triton", "TRITON_MLA"),
    ("torch_native", "REF_TORCH"), ("Cutlass-MLA", "FLASHINFER_MLA_CUTLASS"),
])
def test_aliases_resolve_everywhere_a_name_is_taken(fakes, monkeypatch, alias, ours):
    from mla_backends.plugins.loading import get_backend
    from mla_backends.testing.suite import resolve_backend

    assert get_backend(alias).name == ours and resolve_backend(alias).name == ours
    assert BackendName(alias) is BackendName(ours)
    device = "sm100" if "FLASHINFER_MLA_" in ours else "sm90"
    sel = select_backend(DIMS, device=device, backend=alias, block_size=64)
    assert sel.name == ours and sel.forced_by == "argument"
    assert any(f"name for {ours}" in n for n in sel.notes)
    monkeypatch.setenv("MLA_BACKEND", alias)
    assert select_backend(DIMS, device=device, block_size=64).name == ours


def test_a_registered_name_wins_over_an_alias():
    class PluginCutlass(FakeCutlass):
        name = "CUTLASS_MLA"

    reg = Registry()
    reg.add(FakeCutlass, source="builtin")
    assert reg.get("cutlass_mla") is FakeCutlass  # the alias, while nothing is registered under the name
    reg.add(PluginCutlass, source="my-plugin")
    assert reg.get("CUTLASS_MLA") is PluginCutlass and reg.get("cutlass_mla") is PluginCutlass
    assert reg.resolve("cutlass_mla").source == "my-plugin"


def test_unknown_names_suggest_and_explain(fakes):
    with pytest.raises(UnknownBackendError, match=r"did you mean FLASHINFER_MLA_TRTLLM\?"):
        select_backend(DIMS, device="sm100", backend="trtllm_ml")
    with pytest.raises(UnknownBackendError, match="FLASHMLA is vLLM's DeepSeek FlashMLA kernel, which this "
                                                  "package does not provide"):
        select_backend(DIMS, device="sm90", backend="FLASHMLA")
    assert alias_target("FLASHMLA") is None and "FLASHMLA" in NOT_PROVIDED


def test_vllm_flashinfer_mla_on_sm100_gets_the_hint(fakes, capsys, monkeypatch):
    with pytest.raises(BackendNotSupportedError) as err:
        select_backend(DIMS, device="sm100", backend="FLASHINFER_MLA")
    text = str(err.value)
    assert "Note: vLLM's FLASHINFER_MLA is FlashInfer's trtllm-gen kernel on SM100, which is " \
           "FLASHINFER_MLA_TRTLLM here" in text
    assert err.value.notes and "FLASHINFER_MLA_TRTLLM" in err.value.notes[0]
    monkeypatch.setenv("MLA_BACKEND", "flashinfer_mla")
    code, out = run_cli(capsys, "select", "--device", "b200", "--json")
    assert code == 2 and "FLASHINFER_MLA_TRTLLM here" in json.loads(out)["notes"][0]
    monkeypatch.delenv("MLA_BACKEND")
    assert select_backend(DIMS, device="sm90", backend="FLASHINFER_MLA").notes == ()  # ours, where it runs


def test_the_correspondence_table_is_generated_from_the_alias_data():
    text = render_selection_doc()
    assert "## Names in vLLM and SGLang" in text
    for a in BACKEND_ALIASES:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{a.ours}` |") and a.note in line)
        for name in (*a.vllm, *a.sglang):
            assert f"`{name}`" in row
    assert "| `FLASHINFER_MLA_TRTLLM` | `FLASHINFER_MLA` (not an alias: see below) | `trtllm_mla` |" in text


# ---- uninstalled backends by import path, and their source label --------------------------------------------
def test_import_paths_select_with_their_source(fakes, capsys, monkeypatch):
    code, out = run_cli(capsys, "select", "--device", "cpu", "--backend", BROKEN, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["backend"] == "BROKEN_LATENT_SCALE"
    assert doc["source"] == doc["candidates"][0]["source"] == f"import path {BROKEN}"
    monkeypatch.setenv("MLA_BACKEND", BROKEN)
    sel = select_backend(DIMS, device="cpu")
    assert sel.forced_by == "MLA_BACKEND" and sel.verdicts[0].source == f"import path {BROKEN}"
    assert f"import path {BROKEN}" in sel.explain()
    # a registered class reached by its path keeps its registered source
    monkeypatch.setenv("MLA_BACKEND", "mla_backends.ref_torch:RefTorchBackend")
    assert select_backend(DIMS, device="cpu").verdicts[0].source == "builtin"
    monkeypatch.setenv("MLA_BACKEND", "no_such_module:Backend")
    with pytest.raises(ValueError, match="MLA_BACKEND environment variable: backend: got 'no_such_module:Backend', "
                                         "which cannot be imported"):
        select_backend(DIMS, device="cpu")


@pytest.mark.parametrize("name, source", [("REF_TORCH", "builtin"), ("torch_native", "builtin"),
                                          (BROKEN, f"import path {BROKEN}")])
def test_conformance_labels_the_source(capsys, monkeypatch, name, source):
    import pytest as pytest_module

    seen = []

    def fake_main(args, plugins=()):  # one test "ran", so the run is a pass
        seen.append(args)
        for plugin in plugins:
            plugin.pytest_runtest_logreport(types.SimpleNamespace(when="call"))
        return 0

    monkeypatch.setattr(pytest_module, "main", fake_main)
    assert main(["conformance", name, "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"source {source})" in out
    expected = name if ":" in name else "REF_TORCH"
    assert f"--conformance-backend={expected}" in seen[0]


# ---- --device product names -----------------------------------------------------------------------------
@pytest.mark.parametrize("row", GPU_TABLE, ids=[g.key for g in GPU_TABLE])
def test_every_gpu_table_product_is_a_device(row):
    dev = parse_device_spec(row.key)
    assert dev.simulated and dev.compute_capability == row.compute_capability
    assert (dev.name, dev.total_memory, dev.sm_count) == (row.name, row.memory_bytes, row.sms)
    assert parse_device_spec(row.key.upper().replace("-", " ")) == dev


def test_product_names_on_the_command_line(fakes, capsys):
    code, out = run_cli(capsys, "select", "--device", "b200", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["device"]["name"] == "NVIDIA B200" and doc["device"]["compute_capability"] == [10, 0]
    assert doc["device"]["total_memory"] == 183_359 * 2**20 and doc["backend"] == "FLASHINFER_MLA_TRTLLM"
    assert run_cli(capsys, "select", "--device", "rtx-pro-6000")[1].startswith(
        "Device:  NVIDIA RTX PRO 6000 Blackwell [SM120] (simulated)")
    # the driver's total (143,771 MiB), as nvidia-smi shows it, not the data sheet's 141 GB (131.3 GiB)
    assert run_cli(capsys, "select", "--device", "h200")[1].startswith(
        "Device:  NVIDIA H200 SXM [SM90] (simulated), 140.4 GiB\n")
    assert main(["select", "--device", "h300"]) == 2
    assert "a GPU product name (a100, " in capsys.readouterr().err
    with pytest.raises(ValueError, match="gpu name: got 'tpu'"):
        simulated_gpu("tpu")


# ---- select: JSON document and flags ------------------------------------------------------------------------
def test_select_json_names_model_tp_and_both_block_sizes(fakes, capsys):
    doc = json.loads(run_cli(capsys, "select", "--device", "sm100", "--tp", "8", "--json")[1])
    assert (doc["model"], doc["tp"], doc["num_heads_per_rank"]) == ("deepseek-v3", 8, 16)
    assert doc["requested_block_size"] is None and doc["block_size"] == 64
    doc = json.loads(run_cli(capsys, "select", "--device", "sm100", "--tp", "8", "--block-size", "16",
                             "--json")[1])
    assert doc["requested_block_size"] == 16 and doc["block_size"] == 16
    code, out = run_cli(capsys, "select", "--device", "sm61", "--block-size", "32", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["requested_block_size"] == 32 and doc["block_size"] is None
    assert doc["model"] == "deepseek-v3" and doc["tp"] == 1


def test_select_need_lse_and_uniform_query_len(fakes, capsys):
    # cutlass returns no LSE: asked for it, the sm100 ladder at 128 heads passes it over
    doc = json.loads(run_cli(capsys, "select", "--device", "sm100", "--block-size", "128", "--json")[1])
    assert doc["backend"] == "FLASHINFER_MLA_CUTLASS" and doc["request"]["need_lse"] is False
    doc = json.loads(run_cli(capsys, "select", "--device", "sm100", "--block-size", "128", "--need-lse",
                             "--json")[1])
    assert doc["backend"] != "FLASHINFER_MLA_CUTLASS" and doc["request"]["need_lse"] is True
    cutlass = next(c for c in doc["candidates"] if c["name"] == "FLASHINFER_MLA_CUTLASS")
    assert "LSE: got a request for it; supported output only (no LSE)" in cutlass["reasons"]
    doc = json.loads(run_cli(capsys, "select", "--device", "cpu", "--max-query-len", "4",
                             "--no-uniform-query-len", "--json")[1])
    assert doc["request"]["uniform_query_len"] is False
    assert build_parser().parse_args(["select"]).uniform_query_len is True


# ---- --context, tune's TP default, --version, env ----------------------------------------------------------
def test_context_is_one_flag_taking_one_or_a_list():
    parser = build_parser()
    for argv in (["tune", "--context", "64,256"], ["crossover", "--context", "64,256"],
                 ["kv-cache", "--context", "64,256"], ["demo", "--context", "64,256"]):
        assert parser.parse_args(argv).context == [64, 256], argv
        assert parser.parse_args([argv[0], "--context", "64"]).context == [64], argv
    assert parser.parse_args(["tune", "--contexts", "8,16"]).context == [8, 16]  # the old spelling still works


def test_tune_help_hides_the_old_spelling_and_states_the_tp_default(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--contexts" not in out and "--context S[,S...]" in out
    assert "tune defaults to 8" in out and "(default 8)" in out


def test_tune_output_says_the_tp_was_the_default(capsys):
    argv = ["tune", "--model", "deepseek-v2-lite", "--backend", "REF_TORCH", "--quick", "--query-lens", "1",
            "--context", "8", "--no-progress"]
    assert main(argv) == 0
    assert "at TP=8 (tune's default --tp; --tp 1 times every head)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tp_is_default"] is True
    assert main([*argv, "--tp", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tp_is_default"] is False


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"mla-backends {version('mla-backends')} (Python ")


class _Mem:
    total = 141 * 10**9


def _fake_nvml() -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.nvmlInit = mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: 2
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: ["NVIDIA H200", "NVIDIA B200"][h]
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: [(9, 0), (10, 0)][h]
    mod.nvmlDeviceGetMemoryInfo = lambda h: _Mem()
    return mod


def test_env_reports_versions_gpus_plugins_and_variables(capsys, monkeypatch):
    from selector.detect import clear_device_cache

    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("MLA_BACKEND", "triton")
    clear_device_cache()
    try:
        code, out = run_cli(capsys, "env", "--json")
        rep = json.loads(out)
        text = run_cli(capsys, "env")[1]
    finally:
        clear_device_cache()
    assert code == 0 and set(rep["packages"]) == {"mla-backends", "torch", "triton", "flashinfer", "pynvml",
                                                 "transformers", "safetensors"}
    assert rep["packages"]["torch"]["version"] and rep["python"]["version"] == ".".join(
        map(str, sys.version_info[:3]))
    assert [(g["name"], g["compute_capability"], g["total_memory"], g["gpu_table_key"]) for g in rep["gpus"]] == [
        ("NVIDIA H200", [9, 0], 141 * 10**9, "h200"), ("NVIDIA B200", [10, 0], 141 * 10**9, "b200")]
    assert rep["plugins"][0] == {"plugin": "builtin", "backends": [m.value for m in BackendName]}
    assert rep["environment"]["MLA_BACKEND"]["value"] == "triton"
    assert rep["environment"]["TRITON_INTERPRET"]["effect"]
    assert "cuda:1  NVIDIA B200  SM100  131.3 GiB" in text and "MLA_BACKEND=triton" in text


def test_env_never_imports_triton_or_flashinfer():
    code = ("import json, sys; from mla_backends.cli import main; main(['env', '--json']); "
            "print(json.dumps(sorted(m for m in ('triton', 'flashinfer', 'transformers') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []
