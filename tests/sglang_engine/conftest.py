"""tests/sglang_engine runs only in ``.venv-sglang`` (sglang 0.5.23 on CPU torch with the kernel stand-in;
``make sglang-env`` builds it, ``make test`` runs it).

Elsewhere every test here is skipped with that reason. Engines are costly (each ``Engine`` start is ~20 s on this
CPU), so the engine runs (offline phases and the served model) happen in driver processes (``sglang_driver.py``: one
per checkpoint kind, and one per isolated phase), all started together before the folder's first test when any
collected test needs them (the in-process tests run meanwhile), and their JSON reports are shared (session
fixtures). The machinery is
tests/engine_harness.py, shared with tests/vllm_engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import driver_fixtures, skip_folder_elsewhere
from sglang_driver import PHASES
from sglang_env import HAVE_SGLANG, SKIP_REASON

HERE = Path(__file__).resolve().parent
#: bound on one driver run (a loaded 2-core machine: imports alone can take a minute)
DRIVER_TIMEOUT_S = 1200

workdir, drivers, report_v2, report_v3 = driver_fixtures(
    folder=HERE, engine="sglang", installed=HAVE_SGLANG, reason=SKIP_REASON, script=HERE / "sglang_driver.py",
    env=dict, timeout_s=DRIVER_TIMEOUT_S, together=True,
    isolated={kind: [p.name for p in phases if p.isolated] for kind, phases in PHASES.items()})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_folder_elsewhere(items, HERE, HAVE_SGLANG, SKIP_REASON)


@pytest.fixture(scope="session", autouse=True)
def _drivers_first(request: pytest.FixtureRequest) -> None:
    """Start the drivers at the folder's first test when a collected test reads their reports."""
    if HAVE_SGLANG and any({"report_v2", "report_v3"} & set(item.fixturenames) for item in request.session.items):
        request.getfixturevalue("drivers")
