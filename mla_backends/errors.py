"""The one shape of an error as data: what ``mla-backends ... --json`` prints for every failure.

``{"error": {"type": <exception class>, "message": <text>, "argument": <the argument it names, or null>}}``.
The argument is read from the library's wording, ``"<argument>: got X; supported Y"`` (and argparse's
``"argument --tp: ..."``), so every check that names its argument fills it in.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["argument_named", "error_dict"]

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
