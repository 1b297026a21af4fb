"""Backends by name: the pluggy hook (``hookspecs``: ``hookimpl``), the ``Registry`` (``registry``), the loader and
the process-wide registry (``loading``: ``get_backend``, ``register_backend``), other projects' names for our
backends (``aliases``) and the built-ins, registered through the same hook (``builtins``).

Imports: ``core``, ``step``, ``backends`` and the backend implementations; nothing above.
"""

import warnings
from typing import Any

_LOADING = ("get_backend", "get_registry", "register_backend", "registered_backends", "load_registry")
#: what 0.3's ``mla_backends.plugins`` module also gave, in ``mla_backends.plugins.loading`` since 0.4: served here
#: with a ``DeprecationWarning`` for one release, like the other 0.3 paths (``mla_backends._legacy``)
_MOVED_0_3 = ("ENTRY_POINT_GROUP", "DISABLE_AUTOLOAD_ENV", "autoload_enabled", "run_plugin", "add_plugin",
              "reset_registry")
__all__ = list(_LOADING)


def __getattr__(name: str) -> Any:  # 0.3's ``from mla_backends.plugins import get_backend`` keeps working
    if name in _LOADING or name in _MOVED_0_3:
        from . import loading

        if name in _MOVED_0_3:
            warnings.warn(f"mla_backends.plugins.{name} moved to mla_backends.plugins.loading.{name} in "
                          "mla-backends 0.4; import it from there; the old path goes in 0.6", DeprecationWarning,
                          stacklevel=2)
        return getattr(loading, name)
    raise AttributeError(f"module 'mla_backends.plugins' has no attribute {name!r}")
