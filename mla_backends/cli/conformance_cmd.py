"""``mla-backends conformance NAME [--quick] [--seeds N [--seed S]] [--device D] [-- PYTEST_ARGS]``: run the suite
on a backend; ``mla-backends conformance --engine vllm|sglang [--quick] [--seeds N [--seed S]] [--device D]
[--json]``: run it over an engine's own MLA decode kernels (:mod:`mla_backends.testing.peers`) and print one
table. ``--seeds N`` draws N random cases inside the backend's declarations (seeds S, S+1, ...); a failed one is
printed as the one command line that runs it alone.

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
#: the engines ``--engine`` takes (mla_backends.testing.peers.ENGINES, named here to keep --help light)
ENGINE_CHOICES = ("vllm", "sglang")


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
    p.add_argument("backend", metavar="NAME", nargs="?",
                   help="registered backend name, vLLM's or SGLang's name for it (CUTLASS_MLA, trtllm_mla, "
                        "...) or package.module:Class (need not be installed as a plugin)")
    p.add_argument("--engine", choices=ENGINE_CHOICES,
                   help="instead of NAME: run the suite over that engine's own MLA decode kernels, called as the "
                        "engine calls them, and print one table (kernel, engine version, cases passed, each "
                        "failure's worst element and diagnosis; kernels that cannot run here with the reason)")
    p.add_argument("--json", action="store_true", help="with --engine: print the table as JSON")
    p.add_argument(
        "--quick", action="store_true", help="reduced case matrix (interpreted Triton, quick checks)"
    )
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="a property run: N random cases (shapes, lengths, page sizes, tables, dtypes) drawn inside "
                        "the backend's declarations, added to the matrix (default: 4 with --quick, else none)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the first seed of --seeds (default: a fixed one); a failed random case prints the "
                        "command that reruns it (--seeds 1 --seed S)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run (auto: CUDA when present and declared by the backend, else the CPU)",
    )
    p.set_defaults(func=run, accepts_extra=True)


def pytest_args(name: str, quick: bool, device: str, extra: list[str], seeds: int | None = None,
                seed: int | None = None) -> list[str]:
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
    if seeds is not None:
        args.append(f"--conformance-seeds={seeds}")
    if seed is not None:
        args.append(f"--conformance-seed={seed}")
    return args + list(extra)


def _check_seeds(args: argparse.Namespace) -> None:
    for flag in ("seeds", "seed"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            raise ValueError(f"--{flag}: got {value}; supported an int >= 0")
    if getattr(args, "seed", None) is not None and getattr(args, "seeds", None) is None:
        raise ValueError("--seed: got it without --seeds; supported with --seeds N (the number of random cases)")


def run(args: argparse.Namespace) -> int:
    extra = list(getattr(args, "extra", []) or [])
    _check_seeds(args)
    if args.engine is not None:
        if args.backend is not None:
            raise ValueError(f"NAME: got {args.backend!r} with --engine {args.engine}; supported one of NAME or "
                             "--engine")
        if extra:
            raise ValueError(f"--engine: got pytest arguments after -- ({' '.join(extra)}); supported none (the "
                             "engine run calls the checks itself)")
        return run_engine_table(args.engine, quick=args.quick, device=args.device, as_json=args.json,
                                seeds=getattr(args, "seeds", None), seed=getattr(args, "seed", None))
    if args.backend is None:
        raise ValueError("NAME: got none; supported a registered backend name, package.module:Class, or "
                         "--engine vllm|sglang")
    if args.json:
        raise ValueError("--json: got it with NAME; supported only with --engine (a backend's run is pytest's "
                         "output)")
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
    code = int(pytest.main(pytest_args(name, args.quick, args.device, extra, getattr(args, "seeds", None),
                                       getattr(args, "seed", None)), plugins=[counter]))
    if code == 0 and not counter.calls:  # --collect-only, --setup-plan, --fixtures, pytest's --help ...
        code = NOTHING_RAN_STATUS
        verdict = (f"not checked: no tests ran (exit {code}; the pytest options given run none, as "
                   "--collect-only only lists the cases), which is not a pass")
    else:
        verdict = "passed" if code == 0 else f"FAILED (pytest exit code {code})"
    print(f"mla-backends conformance: {cls.name} {verdict}", file=sys.stderr if code else sys.stdout)
    return code


def run_engine_table(engine: str, *, quick: bool, device: str, as_json: bool, seeds: int | None = None,
                     seed: int | None = None) -> int:
    """``--engine``: the suite over ``engine``'s peer kernels; prints the table (or its JSON) on stdout and
    returns 0 (every runnable kernel passed), 1 (a failure) or :data:`NOTHING_RAN_STATUS` (none could run)."""
    import json

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: got cuda; supported auto or cpu on this machine (no CUDA device)")
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is loaded
    dev = torch.device("cuda") if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")

    from ..testing.peers.runner import format_table, run_engine

    def progress(line: str) -> None:
        print(f"mla-backends conformance --engine {engine}: {line}", file=sys.stderr, flush=True)

    report = run_engine(engine, quick=quick, device=dev, progress=progress, seeds=seeds, seed=seed)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_table(report))
    return report.status


class _TestsRun:
    """A pytest plugin counting the tests whose body ran (pass, fail or skip from inside the test): a run
    whose options ran none (``--collect-only``, ``--setup-plan``) is not a pass."""

    def __init__(self) -> None:
        self.calls = 0

    def pytest_runtest_logreport(self, report: object) -> None:
        if getattr(report, "when", None) == "call":
            self.calls += 1
