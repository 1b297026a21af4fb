"""What the engine plugins (:mod:`.vllm`, :mod:`.sglang`) share when they call ``select_backend()`` at start-up:
the engine's cache dtype name mapped to mla-backends' name, the selection with a refusal turned into the
engine plugin's own error, and the ``Chosen:`` line of the start-up log. Imports no engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["engine_kv_cache_dtype", "select_or_raise", "chosen_line", "startup_who"]


def engine_kv_cache_dtype(name: object, names: Mapping[str, str], *, engine: str, accepted: str,
                          error: type[Exception]) -> str:
    """mla-backends' cache dtype name for ``engine``'s cache dtype ``name`` (looked up in ``names``, stripped and
    lower-cased). TypeError for a non-string (``accepted`` says what is); ``error`` for an unknown name."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype: got {type(name).__name__}; supported {accepted}")
    key = names.get(name.strip().lower())
    if key is None:
        raise error(f"kv cache dtype: got {engine}'s {name!r}; supported {', '.join(names)} "
                    "(mla-backends' latent cache formats)")
    return key


def select_or_raise(error: Callable[[str], Exception], what: str, **kwargs: Any) -> Any:
    """``select_backend(**kwargs)``; a refusal, an unknown forced backend or bad arguments raise
    ``error("mla-backends cannot run this <what>: <reasons>")``."""
    from selector import select_backend
    from selector.select import SelectionError

    from ..plugins.registry import UnknownBackendError

    try:
        return select_backend(**kwargs)
    except (SelectionError, UnknownBackendError, ValueError, TypeError) as exc:
        raise error(f"mla-backends cannot run this {what}: {exc}") from exc


def chosen_line(selection: Any) -> str:
    """The ``Chosen:`` line of ``selection.explain()`` (``Chosen: <name>`` when it has none)."""
    return next((ln.strip() for ln in selection.explain().splitlines() if ln.strip().startswith("Chosen:")),
                f"Chosen: {selection.name}")


def startup_who(model: str | None, num_heads: int | None) -> str:
    """`` (model M, N heads on this rank)`` for the start-up line, the parts given, or empty."""
    parts = ([f"model {model}"] if model is not None else []) + (
        [f"{num_heads} heads on this rank"] if num_heads is not None else [])
    return f" ({', '.join(parts)})" if parts else ""
