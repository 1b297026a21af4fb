"""Which SGLang versions the plugin runs on: 0.5.23 is tested (tests/sglang_engine, its CPU engine). SGLang's
attention-backend API moves between patch releases (0.5.23 reworked the forward-metadata hooks), so the range is
that one release; anything else is refused at start-up with the range."""

from __future__ import annotations

import re

__all__ = ["SUPPORTED_RANGE", "TESTED", "UnsupportedSGLangVersionError", "check_sglang_version"]

#: the versions the plugin accepts (as a pip specifier)
SUPPORTED_RANGE = ">=0.5.23,<0.5.24"
#: (major, minor, patch) run end to end by tests/sglang_engine
TESTED = ((0, 5, 23),)


class UnsupportedSGLangVersionError(RuntimeError):
    """The installed SGLang is outside :data:`SUPPORTED_RANGE`."""


def check_sglang_version(version: object) -> str:
    """``"tested"`` for a supported SGLang ``version`` string (``sglang.__version__``, a post or local suffix
    allowed); raises :class:`UnsupportedSGLangVersionError` naming the supported range otherwise."""
    if not isinstance(version, str):
        raise TypeError(f"version: got {type(version).__name__}; supported a version string such as '0.5.23'")
    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)(?![\d])", version)
    key = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None
    pre = bool(m) and bool(re.match(r"\s*(a|b|rc|dev|\.dev)", version[m.end():]))
    if key in TESTED and not pre:
        return "tested"
    raise UnsupportedSGLangVersionError(
        f"SGLang version: got {version}; supported sglang{SUPPORTED_RANGE} (0.5.23 tested). Unset "
        "MLA_BACKENDS_SGLANG to run SGLang without mla-backends, or install sglang==0.5.23 (`make sglang-env`).")
