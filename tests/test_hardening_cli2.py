"""Issue 28 (items 13-16) and issue 25 (item 4), the command line: a closed stdout ends every command quietly;
``--model`` configs get the layer's field checks; ``tune --output`` is tried before measuring and a failed final
write keeps the measurements; every command words its usage errors ``mla-backends <command>: error:``; a
conformance run that runs no test is not a pass; ``env`` reports transformers against ``patch_model``'s range;
``--version`` and ``import mla_backends`` import no torch."""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from test_dims import DEEPSEEK_V3_CONFIG

from mla_backends.cli import build_parser, main
from mla_backends.cli.pipes import CLOSED_STDOUT_STATUS

ROOT = Path(__file__).resolve().parent.parent
TUNE = ["tune", "--model", "deepseek-v2-lite", "--backend", "REF_TORCH", "--quick", "--query-lens", "1",
        "--context", "8", "--no-progress"]


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, **kwargs)


# ---- 13: a closed stdout -------------------------------------------------------------------------------------
class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone: every write and flush raises what a real closed pipe raises."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("argv", [["list", "--json"], ["list"], ["select", "--json", "--device", "cpu"],
                                  ["select", "--device", "cpu"], ["crossover", "--json"], ["crossover"],
                                  ["kv-cache"], ["kv-cache", "--gpu", "h200", "--tp", "8", "--json"],
                                  ["env"], ["select", "--bogus", "--json"]])
