"""Registration with SGLang (imports SGLang; called by :func:`..register` when enabled): the attention backend
``mla_backends`` in SGLang's backend registry and ``--attention-backend`` choices, and its DeepSeek dispatch
handler in SGLang's ``AttentionBackendRegistry``."""

from __future__ import annotations

from typing import Any

from . import BACKEND_NAME
from .versions import UnsupportedSGLangVersionError, check_sglang_version

__all__ = ["register_backend", "create_backend", "handle_attention", "registered"]

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

    Decode (and idle, verify, draft) batches: absorbed MLA. A plain extend batch: mla-backends' decision, made
    once per batch in the backend's metadata hook (:func:`.step.batch_absorbed`, the measured threshold table
    when ``MLA_BACKENDS_THRESHOLD_TABLE`` names one, else SGLang's per-batch rule): absorbed MLA, or SGLang's
    one-shot MHA (its own code expands the cached prefix and the new tokens; the backend attends over them).
    """
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from .backend import MLABackendsAttnBackend

    mode = forward_batch.forward_mode
    if not mode.is_extend_without_speculative():
        return AttnForwardMethod.MLA
    backend = get_attn_backend()
    backend = getattr(backend, "primary", backend)  # two-batch overlap wraps the backend
    if not isinstance(backend, MLABackendsAttnBackend):
        raise RuntimeError(f"mla-backends: the DeepSeek handler for {BACKEND_NAME!r} found attention backend "
                           f"{type(backend).__name__}; supported MLABackendsAttnBackend (the one it registered)")
    return AttnForwardMethod.MLA if backend.batch_absorbed(forward_batch) else AttnForwardMethod.MHA_ONE_SHOT


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


def registered() -> bool:
    """True once :func:`register_backend` ran in this process."""
    return bool(_STATE["registered"])
