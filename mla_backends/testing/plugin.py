"""Opt-in pytest plugin for the conformance suite.

Enable it with ``pytest -p mla_backends.testing.plugin``, or with
``pytest_plugins = ["mla_backends.testing.plugin"]`` in your top-level ``conftest.py``. It is deliberately
*not* registered as a ``pytest11`` entry point, so it never loads into unrelated pytest runs. It adds:

- ``--conformance-backend NAME``: the backend for :class:`BackendConformance` subclasses that leave
  ``backend`` unset (a registered name or ``package.module:Class``);
- ``--conformance-quick``: the reduced matrix (about 15-25 small kernel calls);
- ``--conformance-device {auto,cpu,cuda}``: where to run (``auto``: CUDA when present and declared, else CPU);
- ``--conformance-seeds N`` / ``--conformance-seed S``: the property run, ``N`` random cases drawn inside the
  declarations from seed ``S`` on (default: 4 in the quick matrix, none in the full one; a fixed first seed);
- a report-header line naming the backend and the matrix;
- with ``--conformance-backend``, a run in which no output test ran (every output case skipped, say
  ``--conformance-device cuda`` without CUDA, or deselected) fails with the reason: skipping everything is
  not passing. A collection-only run (``--collect-only``) is exempt. A failed random case is summarised as the
  one command line that runs it alone (``mla-backends conformance NAME --seeds 1 --seed S``).
"""

from __future__ import annotations

import re

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_report_header", "OUTPUT_TEST", "ConformanceRun",
           "reproduction"]

#: a random case's id names its seed
_DRAWN = re.compile(r"\[prop-s(\d+)-")


def reproduction(name: str, seed: int, quick: bool, device: str) -> str:
    """The one command line that runs random case ``seed`` of backend ``name`` alone."""
    return (f"mla-backends conformance {name} --seeds 1 --seed {seed}" + (" --quick" if quick else "")
            + (f" --device {device}" if device != "auto" else ""))

#: the test whose running (pass or fail) makes a conformance run count
OUTPUT_TEST = "test_output_matches_reference"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mla-conformance", "mla-backends conformance suite")
    group.addoption(
        "--conformance-backend",
        default=None,
        metavar="NAME",
        help="backend for BackendConformance classes without `backend` (name or module:Class)",
    )
    group.addoption(
        "--conformance-quick",
        action="store_true",
        default=False,
        help="reduced case matrix (for interpreted Triton and quick checks)",
    )
    group.addoption(
        "--conformance-seeds",
        type=int,
        default=None,
        metavar="N",
        help="random cases drawn inside the backend's declarations (default: 4 with --conformance-quick, else 0)",
    )
    group.addoption(
        "--conformance-seed",
        type=int,
        default=None,
        metavar="S",
        help="the first seed of the random cases (default: a fixed one, the same on every run)",
    )
    group.addoption(
        "--conformance-device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run the backend (default auto: CUDA when present and declared, else CPU)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: the mla-backends conformance suite")
    if config.getoption("conformance_backend", None):
        config.pluginmanager.register(ConformanceRun(config), "mla-backends-conformance-run")


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("conformance_backend", None)
    if not name:
        return None
    matrix = "quick" if config.getoption("conformance_quick", False) else "full"
    device = config.getoption("conformance_device", "auto")
    return f"mla-backends conformance: backend {name}, {matrix} matrix, device {device}"


class ConformanceRun:
    """Registered for ``--conformance-backend`` runs: counts the output tests that ran (pass or fail) and
    fails a run in which none did, with the reason (the first skip's), unless only collecting."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.ran = 0
        self.skipped = 0
        self.first_skip: str | None = None
        self.failure: str | None = None
        self.failed_seeds: list[int] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        drawn = _DRAWN.search(report.nodeid)
        if drawn and report.failed and int(drawn.group(1)) not in self.failed_seeds:
            self.failed_seeds.append(int(drawn.group(1)))
        if OUTPUT_TEST not in report.nodeid:
            return
        if report.skipped and report.when in ("setup", "call"):
            self.skipped += 1
            if self.first_skip is None:
                longrepr = report.longrepr
                self.first_skip = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        elif report.when == "call":
            self.ran += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.config.option.collectonly or exitstatus != 0 or self.ran:
            return
        why = (f"all {self.skipped} output case(s) were skipped, the first because: {self.first_skip}"
               if self.skipped else "no output case was selected")
        self.failure = (f"no output test ran ({why}); a conformance run must check at least one output "
                        "against the reference (--collect-only only lists the cases)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.failure:
            terminalreporter.write_line(f"mla-backends conformance: FAILED: {self.failure}", red=True)
        name = self.config.getoption("conformance_backend", None)
        quick = bool(self.config.getoption("conformance_quick", False))
        device = self.config.getoption("conformance_device", "auto") or "auto"
        for seed in self.failed_seeds:
            terminalreporter.write_line(f"reproduce: {reproduction(name, seed, quick, device)}", red=True)
