"""The one shape of an error as data: what ``mla-backends ... --json`` prints for every failure.

``{"error": {"type": <exception class>, "message": <text>, "argument": <the argument it names, or null>}}``.
The argument is read from the library's wording, ``"<argument>: got X; supported Y"`` (and argparse's
``"argument --tp: ..."``), so every check that names its argument fills it in.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["argument_named", "error_dict", "USER_CODE_FAILURES", "failure_text", "PluginCodeError", "plugin_call",
           "plugin_error", "code_owner"]

#: what a call into plugin code (an import path's module, a plugin's import or hook, a backend's own checks),
#: run under :func:`plugin_call`, may raise that a caller recording plugin problems catches: every ``Exception``
#: (:class:`PluginCodeError` included, which :func:`plugin_call` makes of ``sys.exit()`` and every other
#: ``BaseException``) and ``SystemExit`` (for code not wrapped). ``KeyboardInterrupt`` (Ctrl-C) still stops the
#: caller.
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
    ``sys.exit()`` (its own message is only the exit code, often empty); a :class:`PluginCodeError` gives the text
    of what the plugin raised."""
    if isinstance(exc, PluginCodeError):
        exc = exc.failure
    if isinstance(exc, SystemExit):
        return f"SystemExit: the code called sys.exit({exc.code!r})" if exc.code is not None else \
            "SystemExit: the code called sys.exit()"
    return f"{type(exc).__name__}: {exc}"


class PluginCodeError(RuntimeError):
    """Plugin code raised what no library call passes on as it is: ``sys.exit()`` (``SystemExit``),
    ``GeneratorExit`` or another ``BaseException`` that is not an ``Exception`` (Ctrl-C excepted).

    Attributes:
        owner: the code that raised it (:func:`code_owner`: ``"backend MY_MLA (my_pkg.mla.MyBackend), prepare()"``,
            ``"plugin 'my_plugin', register_mla_backends hook"``).
        failure: what it raised (also the ``__cause__``).
    """

    def __init__(self, owner: str, failure: BaseException) -> None:
        super().__init__(f"{owner}: {failure_text(failure)}; supported plugin code that returns or raises an "
                         "Exception (plugin code never ends or unwinds the caller; only Ctrl-C does)")
        self.owner = owner
        self.failure = failure


def code_owner(who: object, stage: str) -> str:
    """Who ran ``stage``, in words: a backend class or instance (``name`` and its class's module path, which
    names the plugin's package), a text as it is (``"plugin 'my_plugin'"``), else the object's type."""
    if isinstance(who, str):
        return f"{who}, {stage}"
    cls = who if isinstance(who, type) else type(who)
    name = getattr(cls, "name", None)
    where = f"{cls.__module__}.{cls.__qualname__}"
    label = f"backend {name} ({where})" if isinstance(name, str) else where
    return f"{label}, {stage}"


class plugin_call:  # lower case: read as a phrase, ``with plugin_call(backend, "prepare()"):``
    """Around one call into plugin code (a plugin's import or hook, a backend's ``__init__``, ``configure``,
    ``prepare``, checks or kernel): what it raises reaches the caller as an error naming the code.

    ``KeyboardInterrupt`` passes unchanged. An ``Exception`` passes unchanged (its type is the caller's to
    catch), with a note naming the code (``exc.add_note``, shown in the traceback). Any other ``BaseException``
    (``sys.exit()``, ``GeneratorExit``, a class deriving from ``BaseException``) becomes :class:`PluginCodeError`.
    Wrap calls only, never a ``yield`` (a generator's own ``GeneratorExit`` must pass). The owner's text is
    formed only when something is raised.
    """

    __slots__ = ("who", "stage")

    def __init__(self, who: object, stage: str) -> None:
        self.who = who
        self.stage = stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None:
            return False
        error = plugin_error(exc, self.who, self.stage)
        if error is exc:
            return False
        raise error from exc


def plugin_error(exc: BaseException, who: object, stage: str) -> BaseException:
    """What the caller gets for ``exc``, raised by plugin code (:func:`code_owner` of ``who`` and ``stage`` names
    it): ``KeyboardInterrupt`` and an ``Exception`` themselves (the latter with a note naming the code), any other
    ``BaseException`` a :class:`PluginCodeError`. :class:`plugin_call` applies it; the kernel call, on the hot
    path, applies it in a ``try``/``except``, which costs nothing while nothing is raised."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    owner = code_owner(who, stage)
    if isinstance(exc, Exception):
        if not isinstance(exc, PluginCodeError):
            exc.add_note(f"raised by {owner}")
        return exc
    return PluginCodeError(owner, exc)
