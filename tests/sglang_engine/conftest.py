"""tests/sglang_engine runs only in ``.venv-sglang`` (sglang 0.5.23 on CPU torch with the kernel stand-in;
``make sglang-env`` builds it, ``make test`` runs it).

Elsewhere every test here is skipped with that reason. Engines are costly (each ``Engine`` start is ~20 s on this
CPU), so the offline runs happen once per checkpoint in one driver process each (``sglang_driver.py``), both
started together at the first test that needs one, and their JSON reports are shared (session fixtures); the
served model is one ``python -m sglang.launch_server`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_harness import HAVE_SGLANG, SKIP_REASON, clean_pythonpath

HERE = Path(__file__).resolve().parent
#: bound on one driver run (a loaded 2-core machine: imports alone can take a minute)
DRIVER_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_SGLANG:
        return
    mark = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(mark)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang")


class _Drivers:
    """Both checkpoints' driver processes, started together (their engines leave the cores idle at times)."""

    def __init__(self, workdir: Path) -> None:
        env = {**os.environ}
        for name in ("MLA_BACKENDS_SGLANG", "MLA_BACKEND", "TRITON_INTERPRET", "MLA_BACKENDS_THRESHOLD_TABLE"):
            env.pop(name, None)
        env["PYTHONPATH"] = clean_pythonpath(env.get("PYTHONPATH"))
        self.workdir = workdir
        self.procs = {}
        for kind in ("v2", "v3"):
            log = open(workdir / f"driver-{kind}.log", "w")
            cmd = [sys.executable, str(HERE / "sglang_driver.py"), kind, str(workdir)]
            self.procs[kind] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        self.reports: dict[str, dict] = {}

    def report(self, kind: str) -> dict:
        if kind not in self.reports:
            proc, log = self.procs[kind]
            try:
                proc.wait(timeout=DRIVER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)
            log.close()
            text = (self.workdir / f"driver-{kind}.log").read_text(errors="replace")
            assert proc.returncode == 0, f"driver {kind} failed (rc {proc.returncode}):\n{text[-6000:]}"
            rep = json.loads((self.workdir / f"report-{kind}.json").read_text())
            rep["log"] = text
            self.reports[kind] = rep
        return self.reports[kind]

    def stop(self) -> None:
        for proc, log in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            log.close()


@pytest.fixture(scope="session")
def drivers(workdir: Path):  # type: ignore[no-untyped-def]
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    d = _Drivers(workdir)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="session")
def report_v2(drivers: _Drivers) -> dict:
    return drivers.report("v2")


@pytest.fixture(scope="session")
def report_v3(drivers: _Drivers) -> dict:
    return drivers.report("v3")
