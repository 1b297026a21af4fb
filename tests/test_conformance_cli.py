"""``mla-backends conformance``: runs the shipped suite on registered backends (plugins included), exits
non-zero on failure; and the suite ships in the wheel without auto-loading into other pytest runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mla_backends.cli import main
from mla_backends.cli.conformance_cmd import pytest_args
from mla_backends.plugins.loading import get_registry

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "mla_backends"]


def _run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [*CLI, "conformance", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def test_ref_torch_quick_passes_through_the_cli() -> None:
    proc = _run_cli("REF_TORCH", "--quick", "--device", "cpu", "--", "-k", "ctx-sweep or declared")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "REF_TORCH passed" in proc.stdout
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_example_plugin_backend_passes_quick_through_the_cli() -> None:
    # `make test` installs the example plugin into .venv (Makefile): its absence is a set-up failure, not a skip
    plugin_names = [e.name for e in get_registry().entries()
                    if e.cls.__module__.startswith("mla_backends_example_plugin")]
    assert plugin_names, "the example plugin (examples/mla_backends_example_plugin) is not installed"
    proc = _run_cli(plugin_names[0], "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{plugin_names[0]} passed" in proc.stdout


def test_broken_backend_makes_the_cli_exit_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "conformance",
            "mla_backends.testing.broken:LatentScaleBackend",
            "--quick",
            "--device",
            "cpu",
            "--",
            "-k",
            "ctx-sweep",
            "-q",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out[-2000:]
    assert "FAILED (pytest exit code 1)" in err
    assert "output (latent space)" in out


def test_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "REF_TORHC"]) == 2
    err = capsys.readouterr().err
    assert "backend: got 'REF_TORHC'" in err and "REF_TORCH" in err


def test_pass_through_arguments_reach_pytest() -> None:
    args = pytest_args("REF_TORCH", True, "cpu", ["--", "-x", "-k", "output"])
    assert args[-3:] == ["-x", "-k", "output"]
    assert "--conformance-quick" in args and "--conformance-backend=REF_TORCH" in args
    assert "-p" in args and "mla_backends.testing.plugin" in args
    assert "--" not in args


def test_plugin_is_opt_in_only() -> None:
    """No pytest11 entry point: the plugin never loads into unrelated pytest runs."""
    from importlib.metadata import distribution

    eps = distribution("mla-backends").entry_points
    assert not [ep for ep in eps if ep.group == "pytest11"]
    assert "pytest11" not in (REPO / "pyproject.toml").read_text()


def test_suite_ships_in_the_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("mla_backends", "selector"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("mla_backends-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__", "reference", "cases", "checks", "suite", "plugin", "broken", "cli_suite"):
        assert f"mla_backends/testing/{module}.py" in names, sorted(n for n in names if "testing" in n)
    assert "mla_backends/cli/conformance_cmd.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pytest11" not in zipfile.ZipFile(wheel).read(entry_points).decode()
