"""A closed stdout (``mla-backends list --json | head -1``) ends a command quietly, as Unix tools do.

When the reader of a pipe goes away, the next write to it raises ``BrokenPipeError`` (Python ignores
``SIGPIPE``). :func:`mla_backends.cli.main` catches it from any command, from its own final flush, and from
the error report itself, and calls :func:`stdout_closed`: nothing more is printed, no traceback, and the exit
status is :data:`CLOSED_STDOUT_STATUS` (141, the status a shell reports for a tool ended by ``SIGPIPE``, as
``seq 1000000 | head -1`` gives under ``set -o pipefail``): the output was cut short, which a caller can tell.

A stdout closed before the command starts (``mla-backends env >&-``: Python then has no ``sys.stdout`` at all)
ends every command the same way, before it runs (:func:`stdout_missing`): nothing is printed (argparse
would otherwise send ``--help`` to stderr), and the status is 141 too. argparse's own writes (``--help``,
``--version``) swallow write errors; the command line's parsers write through :func:`write_or_raise`
instead, so that a closed pipe gives 141 whether or not the stream is buffered (``PYTHONUNBUFFERED=1``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["CLOSED_STDOUT_STATUS", "stdout_closed", "flush_stdout", "stdout_missing", "write_or_raise"]

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


def stdout_missing() -> bool:
    """True when there is no stdout to write to: Python started with file descriptor 1 closed
    (``sys.stdout`` is None), or ``sys.stdout``'s descriptor is no longer open. A stream without a descriptor
    (a test's capture) is taken as present."""
    stream = sys.stdout
    if stream is None:
        return True
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def write_or_raise(message: str, file: object | None = None) -> None:
    """Write ``message`` to ``file`` (default stderr) and flush it, letting a ``BrokenPipeError`` (or any other
    write error) out, where argparse's ``_print_message`` would swallow it; nothing is written when the
    stream does not exist (``None``)."""
    stream = file if file is not None else sys.stderr
    if not message or stream is None:
        return
    stream.write(message)  # type: ignore[attr-defined]
    stream.flush()  # type: ignore[attr-defined]
