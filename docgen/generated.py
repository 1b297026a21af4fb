"""The command of a generated documentation page: write it, or check that the committed file is current.

Shared by ``python -m docgen.gpus`` (``docs/gpus.md``) and ``python -m docgen.selection``
(``docs/selection.md``). Foundation layer: imports nothing of ours.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["generated_doc_main"]


def generated_doc_main(
    argv: list[str] | None,
    *,
    render: Callable[[], str],
    default_path: Path,
    command: str,
    description: str,
) -> int:
    """Parse ``[--check] [--path FILE]`` and write the page ``render()`` returns, or compare it.

    Args:
        argv: the arguments (``None``: ``sys.argv[1:]``).
        render: returns the full text of the page.
        default_path: the committed page (``--path`` overrides it).
        command: how to regenerate the page, named in the out-of-date message (e.g. ``python -m docgen.selection``).
        description: the ``--help`` description.

    Returns the exit status: 0 when written or up to date, 1 when ``--check`` finds the file differs (or
    missing); the message goes to stderr.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 when {default_path.name} is out of date")
    parser.add_argument("--path", type=Path, default=default_path)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is out of date: run {command}", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0
