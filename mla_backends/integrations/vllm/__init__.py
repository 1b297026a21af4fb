"""vLLM on mla-backends: a ``vllm.general_plugins`` plugin that puts vLLM's MLA decode on the backend
``select_backend()`` chooses.

Off unless ``MLA_BACKENDS_VLLM=1`` is set in vLLM's environment (installing mla-backends never changes vLLM by
itself). With it, :func:`register` (the entry point, run by vLLM in every process) registers
:class:`~mla_backends.integrations.vllm.backend.MLABackendsBackend` as ``AttentionBackendEnum.CUSTOM`` (on CUDA:
``--attention-backend CUSTOM``) and, on vLLM's CPU platform, whose selector always answers ``CPU_MLA`` for MLA
models, also as the ``CPU_MLA`` member. Prefill and cache writes stay vLLM's; every decode step calls
``forward_mqa`` of the selected mla-backends class. See docs/integrations.md, "vLLM".

Modules: :mod:`.versions` (supported vLLM versions), :mod:`.selection` (``select_backend()`` from vLLM's
configuration and the declarations vLLM reads), :mod:`.step` (the per-step ``BatchMetadata`` and the cache
wrapper), :mod:`.plugin` and :mod:`.backend` (the parts that import vLLM). Importing this package never
imports vLLM.
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "BACKEND_PATH", "plugin_enabled", "register"]

#: the switch: the plugin does nothing unless this is set to anything but "" or "0"
ENV_VAR = "MLA_BACKENDS_VLLM"
#: the class registered with vLLM's attention registry
BACKEND_PATH = "mla_backends.integrations.vllm.backend.MLABackendsBackend"


def plugin_enabled(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """True when ``MLA_BACKENDS_VLLM`` is set to anything but ``""`` or ``"0"`` (in ``environ``, default
    ``os.environ``)."""
    env = os.environ if environ is None else environ
    return (env.get(ENV_VAR) or "0").strip() not in ("", "0")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend when :func:`plugin_enabled`, else does
    nothing (and imports nothing from vLLM)."""
    if not plugin_enabled():
        return
    from .plugin import register_backends

    register_backends()
