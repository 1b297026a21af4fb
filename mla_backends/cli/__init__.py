"""The ``mla-backends`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``; heavy imports happen inside the
command functions, so ``mla-backends --help`` stays fast and never imports triton or flashinfer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

__all__ = ["main", "build_parser", "version_text", "report_error", "UsageError", "split_pass_through"]

log = logging.getLogger(__name__)

#: sub-command modules, in the order ``--help`` lists them
COMMAND_MODULES = (
    "demo",
    "list_cmd",
    "select_cmd",
    "conformance_cmd",
    "costs_cmd",
    "tune_cmd",
    "env_cmd",
    "build_cmd",
)


def version_text() -> str:
    """``mla-backends 0.4.0 (Python 3.12.3)``: the installed distribution's version (``importlib.metadata``),
    else the source tree's ``__version__``."""
    import importlib.metadata
    import platform

    from .. import __version__

    try:
        version = importlib.metadata.version("mla-backends")
    except importlib.metadata.PackageNotFoundError:
        version = f"{__version__} (not installed: source tree)"
    return f"mla-backends {version} (Python {platform.python_version()})"


class UsageError(Exception):
    """A command-line usage error (what argparse reports); raised instead of argparse's ``sys.exit(2)`` so that
    :func:`main` reports every error in one place and one shape."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (sub-command parsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: every option string of this parser (``--tp``, ``-o``), for naming flags in errors
        self.option_names: set[str] = set()  # before super().__init__, which adds -h
        super().__init__(*args, **kwargs)
        #: the sub-command parsers by name (filled by :func:`build_parser` on the top-level parser)
        self.commands: dict[str, _Parser] = {}

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        self.option_names.update(n for n in names if isinstance(n, str) and n.startswith("-"))
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self)

    def _print_message(self, message: str, file: Any = None) -> None:
        """``--help``, ``--version`` and usage lines: written so that a closed pipe raises (argparse's own
        method swallows the error, which made ``--help | true`` exit 0 when unbuffered)."""
        from .pipes import write_or_raise

        write_or_raise(message, file)


def _global_options(parser: _Parser) -> None:
    """The options that come before the command (``-v``, ``--version``, ``--json``)."""
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the version and exit (`mla-backends env` for every version)")
    parser.add_argument("--json", dest="global_json", action="store_true",
                        help="the same as the command's own --json (mla-backends --json list = mla-backends "
                             "list --json), for the commands that have one; errors are JSON too")


def _answer_version(argv: Sequence[str]) -> None:
    """``--version`` before the command: print it and exit (``SystemExit(0)``) before any sub-command module
    is imported, so it reads the package metadata only (no torch). Anything else returns, for the full parser."""
    light = _Parser(prog="mla-backends", add_help=False)
    _global_options(light)
    light.add_argument("rest", nargs=argparse.REMAINDER)  # the command and what follows it: not looked at
    try:
        light.parse_known_args(list(argv))
    except UsageError:  # the full parser reports it, in its words
        pass


def build_parser() -> _Parser:
    parser = _Parser(
        prog="mla-backends",
        description="Run, select, explain and size DeepSeek-style MLA attention backends.",
    )
    _global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    parser.commands = dict(sub.choices)
    return parser


def report_error(exc: BaseException, *, as_json: bool, command: str | None,
                 options: Collection[str] = ()) -> int:
    """Report ``exc`` as the one error of this run and return the exit status (2; 130 for Ctrl-C).

    With ``--json``: ``{"error": {"type", "message", "argument"}}`` on stdout. Otherwise argparse's usage line
    and ``mla-backends <command>: error: <message>`` on stderr. Never a traceback (``-vv`` logs one at debug
    level). ``options`` are the command's option strings: a library argument the message leads with is
    reported as the flag that sets it (:func:`mla_backends.cli.flags.flag_error`; ``argument`` is that flag).
    """
    from ..core.errors import error_dict
    from .flags import flag_error

    if isinstance(exc, KeyboardInterrupt):
        exc_text, status, argument = "interrupted", 130, None
    else:
        exc_text, argument = flag_error(str(exc) or type(exc).__name__, options)
        status = 2
    log.debug("mla-backends %s failed", command or "", exc_info=exc)
    type_name = "ArgumentError" if isinstance(exc, UsageError) else None
    if as_json:
        print(json.dumps(error_dict(exc, message=exc_text, type_name=type_name, argument=argument), indent=2))
    elif isinstance(exc, UsageError):
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc_text}", file=sys.stderr)
    else:
        kind = "" if isinstance(exc, (ValueError, TypeError, UsageError)) else f"{type(exc).__name__}: "
        print(f"mla-backends {command or ''}: error: {kind}{exc_text}".replace("  ", " "), file=sys.stderr)
    return status


def split_pass_through(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """``(before, after)`` the first ``--`` of ``argv``; ``after`` is None without one.

    Only the arguments after ``--`` are passed through (to pytest, by ``conformance``); everything before it is
    parsed strictly, so a misspelt option is a usage error rather than an argument for another program."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _unrecognized(parser: _Parser, own: Sequence[str], command: str | None, extra: Sequence[str]) -> NoReturn:
    """Report arguments no parser took, from the parser they were given to: the command's
    (``mla-backends select: error: unrecognized arguments: --bogus``) unless they came before the command."""
    at = list(own).index(command) if command in own else len(own)
    before = set(own[:at])
    target = parser if not command or all(e in before for e in extra) else parser.commands[command]
    known = [o for action in target._actions for o in action.option_strings if o.startswith("--")]
    no_json = f"{command} has no JSON output; " if "--json" in extra and "--json" not in known else ""
    target.error(f"unrecognized arguments: {' '.join(extra)} (supported: {', '.join(known)}; {no_json}"
                 f"`{target.prog} --help` says what each does)")


