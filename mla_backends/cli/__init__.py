"""The ``mla-backends`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``; heavy imports happen inside the
command functions, so ``mla-backends --help`` stays fast and never imports triton or flashinfer.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "version_text"]

#: sub-command modules, in the order ``--help`` lists them
COMMAND_MODULES = (
    "demo",
    "list_cmd",
    "select_cmd",
    "conformance_cmd",
    "costs_cmd",
    "tune_cmd",
    "env_cmd",
)


def version_text() -> str:
    """``mla-backends 0.1.0 (Python 3.12.3)``: the installed distribution's version (``importlib.metadata``),
    else the source tree's ``__version__``."""
    import importlib.metadata
    import platform

    from .. import __version__

    try:
        version = importlib.metadata.version("mla-backends")
    except importlib.metadata.PackageNotFoundError:
        version = f"{__version__} (not installed: source tree)"
    return f"mla-backends {version} (Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla-backends",
        description="Run, select, explain and size DeepSeek-style MLA attention backends.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the version and exit (`mla-backends env` for every version)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"mla-backends {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
