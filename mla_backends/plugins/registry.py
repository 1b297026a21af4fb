"""Backend names and the registry every backend (built-in or plugin) is registered in.

This module holds the data structure only. The process-wide registry (``get_registry``, ``get_backend``,
``registered_backends``, ``register_backend``, ``reset_registry``) lives next to the loader that fills it,
in :mod:`mla_backends.plugins.loading`: the built-ins through the same ``register_mla_backends`` hook as third-party
plugins, then every entry point of the ``mla_backends`` group (unless
``MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD=1``). Faulty plugins are recorded as :class:`PluginProblem`, never
raised: selection keeps working and ``explain()`` / ``mla-backends list`` show what went wrong.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import os
import re
import sys
import threading
from dataclasses import dataclass

from ..backends.contract import Capabilities, MLABackend
from ..core.errors import USER_CODE_FAILURES, failure_text, plugin_call
from .aliases import alias_names, alias_target, not_provided_note

__all__ = [
    "BackendName",
    "UnknownBackendError",
    "RegistrationError",
    "Placement",
    "RegisteredBackend",
    "PluginProblem",
    "Registry",
    "validate_backend_class",
    "RESERVED_NAMES",
]


class BackendName(enum.StrEnum):
    """Built-in backend names (case-insensitive on input: ``BackendName("triton_mla")`` works, and so do
    vLLM's and SGLang's names for the same kernel: ``BackendName("cutlass_mla")``, see
    :mod:`mla_backends.plugins.aliases`)."""

    REF_TORCH = "REF_TORCH"
    CPU_FUSED = "CPU_FUSED"
    TRITON_MLA = "TRITON_MLA"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    FLASHINFER_MLA_CUTLASS = "FLASHINFER_MLA_CUTLASS"
    FLASHINFER_MLA_TRTLLM = "FLASHINFER_MLA_TRTLLM"
    FLASHINFER_MLA_XQA = "FLASHINFER_MLA_XQA"

    @classmethod
    def _missing_(cls, value: object) -> BackendName | None:
        if isinstance(value, str):
            key = value.strip().upper()
            target = alias_target(value)
            for member in cls:
                if member.value in (key, target):
                    return member
        return None


class UnknownBackendError(ValueError):
    """A backend name that is not registered; the message lists the valid names and the closest one."""


class RegistrationError(ValueError):
    """A backend that cannot be registered (wrong type, duplicate name, malformed capabilities ...)."""


_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
#: names no backend may take: ``backend="auto"`` / ``MLA_BACKEND=auto`` mean automatic selection
RESERVED_NAMES = ("AUTO",)
_ARCH_RE = re.compile(r"^(cpu|sm\d{2,3})$")


@dataclass(frozen=True)
class Placement:
    """Where a plugin backend enters the automatic ladders: right ``before`` or ``after`` a built-in.

    ``archs`` restricts it to ladder families (``"sm90"``, ``"sm100"``...) or single architectures
    (``"sm86"``); None means all. Built-ins keep their relative order whatever plugins ask.
    """

    before: str | None = None
    after: str | None = None
    archs: frozenset[str] | None = None

    @property
    def anchor(self) -> str:
        return self.before or self.after or ""

    def applies_to(self, family: str, arch_label: str) -> bool:
        return self.archs is None or family in self.archs or arch_label in self.archs

    def describe(self) -> str:
        where = f"before {self.before}" if self.before else f"after {self.after}"
        return where + ("" if self.archs is None else f" on {', '.join(sorted(self.archs))}")


@dataclass(frozen=True)
class RegisteredBackend:
    """One registry entry: the class, the plugin that registered it and its optional ladder placement."""

    name: str
    cls: type[MLABackend]
    source: str
    placement: Placement | None = None


@dataclass(frozen=True)
class PluginProblem:
    """Something a plugin got wrong, kept for ``explain()`` and ``mla-backends list``.

    ``stage``: ``import`` (the entry point failed to load), ``hook`` (its hook raised), ``register`` (a
    registration was rejected: duplicate name, malformed capabilities, bad placement), ``contract`` (registered
    and working, but departing from the backend contract: it overrides ``forward_mqa``, see
    :func:`~mla_backends.backends.contract.contract_problems`)
    or ``missing`` (a built-in module that is not part of this
    installation).
    """

    plugin: str
    stage: str
    error: str

    def describe(self) -> str:
        return f"plugin {self.plugin!r} ({self.stage}): {self.error}"


def validate_backend_class(cls: object) -> list[str]:
    """Problems that stop ``cls`` from being registered (empty when it is a well-formed backend)."""
    if not (isinstance(cls, type) and issubclass(cls, MLABackend)):
        return [f"backend: got {cls!r}; supported an MLABackend subclass"]
    problems = []
    name = getattr(cls, "name", None)
    if (not isinstance(name, str) or not _NAME_RE.match(name.strip().upper()) or name == MLABackend.name
            or name.strip().upper() in RESERVED_NAMES):
        problems.append(f"name: got {name!r}; supported a new identifier such as 'MY_MLA' (not "
                        f"{', '.join(RESERVED_NAMES)}: they mean 'let the selector choose')")
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append(f"capabilities: got {type(caps).__name__}; supported a Capabilities instance")
    else:
        try:
            with plugin_call(cls, "capabilities.problems()"):  # a Capabilities subclass may run its own code
                problems += [f"capabilities: {p}" for p in caps.problems()]
        except USER_CODE_FAILURES as exc:  # a declaration so broken its own checks fail
            problems.append(f"capabilities: unreadable ({failure_text(exc)})")
    base = MLABackend
    if (cls.forward_mqa_kernel is base.forward_mqa_kernel and cls._forward_mqa_impl is base._forward_mqa_impl
            and cls.forward_mqa is base.forward_mqa):
        problems.append("forward_mqa_kernel: got the abstract base method; supported an implementation")
    return problems


def _placement(before: object, after: object, archs: object) -> Placement | None:
    if before is None and after is None:
        if archs is not None:
            raise RegistrationError("placement: got archs without before/after; supported before= or after= "
                                    "a built-in name")
        return None
    if before is not None and after is not None:
        raise RegistrationError(f"placement: got before={before!r} and after={after!r}; supported only one")
    anchor = before if before is not None else after
    try:
        anchor_name = BackendName(anchor).value
    except ValueError:
        raise RegistrationError(f"placement: got {anchor!r}; supported a built-in name "
                                f"({', '.join(m.value for m in BackendName)})") from None
    arch_set = None
    if archs is not None:
        if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):  # type: ignore[union-attr]
            raise RegistrationError(f"archs: got {archs!r}; supported a list such as ['sm90', 'sm100']")
        arch_set = frozenset(a.strip().lower() for a in archs)  # type: ignore[union-attr]
        bad = sorted(a for a in arch_set if not _ARCH_RE.match(a))
        if bad or not arch_set:
            raise RegistrationError(f"archs: got {bad or list(arch_set)}; supported 'cpu' or 'smNN' names")
    return Placement(before=anchor_name if before is not None else None,
                     after=anchor_name if after is not None else None, archs=arch_set)


class Registry:
    """Name -> backend class, the plugin problems met while filling it, and a generation counter.

    Thread-safe. ``generation`` increases on every change so that selection caches can key on it.
    """

    def __init__(self) -> None:
        self._entries: dict[str, RegisteredBackend] = {}
        self._problems: list[PluginProblem] = []
        self._plugins: list[str] = []
        self._lock = threading.RLock()
        self.generation = 0

    # ---- filling ----------------------------------------------------------------------------------------
    def add(self, cls: type[MLABackend], *, source: str, name: str | None = None, before: str | None = None,
            after: str | None = None, archs: object = None) -> RegisteredBackend:
        """Validate and add a backend; raises :class:`RegistrationError` (never half-registers)."""
        problems = validate_backend_class(cls)
        if problems:
            raise RegistrationError("; ".join(problems))
        key = cls.name.strip().upper()
        if name is not None and name.strip().upper() != key:
            raise RegistrationError(f"name: got class named {cls.name!r} registered as {name!r}; "
                                    "supported the same name")
        placement = _placement(before, after, archs)
        with self._lock:
            if key in self._entries:
                prev = self._entries[key]
                raise RegistrationError(f"name: got {key!r}, already registered by {prev.source!r}; "
                                        "supported a unique name")
            entry = RegisteredBackend(name=key, cls=cls, source=source, placement=placement)
            self._entries[key] = entry
            self.generation += 1
        return entry

    def remove(self, name: str) -> RegisteredBackend | None:
        """Drop the entry registered under ``name`` (case-insensitive); returns it, or None when absent."""
        with self._lock:
            entry = self._entries.pop(name.strip().upper(), None)
            if entry is not None:
                self.generation += 1
            return entry

    def record(self, problem: PluginProblem) -> None:
        with self._lock:
            self._problems.append(problem)
            self.generation += 1

    def mark_loaded(self, plugin: str) -> None:
        with self._lock:
            self._plugins.append(plugin)

    # ---- reading ----------------------------------------------------------------------------------------
    @property
    def problems(self) -> tuple[PluginProblem, ...]:
        return tuple(self._problems)

    @property
    def plugins(self) -> tuple[str, ...]:
        """Plugins whose hook ran to completion, in load order (``builtin`` first)."""
        return tuple(self._plugins)

    def entries(self) -> tuple[RegisteredBackend, ...]:
        return tuple(self._entries.values())

    def entry(self, name: str) -> RegisteredBackend | None:
        return self._entries.get(name.strip().upper())

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def get(self, name: str | BackendName | type[MLABackend]) -> type[MLABackend]:
        """The backend class for a name, enum member, class or import path (see :meth:`resolve`)."""
        return self.resolve(name).cls

    def resolve(self, name: str | BackendName | type[MLABackend]) -> RegisteredBackend:
        """Resolve what a user gave as a backend to its entry, with the source it came from.

        In this order: a class (checked as :meth:`add` would; its entry when registered, else source
        ``"api"``); a ``"package.module:Class"`` import path (imported now; a class that is not registered
        gets the source ``"import path package.module:Class"``, so an uninstalled backend can be selected
        and tested before it has an entry point); a registered name (case-insensitive); an alias from
        :mod:`mla_backends.plugins.aliases` (vLLM's ``CUTLASS_MLA``, SGLang's ``trtllm_mla``...). A registered
        name always wins over an alias. Unknown names raise :class:`UnknownBackendError` with a suggestion.
        """
        if isinstance(name, type) and issubclass(name, MLABackend):
            problems = validate_backend_class(name)
            if problems:
                raise ValueError(f"backend {name.__qualname__}: " + "; ".join(problems))
            return self._entry_of(name) or RegisteredBackend(name=name.name.strip().upper(), cls=name,
                                                             source="api")
        if isinstance(name, BackendName):
            name = name.value
        if not isinstance(name, str):
            raise TypeError(f"backend: got {type(name).__name__}; supported a backend name or "
                            "MLABackend subclass")
        if ":" in name:
            return self._import_path(name.strip())
        key = name.strip().upper()
        found = self._entries.get(key)
        if found is not None:
            return found
        target = alias_target(name)
        if target is not None and target in self._entries:
            return self._entries[target]
        known = sorted(self._entries)
        close = difflib.get_close_matches(key, [*known, *alias_names()], n=1, cutoff=0.5)
        hint = f" (did you mean {alias_target(close[0]) or close[0]}?)" if close else ""
        missing = ""
        builtin = target or key
        if builtin in BackendName.__members__:
            alias = "" if target is None else f"{name.strip()!r} is an alias of {target}; "
            missing = f"; {alias}the built-in {builtin} is not registered in this installation"
        elif (note := not_provided_note(name)) is not None:
            missing, hint = f"; {note}", ""
        raise UnknownBackendError(f"backend: got {name!r}; supported {', '.join(known)}{hint}{missing}")

    def _entry_of(self, cls: type[MLABackend]) -> RegisteredBackend | None:
        return next((e for e in self._entries.values() if e.cls is cls), None)

    def _import_path(self, text: str) -> RegisteredBackend:
        """``"package.module:Class"`` -> its entry (registered) or an unregistered one labelled by the path."""
        mod_name, _, attr = text.partition(":")
        supported = "'package.module:Class' naming an MLABackend subclass"
        if not mod_name or not attr:
            raise ValueError(f"backend: got {text!r}; supported {supported}")
        try:
            with plugin_call(f"import path {text!r}", "import"):
                obj = getattr(importlib.import_module(mod_name), attr)
        except USER_CODE_FAILURES as exc:  # ImportError, AttributeError, sys.exit(), whatever the module raises
            raise ValueError(f"backend: got {text!r}, which cannot be imported ({failure_text(exc)})"
                             f"{_not_found_hint(exc, mod_name)}; supported {supported}") from exc
        if not (isinstance(obj, type) and issubclass(obj, MLABackend)):
            raise TypeError(f"backend: got {text!r} -> {obj!r}; supported an MLABackend subclass")
        problems = validate_backend_class(obj)
        if problems:
            raise ValueError(f"backend {text}: " + "; ".join(problems))
        return self._entry_of(obj) or RegisteredBackend(name=obj.name.strip().upper(), cls=obj,
                                                        source=f"import path {text}")


def _search_folders() -> list[str]:
    """The folders an import searches now (``sys.path``, ``""`` being the current folder), absolute, each once."""
    return list(dict.fromkeys(os.path.abspath(p or os.curdir) for p in sys.path if isinstance(p, str)))


def _not_found_hint(exc: BaseException, mod_name: str) -> str:
    """For the top module of an import path not being found: how to make the folder holding it searched (a
    console script such as ``mla-backends`` does not search the current folder), and the folders searched."""
    top = mod_name.split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or exc.name != top:
        return ""
    folders = _search_folders()
    here = os.getcwd()
    found = next((f for f in (f"{top}.py", top) if os.path.exists(os.path.join(here, f))), None)
    if found is not None and here not in folders:
        fix = (f"the current folder {here} holds {found} but is not searched: run PYTHONPATH=. mla-backends ... "
               "(or python -m mla_backends ..., which searches the current folder)")
    else:
        fix = f"set PYTHONPATH to the folder holding {top}.py (PYTHONPATH=. from that folder)"
    return f"; {fix}; searched the folders {', '.join(folders) or 'none (sys.path is empty)'}"