def test_every_command_ends_quietly_when_stdout_is_closed(monkeypatch, argv):
    """Class: output to a pipe whose reader stopped reading (``| head -1``), the JSON error report included."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    monkeypatch.setattr(sys, "stderr", err)
    assert main(argv) == CLOSED_STDOUT_STATUS == 141
    assert err.getvalue() == ""  # no traceback, no "error: BrokenPipeError"


def test_a_real_closed_pipe_ends_quietly_at_interpreter_exit_too():
    """The buffered output flushed at exit must not print ``Exception ignored ... BrokenPipeError``."""
    proc = subprocess.Popen([sys.executable, "-m", "mla_backends", "list", "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    proc.stdout.close()  # the reader goes away before the first write
    try:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 141 and err == "", err[-2000:]
    finally:
        proc.kill()
        proc.stderr.close()


# ---- 14: impossible --model configs ---------------------------------------------------------------------------
@pytest.mark.parametrize("change, field, words", [
    ({"vocab_size": -129280}, "vocab_size", "got -129280; supported an int >= 1"),
    ({"intermediate_size": -1}, "intermediate_size", "got -1; supported an int >= 1"),
    ({"vocab_size": None}, "vocab_size", "missing"),
    ({"intermediate_size": "18432"}, "intermediate_size", "got str '18432'"),
    ({"n_routed_experts": True}, "n_routed_experts", "got bool"),
    ({"n_routed_experts": 256, "moe_intermediate_size": 0}, "moe_intermediate_size", "got 0"),
    ({"n_routed_experts": 256}, "moe_intermediate_size", "missing"),  # once silently 0 bytes per expert
    ({"n_routed_experts": 256, "moe_intermediate_size": 2048, "first_k_dense_replace": -3}, "first_k_dense_replace",
     "got -3"),
])
def test_model_configs_get_the_layers_field_checks(capsys, tmp_path, change, field, words):
    """Class: a config field the deployment sizing reads that is missing, negative or of the wrong kind."""
    config = {k: v for k, v in {**DEEPSEEK_V3_CONFIG, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for fmt in ([], ["--json"]):
        code = main(["kv-cache", "--model", str(path), "--gpu", "h200", "--tp", "8", *fmt])
        out, err = capsys.readouterr()
        assert code == 2 and "Traceback" not in out + err and "KeyError" not in out + err
        message = json.loads(out)["error"]["message"] if fmt else err
        assert f"--model: config.{field}: {words}" in message and str(path) in message, message
    from mla_backends.planning.deployment import ModelShape

    with pytest.raises((TypeError, ValueError), match=f"config.{field}: "):
        ModelShape.from_config(config)


# ---- 15: tune --output ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_table():
    import torch

    from mla_backends import MLADims
    from mla_backends.planning import tuning

    dims = MLADims.preset("deepseek-v2-lite").tensor_parallel(8)
    return tuning.tune(dims, backends=["REF_TORCH"], query_lens=[1], contexts=[8], dtype=torch.float32,
                       device="cpu", repeats=1, progress=False, quick=True)


def test_tune_tries_the_output_path_before_measuring(capsys, monkeypatch, tmp_path):
    from mla_backends.planning import tuning

    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("measured before the --output check"))
    too_long = tmp_path / ("t" * 300 + ".json")
    assert main([*TUNE, "--output", str(too_long)]) == 2
    err = capsys.readouterr().err
    assert "mla-backends tune: error: --output: got" in err and "cannot be written (File name too long)" in err
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("stop after the checks"))
    with pytest.raises(pytest.fail.Exception):
        main([*TUNE, "--output", str(kept)])
    assert kept.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["kept.json"]  # tried, not touched


@pytest.mark.parametrize("beside_fails", [False, True])
def test_a_failed_final_write_keeps_the_measurements(capsys, monkeypatch, tmp_path, tiny_table, beside_fails):
    """The output passed the check, then the write failed (the disk filled): the table goes beside it (or to
    stdout when no file can be written), and the run still fails, saying where the table went."""
    from mla_backends.layer.thresholds import ThresholdTable
    from mla_backends.planning import tuning

    output = tmp_path / "table.json"
    real_save = ThresholdTable.save

    def save(self, path):
        if Path(path) == output or beside_fails:
            raise OSError(28, "No space left on device")
        real_save(self, path)

    monkeypatch.setattr(ThresholdTable, "save", save)
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: tiny_table)
    assert main([*TUNE, "--output", str(output)]) == 2
    out, err = capsys.readouterr()
    assert f"--output: could not write '{output}' (No space left on device)" in err and "Traceback" not in err
    if beside_fails:
        assert "the measured table is printed on stdout" in err
        printed = json.loads(out[out.index("\n{") + 1:])
        assert ThresholdTable.from_dict(printed).to_dict() == tiny_table.to_dict()
        return
    (saved,) = [p for p in tmp_path.iterdir() if p != output]
    assert f"written to {saved} instead" in err and saved.parent == tmp_path
    assert ThresholdTable.load(saved).to_dict() == tiny_table.to_dict()
    assert main([*TUNE, "--output", str(output), "--json"]) == 2  # JSON: one document, the data and the error
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["argument"] == "--output" and "No space left" in doc["error"]["message"]
    assert ThresholdTable.load(doc["saved_to"]).to_dict() == tiny_table.to_dict()
    assert doc["backends"] == tiny_table.to_dict()["backends"]


# ---- 16: error wording ----------------------------------------------------------------------------------------
def _commands() -> list[tuple[str, list[str]]]:
    """Every sub-command with placeholders for its required positionals."""
    out = []
    for name, parser in build_parser().commands.items():
        positionals = [a for a in parser._actions if not a.option_strings and a.required]
        out.append((name, ["REF_TORCH"] * len(positionals)))
    return out


@pytest.mark.parametrize("name, positionals", _commands(), ids=[c for c, _ in _commands()])
def test_every_command_words_an_unknown_option_as_its_own_error(capsys, name, positionals):
    """Class: a usage error reported by the top-level parser, or without what the command accepts."""
    parser = build_parser().commands[name]
    assert main([name, *positionals, "--bogus"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and lines[0].startswith(f"usage: mla-backends {name} "), err
    assert lines[-1].startswith(f"mla-backends {name}: error: unrecognized arguments: --bogus (supported: "), err
    assert all(o in lines[-1] for o in parser.option_names if o.startswith("--")), err
    assert main([name, *positionals, "--bogus", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "ArgumentError" and error["argument"] == "--bogus"
    if "--json" not in parser.option_names:
        assert f"{name} has no JSON output" in error["message"]


def test_conformance_says_it_has_no_json_output(capsys):
    """(A conformance run that runs no test, ``-- --collect-only``: tests/test_hardening_cli.py.)"""
    assert main(["conformance", "REF_TORCH", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["message"].startswith("unrecognized arguments: --json (supported: --help, --quick, --device; "
                                       "conformance has no JSON output")


# ---- issue 25 item 4: env and --version ---------------------------------------------------------------------
def _pyproject_range() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [r for r in extra["transformers"] if r.startswith("transformers")]
    return req.removeprefix("transformers")


def test_env_reports_transformers_against_patch_models_range(capsys, monkeypatch):
    from mla_backends.cli import env_cmd

    spec = set(_pyproject_range().split(","))
    assert main(["env", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["packages"]["transformers"]["version"] == version("transformers")
    assert rep["packages"]["safetensors"]["version"] == version("safetensors")
    (sup,) = rep["support"]
    assert sup["package"] == "transformers" and set(sup["supported"].split(",")) == spec and sup["inside"] is True
    real = env_cmd.package_version
    monkeypatch.setattr(env_cmd, "package_version",
                        lambda dists: ("4.46.0", "transformers") if dists == ("transformers",) else real(dists))
    assert main(["env"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("supported "))
    assert "4.46.0 is OUTSIDE it (not supported)" in line and "patch_model" in line
    import importlib.metadata as md

    def not_installed(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "requires", not_installed)  # a source tree: the range is read from pyproject.toml
    assert set(env_cmd.supported_range("transformers", "transformers").split(",")) == spec


def test_version_and_import_load_no_torch():
    code = ("import sys; import mla_backends; assert 'torch' not in sys.modules, 'import'; "
            "from mla_backends.cli import main\n"
            "try:\n    main(['-v', '--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules))")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [f"mla-backends {version('mla-backends')} (Python {platform.python_version()})",
                                        "[]"], proc.stdout


def test_the_lazy_package_still_exposes_its_public_api():
    import mla_backends
    from mla_backends.backends.contract import MLABackend
    from mla_backends.core.dims import MLADims

    assert set(mla_backends.__all__) <= set(dir(mla_backends))
    assert mla_backends.MLADims is MLADims and mla_backends.MLABackend is MLABackend
    assert all(getattr(mla_backends, name) is not None for name in mla_backends.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mla_backends.nope  # noqa: B018
