"""Registration with vLLM's attention registry (imports vLLM; called by :func:`..register` when enabled)."""

from __future__ import annotations

from ..engine_core import check_internals
from . import BACKEND_PATH
from .internals import INTERNALS
from .selection import ENGINE
from .versions import check_vllm_version

__all__ = ["register_backends", "registered_members"]

_REGISTERED: list[str] = []


def register_backends() -> list[str]:
    """Register :data:`BACKEND_PATH` as ``AttentionBackendEnum.CUSTOM``, and on vLLM's CPU platform (whose MLA
    selector answers ``CPU_MLA`` whatever was asked) also as ``CPU_MLA``. Returns the members overridden.

    Raises:
        UnsupportedVLLMVersionError: the installed vLLM is outside the supported range (start-up fails).
        VLLMSelectionError: a vLLM internal the adapter uses (:mod:`.internals`) is missing, named.
    """
    import vllm

    check_vllm_version(getattr(vllm, "__version__", "unknown"))
    check_internals(ENGINE, INTERNALS)  # the module-level rows: vLLM's classes and hooks the adapter touches
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = [AttentionBackendEnum.CUSTOM]
    if current_platform.is_cpu():
        members.append(AttentionBackendEnum.CPU_MLA)
    for member in members:
        register_backend(member, BACKEND_PATH)
    _REGISTERED[:] = [m.name for m in members]
    return list(_REGISTERED)


def registered_members() -> list[str]:
    """The members :func:`register_backends` overrode in this process (empty before it ran)."""
    return list(_REGISTERED)
