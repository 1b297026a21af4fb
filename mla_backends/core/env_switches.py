"""Every on/off environment switch the project reads, parsed one way, here (no heavy imports).

A switch is on for ``1``, ``true``, ``yes``, ``on`` and off for ``0``, ``false``, ``no``, ``off``, the empty
string, or when it is unset; letters may be in any case. Anything else (``2``, ``00``, ``y``, ``" 1"`` with a
space, ``enabled``) is refused with :class:`EnvSwitchError` naming the variable, the value and the accepted
spellings, rather than guessed: a switch that means the opposite of what was written is worse than an error.
``TRITON_INTERPRET`` is Triton's own variable; every spelling accepted here means the same to Triton (it reads
``1``/``true``/``yes``/``on``/``y`` as on and everything else as off), and the values Triton would read
differently from a reader's guess are the refused ones.

:data:`SWITCHES` lists the switches (name -> what turning it on does); ``mla-backends env`` reports each with
its parsed state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["TRUE_SPELLINGS", "FALSE_SPELLINGS", "SWITCHES", "VLLM_SWITCH", "SGLANG_SWITCH", "AUTOLOAD_OFF_SWITCH",
           "TRITON_INTERPRET_SWITCH", "EnvSwitchError", "parse_switch", "switch_on", "describe_switch"]

#: spellings that turn a switch on (compared case-insensitively, nothing stripped)
TRUE_SPELLINGS: tuple[str, ...] = ("1", "true", "yes", "on")
#: spellings that leave it off (the empty string too, and an unset variable)
FALSE_SPELLINGS: tuple[str, ...] = ("0", "false", "no", "off", "")

VLLM_SWITCH = "MLA_BACKENDS_VLLM"
SGLANG_SWITCH = "MLA_BACKENDS_SGLANG"
AUTOLOAD_OFF_SWITCH = "MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD"
TRITON_INTERPRET_SWITCH = "TRITON_INTERPRET"

#: every boolean switch of the project -> what "on" does
SWITCHES: dict[str, str] = {
    VLLM_SWITCH: "on: the vLLM plugin runs vLLM's MLA decode on mla-backends",
    SGLANG_SWITCH: "on: the SGLang plugin registers --attention-backend mla_backends (absorbed MLA on mla-backends)",
    AUTOLOAD_OFF_SWITCH: "on: skips entry-point plugins (built-ins still load)",
    TRITON_INTERPRET_SWITCH: "on: Triton kernels run interpreted on the CPU (testing only)",
}


class EnvSwitchError(ValueError):
    """An on/off environment variable holds a value that is none of the accepted spellings."""


def _accepted() -> str:
    return (f"true {', '.join(TRUE_SPELLINGS)}; false {', '.join(repr(s) if not s else s for s in FALSE_SPELLINGS)}"
            " or unset (any letter case)")


def parse_switch(name: str, value: str | None) -> bool:
    """The state of switch ``name`` holding ``value`` (None: unset). Raises :class:`EnvSwitchError` for a
    value that is no accepted spelling, naming ``name``, the value and the spellings."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: got {name!r}; supported an environment variable name")
    if value is None:
        return False
    if not isinstance(value, str):
        raise TypeError(f"{name}: got {type(value).__name__}; supported a string (the variable's value)")
    low = value.lower()
    if low in TRUE_SPELLINGS:
        return True
    if low in FALSE_SPELLINGS:
        return False
    raise EnvSwitchError(f"{name}: got {value!r}; supported {_accepted()}")


def switch_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """:func:`parse_switch` of ``name`` as set in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return parse_switch(name, env.get(name))


def describe_switch(name: str, environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """``{"value": raw value or None, "on": bool or None, "error": message or None}`` for ``name`` (never
    raises on a bad value: reports quote it and the error)."""
    env = os.environ if environ is None else environ
    value = env.get(name)
    try:
        return {"value": value, "on": parse_switch(name, value), "error": None}
    except EnvSwitchError as exc:
        return {"value": value, "on": None, "error": str(exc)}
