"""Packaging: the wheel holds both import packages, their ``py.typed`` markers, every backend package and the
console script; ``import mla_backends`` stays light (no triton, no flashinfer); ``mla-backends demo`` runs.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("triton", "flashinfer")


def _has_setuptools(major: int) -> bool:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return int(version.split(".")[0]) >= major


@pytest.mark.slow
def test_wheel_contents(tmp_path):
    """Build from a copy of the sources (so no stale ``build/`` tree can hide a missing file)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("mla_backends", "selector"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if _has_setuptools(68):  # build offline with the installed backend; otherwise pip fetches it
        cmd[4:4] = ["--no-build-isolation", "--no-index"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = list(out.glob("mla_backends-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    for required in ("mla_backends/__init__.py", "mla_backends/py.typed", "selector/__init__.py",
                     "selector/py.typed", "mla_backends/ref_torch/__init__.py",
                     "mla_backends/cpu_fused/csrc/mla_decode.cpp"):  # CPU_FUSED compiles it on the user's machine
        assert required in names, f"{required} missing from the wheel"
    for package in ("mla_backends/triton_mla/", "mla_backends/flashinfer_mla/"):
        assert any(n.startswith(package) and n.endswith(".py") for n in names), f"{package} not in the wheel"
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheels[0]).read(entry_points).decode()
    assert "[console_scripts]" in text
    assert "mla-backends = mla_backends.cli:main" in text


def test_import_does_not_load_kernel_packages():
    code = (
        "import sys, mla_backends\n"
        "from mla_backends import MLADims, LatentKVCache, BatchMetadata, AttentionSpec\n"
        "mla_backends.RefTorchBackend\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout, proc.stdout


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("mla-backends")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mla_backends"]


def test_demo_command_prints_match():
    env = dict(os.environ)
    proc = subprocess.run(_cli() + ["demo", "--context", "300", "--requests", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MATCH" in proc.stdout and "MISMATCH" not in proc.stdout, proc.stdout