def _no_json(parser: _Parser, command: str | None) -> NoReturn:
    parser.error(f"argument --json: got it with {command or 'no command'}, which has no JSON output; supported "
                 "with a command that has --json (mla-backends COMMAND --help)")


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passed = split_pass_through(argv)
    _answer_version(own)
    as_json = "--json" in own
    command = None
    options: set[str] = set()
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(own)
        command = args.command
        options = parser.commands[command].option_names if command else parser.option_names
        if extra:
            _unrecognized(parser, own, command, extra)
        if passed is not None and not getattr(args, "accepts_extra", False):
            parser.commands.get(command, parser).error(
                f"unrecognized arguments: -- {' '.join(passed)}".rstrip()
                + f" (supported: arguments after -- only by conformance, for pytest; not by "
                  f"{command or 'no command'})")
        args.extra = passed or []
        if args.global_json:
            if not hasattr(args, "json"):
                _no_json(parser, command)
            args.json = True
        as_json = bool(getattr(args, "json", as_json))
        logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                            format="%(levelname)s %(name)s: %(message)s")
        if not getattr(args, "func", None):
            parser.print_help()
            return 1
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise
    except (Exception, KeyboardInterrupt) as exc:
        return report_error(exc, as_json=as_json, command=command, options=options)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; every error is reported by :func:`report_error` (exit status 2).

    ``--json`` before the command means the same as after it (for the commands that have ``--json``). A stdout
    closed by its reader, or closed before the command starts (``>&-``), ends the command quietly with status
    141 (:mod:`mla_backends.cli.pipes`)."""
    from .pipes import CLOSED_STDOUT_STATUS, flush_stdout, stdout_closed, stdout_missing

    if stdout_missing():  # nothing the command prints could be seen: run nothing, print nothing
        return CLOSED_STDOUT_STATUS
    try:
        status = _run(argv)
        flush_stdout()
        return status
    except BrokenPipeError:
        return stdout_closed()
    except SystemExit:  # --help and --version print, then argparse exits
        try:
            flush_stdout()
        except BrokenPipeError:
            raise SystemExit(stdout_closed()) from None
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
