"""SGLang on mla-backends: a ``sglang.srt.plugins`` plugin that puts SGLang's MLA attention on the backend
``select_backend()`` chooses.

Off unless the switch ``MLA_BACKENDS_SGLANG`` is on in SGLang's environment (``1``/``true``/``yes``/``on``; parsed
by :mod:`mla_backends.core.env_switches`; installing mla-backends never changes SGLang by itself; a value that is
no on/off spelling refuses SGLang's start-up). With it, :func:`register` (the entry point, which SGLang runs in
every process) registers the attention backend ``mla_backends`` (``--attention-backend mla_backends``; the factory
makes :class:`~mla_backends.integrations.sglang.backend.MLABackendsAttnBackend`) and its DeepSeek dispatch
handler. The cache stays SGLang's token-to-KV pool, read and written in place (fp8 rows with the layer's scale);
absorbed batches run ``forward_mqa`` of the selected class, expanded ones the library's ``forward_mha``. See
docs/integrations.md, "SGLang".

Modules: :mod:`.versions` (supported SGLang versions), :mod:`.selection` (``select_backend()`` from SGLang's model
runner), :mod:`.step` (the per-batch ``BatchMetadata``, the dispatch decision, the pool's pages, the expanded
path's up-projection), :mod:`.internals` (every SGLang internal the adapter touches), :mod:`.plugin` and
:mod:`.backend` (the parts that import SGLang). The engine-neutral part is :mod:`..engine_core`. Importing this
package never imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.env_switches import SGLANG_SWITCH, EnvSwitchError, switch_on

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
    """The ``sglang.srt.plugins`` entry point: registers the backend and its handler when :func:`plugin_enabled`;
    does nothing (and imports nothing from SGLang) when the switch is off; refuses SGLang's start-up
    (:func:`.plugin.refuse_startup`) when it holds a value that is no on/off spelling."""
    try:
        on = plugin_enabled()
    except EnvSwitchError as exc:
        from .plugin import refuse_startup

        refuse_startup(exc)
        return
    if not on:
        return
    from .plugin import register_backend

    register_backend()
