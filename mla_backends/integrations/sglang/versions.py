"""Which SGLang versions the plugin runs on (data for the core's :class:`~..engine_core.VersionGate`): 0.5.23 is
tested (tests/sglang_engine, its CPU engine). SGLang's attention-backend API moves between patch releases (0.5.23
reworked the forward-metadata hooks), so the range is that one release, pre-releases excluded; anything else is
refused at start-up with the range."""

from __future__ import annotations

from ...core.env_switches import SGLANG_SWITCH
from ..engine_core import UnsupportedEngineVersionError, VersionGate

__all__ = ["SUPPORTED_RANGE", "TESTED", "GATE", "UnsupportedSGLangVersionError", "check_sglang_version"]

#: the versions the plugin accepts (as a pip specifier)
SUPPORTED_RANGE = ">=0.5.23,<0.5.24"
#: (major, minor, patch) run end to end by tests/sglang_engine
TESTED = ((0, 5, 23),)


class UnsupportedSGLangVersionError(UnsupportedEngineVersionError):
    """The installed SGLang is outside :data:`SUPPORTED_RANGE`."""


GATE = VersionGate(engine="SGLang", package="sglang", supported_range=SUPPORTED_RANGE, tested=TESTED,
                   switch=SGLANG_SWITCH, install="sglang==0.5.23 (`make sglang-env`)",
                   error=UnsupportedSGLangVersionError, prereleases=False)


def check_sglang_version(version: object) -> str:
    """``"tested"`` for a supported SGLang ``version`` string (``sglang.__version__``, a post or local suffix
    allowed); raises :class:`UnsupportedSGLangVersionError` naming the supported range otherwise."""
    return GATE.check(version)
