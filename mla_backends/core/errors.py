"""The one shape of an error as data: what ``mla-backends ... --json`` prints for every failure.

``{"error": {"type": <exception class>, "message": <text>, "argument": <the argument it names, or null>}}``.
The argument is read from the library's wording, ``"<argument>: got X; supported Y"`` (and argparse's
``"argument --tp: ..."``), so every check that names its argument fills it in.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["argument_named", "error_dict", "USER_CODE_FAILURES", "failure_text"]

#: what plugin code (an import path's module, a plugin's import or hook, a backend's own checks) may raise that
#: must not reach the caller: every ``Exception`` and ``SystemExit`` (a module calling ``sys.exit()`` on import
#: would otherwise end the caller's process). ``KeyboardInterrupt`` (Ctrl-C) and ``GeneratorExit`` still do.
USER_CODE_FAILURES: tuple[type[BaseException], ...] = (Exception, SystemExit)

_ARGPARSE = re.compile(r"^argument ([^\s:/]+)(?:/[^\s:]+)?:")
_REQUIRED = re.compile(r"^the following arguments are required: ([^\s,]+)")
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (\S+)")
_LEADING = re.compile(r"^([-\w.\[\]]+):\s")


def argument_named(message: str) -> str | None:
    """The argument an error message names first (``"--tp"``, ``"config.rope_theta"``, ``"scale"``), else None."""
    text = message.strip()
    for pattern in (_ARGPARSE, _REQUIRED, _UNRECOGNIZED, _LEADING):
        m = pattern.match(text)
        if m:
            return m.group(1)
    return None


def error_dict(exc: BaseException, *, message: str | None = None, argument: str | None = None,
               type_name: str | None = None) -> dict[str, Any]:
    """``{"error": {"type", "message", "argument"}}`` for ``exc`` (``message`` / ``argument`` / ``type_name``
    override what is read from it)."""
    text = str(exc) if message is None else message
    return {"error": {"type": type_name or type(exc).__name__, "message": text,
                      "argument": argument if argument is not None else argument_named(text)}}


def failure_text(exc: BaseException) -> str:
    """``"<Type>: <message>"`` for a failure of plugin code; a ``SystemExit`` says that the code called
    ``sys.exit()`` (its own message is only the exit code, often empty)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the code called sys.exit({exc.code!r})" if exc.code is not None else \
            "SystemExit: the code called sys.exit()"
    return f"{type(exc).__name__}: {exc}"
