"""Registration with SGLang (imports SGLang; called by :func:`..register`): the attention backend ``mla_backends``
in SGLang's backend registry and ``--attention-backend`` choices, and its DeepSeek dispatch handler in SGLang's
``AttentionBackendRegistry`` (when the switch is on); the start-up refusal when the switch holds a value that is
no on/off spelling (:func:`refuse_startup`)."""

from __future__ import annotations

from typing import Any

from . import BACKEND_NAME
from .versions import UnsupportedSGLangVersionError, check_sglang_version

__all__ = ["register_backend", "create_backend", "handle_attention", "registered", "refuse_startup", "REFUSAL_TARGET"]

#: the SGLang function the refusal hooks: it runs once, in the process that starts SGLang (``Engine`` and
#: ``launch_server`` alike), after the plugins are loaded and before any SGLang process is spawned
REFUSAL_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"

_STATE: dict[str, Any] = {"registered": False, "version_error": None}


def create_backend(runner: Any) -> Any:
    """The factory SGLang's registry calls with its model runner: the version check (SGLang logs and ignores a
    plugin that raises, so an unsupported version fails here, where start-up stops), then the backend."""
    error = _STATE["version_error"]
    if error is not None:
        raise UnsupportedSGLangVersionError(str(error))
    from .backend import MLABackendsAttnBackend

    return MLABackendsAttnBackend(runner)


def handle_attention(attn: Any, forward_batch: Any) -> Any:
    """SGLang's DeepSeek dispatch hook for ``mla_backends``: which forward method a batch takes.

    Decode (and idle) batches: absorbed MLA. An extend batch: mla-backends' decision, made once per batch in the
    backend's metadata hook (the plan's runs under :func:`.step.sglang_policy`: the measured threshold table
    when ``MLA_BACKENDS_THRESHOLD_TABLE`` names one, else SGLang's per-batch rule; absorbed when every run is):
    absorbed MLA, or SGLang's MHA
    prepare (its ``prepare_prefill_qkv`` hook is the backend's), which hands the latent on to ``forward_mha``.
    """
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from .backend import MLABackendsAttnBackend

    mode = forward_batch.forward_mode
    if not mode.is_extend_without_speculative():
        return AttnForwardMethod.MLA
    backend = get_attn_backend()
    if not isinstance(backend, MLABackendsAttnBackend):  # e.g. two-batch overlap's wrapper: not supported
        raise RuntimeError(f"mla-backends: the DeepSeek handler for {BACKEND_NAME!r} found attention backend "
                           f"{type(backend).__name__}; supported MLABackendsAttnBackend (the one it registered)")
    return AttnForwardMethod.MLA if backend.batch_absorbed(forward_batch) else AttnForwardMethod.MHA


def register_backend() -> None:
    """Register ``mla_backends`` with SGLang (idempotent). On an SGLang outside the supported range the name is
    still registered, with a factory that fails at start-up naming the range (a plugin exception would only be
    logged by SGLang, and ``--attention-backend mla_backends`` would then fail as an unknown choice)."""
    if _STATE["registered"]:
        return
    import sglang

    try:
        check_sglang_version(str(getattr(sglang, "__version__", "unknown")))
    except UnsupportedSGLangVersionError as exc:
        _STATE["version_error"] = exc
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if _STATE["version_error"] is None:
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

        AttentionBackendRegistry.register(BACKEND_NAME, handle_attention)
    _STATE["registered"] = True


def refuse_startup(error: Exception) -> None:
    """The switch holds a value that is no on/off spelling (``error``, an ``EnvSwitchError`` naming the variable
    and the value). SGLang only logs what a plugin raises and starts anyway, so the plugin logs one line saying
    so and hooks :data:`REFUSAL_TARGET` to raise ``error`` there: SGLang's start-up then fails with it, whatever
    ``--attention-backend`` says. Without SGLang's hook registry (another SGLang) ``error`` is raised here."""
    import logging

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        raise error from None

    logging.getLogger("sglang.mla_backends").error(
        "mla-backends: %s. SGLang's start-up is refused (ServerArgs.check_server_args raises this).", error)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise error

    HookRegistry.register(REFUSAL_TARGET, refuse, HookType.BEFORE)


def registered() -> bool:
    """True once :func:`register_backend` ran in this process."""
    return bool(_STATE["registered"])
