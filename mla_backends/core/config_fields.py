"""Typed, range-checked reads of a model config's fields (a ``config.json``, a dict or a transformers config).

Every reader raises ``TypeError`` (wrong kind of value: a string where an int belongs, a bool as an int, a
string ``"false"`` as a bool, a list where a mapping belongs) or ``ValueError`` (right kind, wrong value: a
non-integral or out-of-range number, NaN or infinity), worded
``"config.<field>: got <value>; supported <what> (<source>)"``, where the source names the file when there is
one. Nothing is truncated or coerced: ``16.7`` heads is an error, not 16; ``True`` is not 1.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .validation import require_finite

__all__ = ["ConfigFields", "read_config_json", "load_json_file"]

_ABSENT = object()


def load_json_file(path: str) -> Any:
    """The JSON document in the file ``path``. Every way the read can fail (the file unreadable, not UTF-8, not
    JSON, or nested past the parser's recursion limit) is a ``ValueError`` saying why; callers add the file
    and what they expected (a config, a checkpoint index, a threshold table)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
    except (OSError, ValueError) as exc:  # ValueError: json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path``, or inside ``path`` when it is a folder (a checkpoint's).

    Raises ``ValueError`` naming the file when it is missing, unreadable or not valid JSON (nested too deeply
    included), ``TypeError`` when it holds something other than a JSON object.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config: got {type(path).__name__}; supported a path to a config.json or its folder")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config: got path {path!r}; supported a config.json file or a folder holding one")
    try:
        data = load_json_file(path)
    except ValueError as exc:
        raise ValueError(f"config: got invalid JSON in {path} ({exc}); supported a JSON object") from None
    if not isinstance(data, dict):
        raise TypeError(f"config: got a JSON {type(data).__name__} in {path}; supported a JSON object "
                        "(a mapping of config keys)")
    return data


class ConfigFields:
    """Reads fields of one config mapping ``d``; ``source`` (a file path, ``"dict"`` ...) goes into errors.

    Absent keys and keys holding ``null`` give the default. ``prefix`` qualifies nested blocks
    (``"rope_scaling."``).
    """

    def __init__(self, d: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.d = d
        self.source = source
        self.prefix = prefix

    def _name(self, key: str) -> str:
        return f"config.{self.prefix}{key}"

    def _where(self) -> str:
        return f" ({self.source})"

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.d.get(key)
        return default if value is None else value

    def _type_error(self, key: str, value: Any, accepted: str) -> TypeError:
        return TypeError(f"{self._name(key)}: got {type(value).__name__} {value!r}; supported {accepted}"
                         f"{self._where()}")

    def _of_type(self, key: str, default: Any, kind: type | tuple[type, ...], accepted: str) -> Any:
        """The value under ``key`` when it is a ``kind`` (``default`` when absent or null); else a TypeError
        naming ``accepted``."""
        value = self.raw(key, None)
        if value is None:
            return default
        if not isinstance(value, kind):
            raise self._type_error(key, value, accepted)
        return value

    def integer(self, key: str, default: Any = _ABSENT, *, minimum: int = 1) -> int:
        """An int ``>= minimum``; an integral float (``4096.0``) is accepted, ``16.7``, ``True`` and ``"16"``
        are not."""
        value = self.raw(key, None)
        if value is None:
            if default is _ABSENT:
                raise ValueError(f"{self._name(key)}: missing; supported an int >= {minimum}{self._where()}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._type_error(key, value, "an int")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{self._name(key)}: got {value!r}; supported a whole number (no truncation)"
                             f"{self._where()}")
        if value < minimum:
            raise ValueError(f"{self._name(key)}: got {value!r}; supported an int >= {minimum}{self._where()}")
        return int(value)

    def optional_int(self, key: str, *, minimum: int = 1) -> int | None:
        return None if self.raw(key) is None else self.integer(key, minimum=minimum)

    def number(self, key: str, default: float, *, positive: bool = False,
              minimum: float | None = None) -> float:
        """A finite real number (``> 0`` with ``positive``, ``>= minimum`` with ``minimum``)."""
        value = self.raw(key, None)
        if value is None:
            return default
        try:
            return require_finite(self._name(key), value, positive=positive, minimum=minimum)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc}{self._where()}") from None

    def flag(self, key: str, default: bool) -> bool:
        """JSON ``true``/``false`` only (a string ``"false"`` or the int 1 is refused, not guessed)."""
        return self._of_type(key, default, bool, "true or false")

    def text(self, key: str, default: str) -> str:
        """A JSON string (a number is refused, not converted)."""
        return self._of_type(key, default, str, "a string")

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        """A nested block (``rope_scaling``) or None; anything but a mapping is a ``TypeError``."""
        return self._of_type(key, None, Mapping, "a mapping (JSON object) or null")

    def nested(self, block: Mapping[str, Any], key: str) -> ConfigFields:
        """A reader of the nested ``block`` found under ``key``, with the same source."""
        return ConfigFields(block, self.source, prefix=f"{self.prefix}{key}.")
