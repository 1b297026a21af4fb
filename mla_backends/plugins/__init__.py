"""Backends by name: the pluggy hook (``hookspecs``: ``hookimpl``), the ``Registry`` (``registry``), the loader and
the process-wide registry (``loading``: ``get_backend``, ``register_backend``), other projects' names for our
backends (``aliases``) and the built-ins, registered through the same hook (``builtins``).

Imports: ``core``, ``step``, ``backends`` and the backend implementations; nothing above.
"""

from typing import Any

_LOADING = ("get_backend", "get_registry", "register_backend", "registered_backends", "load_registry")
__all__ = list(_LOADING)


def __getattr__(name: str) -> Any:  # 0.3's ``from mla_backends.plugins import get_backend`` keeps working
    if name in _LOADING:
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mla_backends.plugins' has no attribute {name!r}")
