"""SGLang on mla-backends: a ``sglang.srt.plugins`` plugin that puts SGLang's absorbed MLA attention on the backend
``select_backend()`` chooses.

Off unless the switch ``MLA_BACKENDS_SGLANG`` is on in SGLang's environment (``1``/``true``/``yes``/``on``; parsed
by :mod:`mla_backends.core.env_switches`, which refuses spellings it does not know; installing mla-backends never
changes SGLang by itself). With it, :func:`register` (the entry point, which SGLang runs in every process)
registers the attention backend ``mla_backends`` (``--attention-backend mla_backends``; the factory makes
:class:`~mla_backends.integrations.sglang.backend.MLABackendsAttnBackend`) and its DeepSeek dispatch handler. The
cache and its writes stay SGLang's (its token-to-KV pool); every absorbed call runs ``forward_mqa`` of the
selected mla-backends class on that pool wrapped without a copy; prefill SGLang routes to its MHA path is
computed by the backend with PyTorch's SDPA. See docs/integrations.md, "SGLang".

Modules: :mod:`.versions` (supported SGLang versions), :mod:`.selection` (``select_backend()`` from SGLang's model
runner), :mod:`.step` (the per-batch ``BatchMetadata``, the dispatch decision and the cache wrapper),
:mod:`.plugin` and :mod:`.backend` (the parts that import SGLang). Importing this package never imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.env_switches import SGLANG_SWITCH, switch_on

__all__ = ["ENV_VAR", "BACKEND_NAME", "plugin_enabled", "register"]

#: the switch: the plugin does nothing unless it is on (:data:`mla_backends.core.env_switches.TRUE_SPELLINGS`)
ENV_VAR = SGLANG_SWITCH
#: the name SGLang's ``--attention-backend`` takes once the plugin registered it
BACKEND_NAME = "mla_backends"


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when the switch ``MLA_BACKENDS_SGLANG`` is on (in ``environ``, default ``os.environ``); a value that
    is no on/off spelling raises :class:`~mla_backends.core.env_switches.EnvSwitchError`."""
    return switch_on(ENV_VAR, environ)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: registers the backend and its handler when
    :func:`plugin_enabled`, else does nothing (and imports nothing from SGLang)."""
    if not plugin_enabled():
        return
    from .plugin import register_backend

    register_backend()
