"""Library argument names -> command-line flags: the one translation every CLI error goes through.

The library's checks name their own arguments (``"block_size: got 0; supported >= 1"``,
``"gpu_memory_gib: got nan"``, ``"gpu name: got 'h999'"``); on the command line the same error must name the
flag the user typed (``--block-size``, ``--cache-memory``, ``--gpu``). :func:`flag_error` rewrites the
leading name of such a message to the flag of the running command and returns that flag, which
:func:`mla_backends.cli.report_error` puts in the JSON error's ``argument`` field.
"""

from __future__ import annotations

from collections.abc import Collection

from ..core.errors import argument_named

__all__ = ["LIBRARY_FLAGS", "flag_for", "flag_error"]

#: library argument names whose flag is not ``--`` + the name with ``_`` -> ``-`` (first flag the command has)
LIBRARY_FLAGS: dict[str, tuple[str, ...]] = {
    "gpu_memory_gib": ("--cache-memory",),
    "gpu name": ("--gpu",),
    "context_len": ("--context", "--contexts"),
    "query_len": ("--query-lens",),
    "model_dtype": ("--dtype",),
}


def flag_for(name: str, options: Collection[str]) -> str | None:
    """The flag among ``options`` (the running command's option strings) that library argument ``name``
    stands for: ``name`` itself when it is a flag, the :data:`LIBRARY_FLAGS` entry, else
    ``--`` + ``name`` with ``_`` as ``-``; None when the command has no such flag."""
    if name in options:
        return name
    for flag in LIBRARY_FLAGS.get(name, ()):
        if flag in options:
            return flag
    flag = "--" + name.replace("_", "-")
    return flag if flag in options else None


def flag_error(message: str, options: Collection[str]) -> tuple[str, str | None]:
    """``(message, argument)`` of an error on the command line: a leading library argument name that stands
    for one of ``options`` is replaced by that flag (``"block_size: got 0"`` -> ``"--block-size: got 0"``);
    ``argument`` is the flag, else the name the message leads with (``None`` when it names none)."""
    for name in LIBRARY_FLAGS:  # names with a space, which argument_named does not read
        if message.startswith(f"{name}:") and (flag := flag_for(name, options)):
            return flag + message[len(name):], flag
    name = argument_named(message)
    if name is None:
        return message, None
    flag = flag_for(name, options)
    if flag is None:
        return message, name
    if message.startswith(f"{name}:"):
        message = flag + message[len(name):]
    return message, flag
