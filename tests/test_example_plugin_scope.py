"""The example plugin is for the tests and for reading, never for users: `make run` / `make test` keep it out of
the environment's own site-packages (it lives in ``.test-site``, which only the test run puts on the path), so
``select``, ``list`` and ``tune`` outside the tests never meet ``EXAMPLE_MLA``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_SITE = ROOT / ".test-site"


def _env_without_test_site() -> dict[str, str]:
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != TEST_SITE.resolve()]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    return env


def test_the_tests_see_the_example_plugin_through_the_test_site() -> None:
    import mla_backends_example_plugin

    assert Path(mla_backends_example_plugin.__file__).resolve().is_relative_to(TEST_SITE.resolve()), (
        f"the example plugin was imported from {mla_backends_example_plugin.__file__}, not from {TEST_SITE}: "
        "it is installed into the environment itself, where every user meets it"
    )


@pytest.mark.slow
def test_the_environment_outside_the_tests_has_no_example_backend() -> None:
    out = subprocess.run([sys.executable, "-m", "mla_backends", "list", "--json"], capture_output=True, text=True,
                         env=_env_without_test_site(), timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    names = {b["name"] for b in json.loads(out.stdout)["backends"]}
    assert "REF_TORCH" in names and "EXAMPLE_MLA" not in names, sorted(names)
