"""A closed stdout (``mla-backends list --json | head -1``) ends a command quietly, as Unix tools do.

When the reader of a pipe goes away, the next write to it raises ``BrokenPipeError`` (Python ignores
``SIGPIPE``). :func:`mla_backends.cli.main` catches it from any command, from its own final flush, and from
the error report itself, and calls :func:`stdout_closed`: nothing more is printed, no traceback, and the exit
status is :data:`CLOSED_STDOUT_STATUS` (141, the status a shell reports for a tool ended by ``SIGPIPE``, as
``seq 1000000 | head -1`` gives under ``set -o pipefail``): the output was cut short, which a caller can tell.
"""

from __future__ import annotations

import os
import sys

__all__ = ["CLOSED_STDOUT_STATUS", "stdout_closed", "flush_stdout"]

#: exit status of a command whose stdout was closed by its reader: 128 + SIGPIPE (13)
CLOSED_STDOUT_STATUS = 141


def _to_devnull(stream: object) -> None:
    """Point ``stream``'s file descriptor at ``/dev/null`` (so the interpreter's flush at exit, of whatever is
    still buffered, writes nowhere instead of raising again), and drop its buffer."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def stdout_closed() -> int:
    """Stop writing to the closed stdout (and to stderr too, when it is the same closed pipe); return
    :data:`CLOSED_STDOUT_STATUS`."""
    _to_devnull(sys.stdout)
    try:
        sys.stderr.flush()
    except (BrokenPipeError, OSError, ValueError):
        _to_devnull(sys.stderr)
    return CLOSED_STDOUT_STATUS


def flush_stdout() -> None:
    """Flush stdout now, inside the command's error handling, rather than at interpreter exit, where a closed
    pipe would print ``Exception ignored ... BrokenPipeError``."""
    sys.stdout.flush()
