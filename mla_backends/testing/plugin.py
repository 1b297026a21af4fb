"""Opt-in pytest plugin for the conformance suite.

Enable it with ``pytest -p mla_backends.testing.plugin``, or with
``pytest_plugins = ["mla_backends.testing.plugin"]`` in your top-level ``conftest.py``. It is deliberately
*not* registered as a ``pytest11`` entry point, so it never loads into unrelated pytest runs. It adds:

- ``--conformance-backend NAME``: the backend for :class:`BackendConformance` subclasses that leave
  ``backend`` unset (a registered name or ``package.module:Class``);
- ``--conformance-quick``: the reduced matrix (about 15-25 small kernel calls);
- ``--conformance-device {auto,cpu,cuda}``: where to run (``auto``: CUDA when present and declared, else CPU);
- a report-header line naming the backend and the matrix.
"""

from __future__ import annotations

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_report_header"]


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
        "--conformance-device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run the backend (default auto: CUDA when present and declared, else CPU)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: the mla-backends conformance suite")


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("conformance_backend", None)
    if not name:
        return None
    matrix = "quick" if config.getoption("conformance_quick", False) else "full"
    device = config.getoption("conformance_device", "auto")
    return f"mla-backends conformance: backend {name}, {matrix} matrix, device {device}"
