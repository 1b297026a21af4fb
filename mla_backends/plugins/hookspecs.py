"""The pluggy hook a backend plugin implements.

A plugin is any importable object (usually a module) exposed through the ``mla_backends`` entry-point group,
with a function marked ``@hookimpl`` named ``register_mla_backends``::

    from mla_backends.plugins.hookspecs import hookimpl

    @hookimpl
    def register_mla_backends(register):
        register(MyBackend, before="TRITON_MLA", archs=("sm90",))

The built-in backends register through the very same hook (``mla_backends.plugins.builtins``).
"""

from __future__ import annotations

from typing import Protocol

import pluggy

__all__ = ["PROJECT_NAME", "hookspec", "hookimpl", "RegisterFn", "MLABackendsSpec"]

#: pluggy project name, also the entry-point group plugins are found under
PROJECT_NAME = "mla_backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterFn(Protocol):
    """The ``register`` callable handed to :func:`MLABackendsSpec.register_mla_backends`."""

    def __call__(
        self,
        backend: type | str,
        *,
        name: str | None = None,
        before: str | None = None,
        after: str | None = None,
        archs: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        """Register one backend.

        Args:
            backend: an ``MLABackend`` subclass, or ``"package.module:ClassName"`` (imported at load time).
            name: expected registered name (checked against the class's ``name``); defaults to it.
            before / after: a built-in backend name; the backend enters the automatic ladders right before
                (after) it, in every ladder that contains that built-in. Without either, the backend is
                selectable only by override (``backend=`` / ``MLA_BACKEND`` / ``--backend``).
            archs: restrict the ladder placement to these families or architectures (``"sm90"``,
                ``"sm100"``, ``"sm86"``, ``"cpu"``); None means every family.
        """


class MLABackendsSpec:
    """Hook specifications of the ``mla_backends`` project."""

    @hookspec
    def register_mla_backends(self, register: RegisterFn) -> None:
        """Register backends by calling ``register(...)`` once per backend (see :class:`RegisterFn`).

        Raising here discards every registration this plugin made in the call; other plugins are unaffected.
        """
