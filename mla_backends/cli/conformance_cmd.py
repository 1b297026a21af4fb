"""``mla-backends conformance NAME [--quick] [--device D] [-- PYTEST_ARGS]``: run the suite on a backend.

NAME is any registered backend (built-in or from a plugin) or an import path ``package.module:Class`` for a
backend under development. The suite runs in-process through ``pytest.main`` on
``mla_backends/testing/cli_suite.py`` with the opt-in plugin; the exit code is pytest's (0 when every check
passed or was skipped with a reason, non-zero on any failure or when nothing was collected), and
:data:`NOTHING_RAN_STATUS` when pytest options that run no test (``--collect-only``) were passed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["register", "run", "pytest_args", "NOTHING_RAN_STATUS"]

#: exit status of a run in which no test ran although pytest reported no failure (pytest's own status 5)
NOTHING_RAN_STATUS = 5


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "conformance",
        help="run the conformance suite on a backend",
        description="Run the conformance suite shipped in mla_backends.testing on one backend: output and "
        "LSE against a float64 expanded reference, guard bands, determinism and honest "
        "declarations. Arguments after `--` go to pytest.",
        epilog="examples: mla-backends conformance REF_TORCH;  mla-backends conformance TRITON_MLA --quick "
        "-- -x -k output",
    )
    p.add_argument("backend", metavar="NAME",
                   help="registered backend name, vLLM's or SGLang's name for it (CUTLASS_MLA, trtllm_mla, "
                        "...) or package.module:Class (need not be installed as a plugin)")
    p.add_argument(
        "--quick", action="store_true", help="reduced case matrix (interpreted Triton, quick checks)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run (auto: CUDA when present and declared by the backend, else the CPU)",
    )
    p.set_defaults(func=run, accepts_extra=True)


def pytest_args(name: str, quick: bool, device: str, extra: list[str]) -> list[str]:
    """The pytest command line the CLI runs (``extra``: pass-through arguments, a leading ``--`` dropped)."""
    suite = Path(__file__).resolve().parent.parent / "testing" / "cli_suite.py"
    if extra and extra[0] == "--":
        extra = extra[1:]
    args = [
        str(suite),
        "-p",
        "mla_backends.testing.plugin",
        f"--conformance-backend={name}",
        f"--conformance-device={device}",
        "-p",
        "no:cacheprovider",
        "-o",
        "python_classes=Test*",
        "-o",
        "python_functions=test_*",
        "-rs",
    ]
    if quick:
        args.append("--conformance-quick")
    return args + list(extra)


def run(args: argparse.Namespace) -> int:
    import pytest
    import torch

    from ..plugins.loading import get_registry

    entry = get_registry().resolve(args.backend)  # ValueError/TypeError -> exit 2 with the message
    cls = entry.cls
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # Triton kernels can only run interpreted without CUDA; the flag must be set before they are imported
        os.environ["TRITON_INTERPRET"] = "1"
    name = args.backend if ":" in args.backend else cls.name
    matrix = "quick" if args.quick else "full"
    print(
        f"mla-backends conformance: {cls.name} ({cls.__module__}.{cls.__qualname__}, source "
        f"{entry.source}), {matrix} matrix, device {args.device}",
        flush=True,
    )
    counter = _TestsRun()
    code = int(pytest.main(pytest_args(name, args.quick, args.device, list(getattr(args, "extra", []) or [])),
                           plugins=[counter]))
    if code == 0 and not counter.calls:  # --collect-only, --setup-plan, --fixtures, pytest's --help ...
        code = NOTHING_RAN_STATUS
        verdict = (f"not checked: no tests ran (exit {code}; the pytest options given run none, as "
                   "--collect-only only lists the cases), which is not a pass")
    else:
        verdict = "passed" if code == 0 else f"FAILED (pytest exit code {code})"
    print(f"mla-backends conformance: {cls.name} {verdict}", file=sys.stderr if code else sys.stdout)
    return code


class _TestsRun:
    """A pytest plugin counting the tests whose body ran (pass, fail or skip from inside the test): a run
    whose options ran none (``--collect-only``, ``--setup-plan``) is not a pass."""

    def __init__(self) -> None:
        self.calls = 0

    def pytest_runtest_logreport(self, report: object) -> None:
        if getattr(report, "when", None) == "call":
            self.calls += 1
