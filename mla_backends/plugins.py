"""Plugin loading: the built-ins and every ``mla_backends`` entry point, each isolated from the others.

Order: the built-ins first (so no plugin can take a built-in name), then entry points sorted by name.
Each plugin gets its own pluggy ``PluginManager`` call; its registrations are staged and committed only when
its hook returns, so a plugin that raises half-way registers nothing. Everything a third-party plugin gets
wrong (import error, hook raising, duplicate name, malformed capabilities, bad placement) becomes a
:class:`~mla_backends.registry.PluginProblem`; a broken *built-in* raises, because that is a bug here.

``MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD=1`` skips the entry points (the built-ins still load).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from .backend import MLABackend, contract_problems
from .hookspecs import PROJECT_NAME, MLABackendsSpec
from .registry import BackendName, PluginProblem, RegisteredBackend, RegistrationError, Registry

__all__ = ["ENTRY_POINT_GROUP", "DISABLE_AUTOLOAD_ENV", "autoload_enabled", "load_registry", "run_plugin",
           "add_plugin", "get_registry", "reset_registry", "get_backend", "registered_backends",
           "register_backend"]

log = logging.getLogger(__name__)

#: entry-point group third-party packages declare their plugin under
ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_PLUGIN = "builtin"


def autoload_enabled() -> bool:
    """False when ``MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD`` is set to 1/true/yes/on."""
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


class _NotBuilt(Exception):
    """A ``module:Class`` target whose module is absent from this installation."""


def _resolve(target: Any) -> Any:
    """``"pkg.module:Class"`` -> the class (imported now); anything else is returned unchanged."""
    if not isinstance(target, str):
        return target
    mod_name, sep, attr = target.partition(":")
    if not sep or not mod_name or not attr:
        raise RegistrationError(f"backend: got {target!r}; supported a class or 'package.module:ClassName'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        # only the target module (or a parent of it) being absent counts as "not built"; a missing
        # dependency inside it is a real error
        if exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise _NotBuilt(f"module {mod_name} is not part of this installation") from exc
        raise
    return getattr(module, attr)


@dataclass
class _Staged:
    backend: Any
    name: str | None
    before: str | None
    after: str | None
    archs: Any


def run_plugin(registry: Registry, plugin_name: str, plugin: object, *, strict: bool = False) -> bool:
    """Run one plugin's ``register_mla_backends`` hook into ``registry``; True when it loaded cleanly.

    With ``strict`` (the built-ins) errors propagate instead of being recorded.
    """
    def fail(stage: str, exc: BaseException | str) -> bool:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if strict:
            if isinstance(exc, BaseException):
                raise exc
            raise RegistrationError(text)
        log.warning("mla_backends plugin %r failed (%s): %s", plugin_name, stage, text)
        registry.record(PluginProblem(plugin=plugin_name, stage=stage, error=text))
        return False

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(MLABackendsSpec)
    try:
        pm.register(plugin, name=plugin_name)
    except Exception as exc:  # pluggy.PluginValidationError: wrong hook signature ...
        return fail("hook", exc)
    if not pm.hook.register_mla_backends.get_hookimpls():
        return fail("hook", "no @hookimpl register_mla_backends(register) found in the plugin")

    staged: list[_Staged] = []

    def register(backend: Any, *, name: str | None = None, before: str | None = None,
                 after: str | None = None, archs: Any = None) -> None:
        staged.append(_Staged(backend, name, before, after, archs))

    try:
        pm.hook.register_mla_backends(register=register)
    except Exception as exc:
        return fail("hook", exc)

    clean = True
    for item in staged:
        try:
            cls = _resolve(item.backend)
            registry.add(cls, source=plugin_name, name=item.name, before=item.before, after=item.after,
                         archs=item.archs)
            for text in contract_problems(cls):  # registered and working, but shown by `mla-backends list`
                registry.record(PluginProblem(plugin=plugin_name, stage="contract", error=f"{cls.name}: {text}"))
        except _NotBuilt as exc:
            log.debug("backend %s not registered: %s", item.name or item.backend, exc)
            registry.record(PluginProblem(plugin=plugin_name, stage="missing",
                                          error=f"{item.name or item.backend}: {exc}"))
            clean = False
        except Exception as exc:  # RegistrationError, or an import error of a 'module:Class' target
            label = item.name or getattr(item.backend, "__name__", item.backend)
            fail("register", f"{label}: {type(exc).__name__}: {exc}" if not strict else exc)
            clean = False
    registry.mark_loaded(plugin_name)
    return clean


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    eps = entry_points(group=ENTRY_POINT_GROUP)
    seen: dict[str, Any] = {}
    for ep in eps:
        seen.setdefault(ep.name, ep)  # the first distribution on sys.path wins, as for imports
    return [seen[k] for k in sorted(seen)]


def load_registry(*, autoload: bool | None = None) -> Registry:
    """A new registry with the built-ins and (unless disabled) every entry-point plugin."""
    from . import builtin_backends

    registry = Registry()
    run_plugin(registry, BUILTIN_PLUGIN, builtin_backends, strict=True)
    if autoload is None:
        autoload = autoload_enabled()
    if not autoload:
        log.debug("plugin autoload disabled (%s)", DISABLE_AUTOLOAD_ENV)
        return registry
    for ep in _entry_points():
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as exc:
            log.warning("mla_backends plugin %r failed to import: %s: %s", ep.name, type(exc).__name__, exc)
            error = f"{type(exc).__name__}: {exc}"
            registry.record(PluginProblem(plugin=ep.name, stage="import", error=error))
            continue
        run_plugin(registry, ep.name, plugin)
    return registry


def add_plugin(plugin: object, name: str | None = None) -> bool:
    """Run a plugin object (module or instance with the hook) into the process-wide registry now.

    For engines that ship backends without an entry point. Problems are recorded like entry-point ones.
    """
    if name is None:
        name = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__name__
    return run_plugin(get_registry(), name, plugin)


# ---- the process-wide registry ------------------------------------------------------------------------
_REGISTRY: Registry | None = None
_LOAD_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, filled on first use (built-ins, then entry-point plugins)."""
    global _REGISTRY
    reg = _REGISTRY
    if reg is None:
        with _LOAD_LOCK:
            if _REGISTRY is None:
                _REGISTRY = load_registry()
            reg = _REGISTRY
    return reg


def reset_registry(registry: Registry | None = None) -> None:
    """Drop (or replace) the process-wide registry; the next use reloads plugins. Mainly for tests."""
    global _REGISTRY
    with _LOAD_LOCK:
        _REGISTRY = registry


def registered_backends() -> dict[str, type[MLABackend]]:
    """Every registered backend by name, built-ins first, then plugins in load order."""
    return {e.name: e.cls for e in get_registry().entries()}


def get_backend(name: str | BackendName | type[MLABackend]) -> type[MLABackend]:
    """Resolve a backend by (case-insensitive) name, enum member, class, ``"package.module:Class"`` import
    path or another project's name for the same kernel (``"CUTLASS_MLA"``, ``"trtllm_mla"``; see
    :mod:`mla_backends.aliases`; a registered name wins over an alias)."""
    return get_registry().get(name)


def register_backend(cls: type[MLABackend], *, before: str | None = None, after: str | None = None,
                     archs: object = None, source: str = "api") -> RegisteredBackend:
    """Register a backend class directly (no entry point); raises :class:`RegistrationError` when rejected."""
    return get_registry().add(cls, source=source, before=before, after=after, archs=archs)
