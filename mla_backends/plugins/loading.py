"""Plugin loading: the built-ins and every ``mla_backends`` entry point, each isolated from the others.

Order: the built-ins first (so no plugin can take a built-in name), then entry points sorted by name.
Each plugin gets its own pluggy ``PluginManager`` call; its registrations are staged and committed only when
its hook returns, so a plugin that raises half-way registers nothing. Everything a third-party plugin gets
wrong (import error, hook raising or calling ``sys.exit()``, a hook that returns something (an ``async def`` or
generator hook, classes returned instead of registered), duplicate name, malformed capabilities, bad placement)
becomes a :class:`~mla_backends.plugins.registry.PluginProblem`; a broken *built-in* raises, because that is a
bug here. Plugin code runs under :func:`mla_backends.core.errors.plugin_call`: only Ctrl-C passes through.

``MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD=1`` skips the entry points (the built-ins still load).

Loading is re-entrant: while a plugin's import or hook runs, the read API (``get_registry``,
``registered_backends``, ``get_backend``) answers from the registry being filled (the built-ins and the
plugins loaded before it), and the write API (``register_backend``, ``add_plugin``, ``reset_registry``) is
refused with a :class:`~mla_backends.plugins.registry.RegistrationError`, which becomes that plugin's recorded problem.
Nothing a plugin calls can block the loader. A plugin registers through the ``register`` argument of its hook,
during the hook: a later call raises and is recorded. Two plugins claiming one backend name: see
:func:`run_plugin`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from ..backends.contract import MLABackend, contract_problems
from ..core.env_switches import AUTOLOAD_OFF_SWITCH, switch_on
from ..core.errors import USER_CODE_FAILURES, failure_text, plugin_call
from .hookspecs import PROJECT_NAME, MLABackendsSpec
from .registry import BackendName, PluginProblem, RegisteredBackend, RegistrationError, Registry

__all__ = ["ENTRY_POINT_GROUP", "DISABLE_AUTOLOAD_ENV", "autoload_enabled", "load_registry", "run_plugin",
           "add_plugin", "get_registry", "reset_registry", "get_backend", "registered_backends",
           "register_backend"]

log = logging.getLogger(__name__)

#: entry-point group third-party packages declare their plugin under
ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_AUTOLOAD_ENV = AUTOLOAD_OFF_SWITCH
BUILTIN_PLUGIN = "builtin"


def autoload_enabled() -> bool:
    """False when the switch ``MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD`` is on (parsed by
    :func:`mla_backends.core.env_switches.switch_on`: a value that is no on/off spelling raises
    :class:`~mla_backends.core.env_switches.EnvSwitchError`)."""
    return not switch_on(DISABLE_AUTOLOAD_ENV)


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


# ---- re-entrancy: which registry this thread is filling (plugin code running) ---------------------------
_LOADING = threading.local()


def _filling() -> Registry | None:
    """The registry a plugin's import or hook running in this thread is being loaded into, else None."""
    stack = getattr(_LOADING, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def _plugin_code(registry: Registry) -> Iterator[None]:
    """Mark plugin code (an entry point's import, a hook) as running in this thread, loading ``registry``."""
    stack = getattr(_LOADING, "stack", None)
    if stack is None:
        stack = _LOADING.stack = []
    stack.append(registry)
    try:
        yield
    finally:
        stack.pop()


def _refuse_while_loading(api: str) -> None:
    """Raise when ``api`` (a registry-changing call) is made by a plugin while plugins load."""
    if _filling() is not None:
        raise RegistrationError(
            f"{api}: got a call while plugins load (from a plugin's import or register_mla_backends hook); "
            "supported the hook's register(...) argument during loading, or this call after loading")


def _package(obj: object) -> str:
    """Top-level package of a plugin object (a module or an instance) or of a class."""
    if isinstance(obj, ModuleType):
        module = obj.__name__
    elif isinstance(obj, type):
        module = obj.__module__
    else:
        module = type(obj).__module__
    return (module or "").split(".")[0]


@dataclass
class _Staged:
    backend: Any
    name: str | None
    before: str | None
    after: str | None
    archs: Any


def returned_by_hook(value: object) -> str:
    """The problem of a ``register_mla_backends`` hook that returned ``value`` (anything but None): an ``async
    def`` or generator hook never ran its body (the coroutine or generator is closed here, unawaited), and a
    returned class or list of classes is not a registration."""
    must = "supported a plain def that calls register(backend, ...) for each backend and returns None"
    if inspect.iscoroutine(value) or inspect.isgenerator(value):
        value.close()  # never started: closing it runs none of its code and silences "never awaited"
        kind = "a coroutine (an async def hook)" if inspect.iscoroutine(value) else "a generator (a hook with yield)"
        return f"register_mla_backends: returned {kind}, so its body never ran and nothing was registered; {must}"
    if inspect.isasyncgen(value):
        return ("register_mla_backends: returned an async generator (an async def hook with yield), so its body "
                f"never ran and nothing was registered; {must}")
    shown = value.__name__ if isinstance(value, type) else type(value).__name__
    return (f"register_mla_backends: returned {shown}, which is ignored (returning backends does not register "
            f"them); {must}")


def run_plugin(registry: Registry, plugin_name: str, plugin: object, *, strict: bool = False) -> bool:
    """Run one plugin's ``register_mla_backends`` hook into ``registry``; True when it loaded cleanly.

    With ``strict`` (the built-ins) errors propagate instead of being recorded.
    """
    def fail(stage: str, exc: BaseException | str) -> bool:
        text = exc if isinstance(exc, str) else failure_text(exc)
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
        with plugin_call(f"plugin {plugin_name!r}", "its hook being read"):  # pluggy reads the object's attributes
            pm.register(plugin, name=plugin_name)
    except USER_CODE_FAILURES as exc:  # pluggy.PluginValidationError: wrong hook signature ...
        return fail("hook", exc)
    if not pm.hook.register_mla_backends.get_hookimpls():
        return fail("hook", "no @hookimpl register_mla_backends(register) found in the plugin")

    staged: list[_Staged] = []
    hook_running = True

    def register(backend: Any, *, name: str | None = None, before: str | None = None,
                 after: str | None = None, archs: Any = None) -> None:
        if not hook_running:
            text = (f"register: got a call for {name or getattr(backend, '__name__', backend)!r} after the "
                    "register_mla_backends hook returned; supported calls during the hook (or "
                    "mla_backends.register_backend(...) after loading)")
            registry.record(PluginProblem(plugin=plugin_name, stage="register", error=text))
            raise RegistrationError(text)
        staged.append(_Staged(backend, name, before, after, archs))

    try:
        with _plugin_code(registry), plugin_call(f"plugin {plugin_name!r}", "register_mla_backends hook"):
            returned = pm.hook.register_mla_backends(register=register)
    except USER_CODE_FAILURES as exc:  # a hook calling sys.exit() must not end the caller either
        return fail("hook", exc)
    finally:
        hook_running = False

    clean = True
    for value in returned:  # pluggy collects what the hook returned when it is not None
        clean = fail("hook", returned_by_hook(value))
    for item in staged:
        try:
            with plugin_call(f"plugin {plugin_name!r}", f"importing {item.backend!r}"):
                cls = _resolve(item.backend)
            if not strict and _settle_clash(registry, plugin_name, plugin, cls):
                clean = False
                continue
            registry.add(cls, source=plugin_name, name=item.name, before=item.before, after=item.after,
                         archs=item.archs)
            for text in contract_problems(cls):  # registered and working, but shown by `mla-backends list`
                registry.record(PluginProblem(plugin=plugin_name, stage="contract", error=f"{cls.name}: {text}"))
        except _NotBuilt as exc:
            log.debug("backend %s not registered: %s", item.name or item.backend, exc)
            registry.record(PluginProblem(plugin=plugin_name, stage="missing",
                                          error=f"{item.name or item.backend}: {exc}"))
            clean = False
        except USER_CODE_FAILURES as exc:  # RegistrationError, or an import error of a 'module:Class' target
            label = item.name or getattr(item.backend, "__name__", item.backend)
            fail("register", f"{label}: {failure_text(exc)}" if not strict else exc)
            clean = False
    registry.mark_loaded(plugin_name)
    return clean


def _settle_clash(registry: Registry, plugin_name: str, plugin: object, cls: type) -> bool:
    """Resolve ``cls`` claiming a name another *plugin* already holds; True when ``cls`` must not be added.

    The problem goes to the offender, not the victim. The owner is the plugin whose own package defines the
    class: when the earlier plugin registered a class of this plugin's package, the name moves here and the
    earlier plugin gets the problem. When both define their own class, load order keeps the first and the
    problem is recorded against both (neither can be shown to be the owner). Built-in names are never moved
    (:meth:`Registry.add` refuses them with the problem recorded against the newcomer).
    """
    name = getattr(cls, "name", None)
    prev = registry.entry(name) if isinstance(name, str) else None
    if prev is None or prev.source in (BUILTIN_PLUGIN, plugin_name) or prev.source not in registry.plugins:
        return False
    if _package(prev.cls) == _package(cls) == _package(plugin):  # the earlier plugin registered our class
        registry.remove(prev.name)
        registry.record(PluginProblem(plugin=prev.source, stage="register", error=(
            f"{prev.name}: name: got a class of package {_package(cls)!r}, which plugin {plugin_name!r} "
            f"registers itself; supported registering only your own backends (the name went to {plugin_name!r})")))
        return False
    registry.record(PluginProblem(plugin=plugin_name, stage="register", error=(
        f"{cls.__name__}: RegistrationError: name: got {prev.name!r}, already registered by {prev.source!r}; "
        "supported a unique name")))
    registry.record(PluginProblem(plugin=prev.source, stage="register", error=(
        f"{prev.name}: name: also claimed by plugin {plugin_name!r} (kept for {prev.source!r}, loaded first); "
        "supported a unique name")))
    return True


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    eps = entry_points(group=ENTRY_POINT_GROUP)
    seen: dict[str, Any] = {}
    for ep in eps:
        seen.setdefault(ep.name, ep)  # the first distribution on sys.path wins, as for imports
    return [seen[k] for k in sorted(seen)]


def load_registry(*, autoload: bool | None = None) -> Registry:
    """A new registry with the built-ins and (unless disabled) every entry-point plugin."""
    from . import builtins as builtin_backends

    registry = Registry()
    run_plugin(registry, BUILTIN_PLUGIN, builtin_backends, strict=True)
    if autoload is None:
        autoload = autoload_enabled()
    if not autoload:
        log.debug("plugin autoload disabled (%s)", DISABLE_AUTOLOAD_ENV)
        return registry
    for ep in _entry_points():
        try:
            with _plugin_code(registry), plugin_call(f"plugin {ep.name!r}", "import"):
                plugin = ep.load()
        except USER_CODE_FAILURES as exc:
            error = failure_text(exc)
            log.warning("mla_backends plugin %r failed to import: %s", ep.name, error)
            registry.record(PluginProblem(plugin=ep.name, stage="import", error=error))
            continue
        run_plugin(registry, ep.name, plugin)
    return registry


def add_plugin(plugin: object, name: str | None = None) -> bool:
    """Run a plugin object (module or instance with the hook) into the process-wide registry now.

    For engines that ship backends without an entry point. Problems are recorded like entry-point ones.
    """
    _refuse_while_loading("add_plugin")
    if name is None:
        name = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__name__
    return run_plugin(get_registry(), name, plugin)


# ---- the process-wide registry ------------------------------------------------------------------------
_REGISTRY: Registry | None = None
_LOAD_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, filled on first use (built-ins, then entry-point plugins).

    Called by a plugin while plugins load (its import or hook), it returns the registry being filled.
    """
    global _REGISTRY
    filling = _filling()
    if filling is not None:
        return filling
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
    _refuse_while_loading("reset_registry")
    with _LOAD_LOCK:
        _REGISTRY = registry


def registered_backends() -> dict[str, type[MLABackend]]:
    """Every registered backend by name, built-ins first, then plugins in load order."""
    return {e.name: e.cls for e in get_registry().entries()}


def get_backend(name: str | BackendName | type[MLABackend]) -> type[MLABackend]:
    """Resolve a backend by (case-insensitive) name, enum member, class, ``"package.module:Class"`` import
    path or another project's name for the same kernel (``"CUTLASS_MLA"``, ``"trtllm_mla"``; see
    :mod:`mla_backends.plugins.aliases`; a registered name wins over an alias)."""
    return get_registry().get(name)


def register_backend(cls: type[MLABackend], *, before: str | None = None, after: str | None = None,
                     archs: object = None, source: str = "api") -> RegisteredBackend:
    """Register a backend class directly (no entry point); raises :class:`RegistrationError` when rejected
    (also when called by a plugin while plugins load: a plugin registers through its hook's ``register``)."""
    _refuse_while_loading("register_backend")
    return get_registry().add(cls, source=source, before=before, after=after, archs=archs)
