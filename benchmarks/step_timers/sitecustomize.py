"""Benchmark instrumentation (benchmarks only; never shipped): wall-clock timers around named functions, in every
Python process started with this folder on ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up), so an
engine's worker or scheduler subprocess is timed too.

``MLA_STEP_TIMERS`` lists the targets, ``name=package.module:Qual.name`` separated by commas; each is wrapped
when its module is first imported. Every call adds its seconds and a count under ``name``; the process writes
its totals to ``$MLA_STEP_TIMERS_OUT/<pid>.json`` after each call of the first target (the step), so a reader
can diff two snapshots around a run. Nested targets are timed inclusively (a kernel inside an attention call
counts in both).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_SPEC = os.environ.get("MLA_STEP_TIMERS", "")
_OUT = os.environ.get("MLA_STEP_TIMERS_OUT", "")
_TOTALS: dict[str, list[float]] = {}
_TARGETS: dict[str, list[tuple[str, str]]] = {}  # module -> [(name, qualname)]
_STEP = ""


def _dump() -> None:
    path = os.path.join(_OUT, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: {"calls": int(v[0]), "s": v[1]} for k, v in _TOTALS.items()}, f)
    os.replace(path + ".tmp", path)


def _timed(name: str, fn):  # type: ignore[no-untyped-def]
    tot = _TOTALS.setdefault(name, [0, 0.0])

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            tot[0] += 1
            tot[1] += time.perf_counter() - t
            if name == _STEP:
                _dump()

    return wrapper


def _patch(module) -> None:  # type: ignore[no-untyped-def]
    for name, qual in _TARGETS.get(module.__name__, ()):
        owner_path, _, attr = qual.rpartition(".")
        owner = module
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(raw, staticmethod | classmethod):
            setattr(owner, attr, type(raw)(_timed(name, raw.__func__)))
        else:
            setattr(owner, attr, _timed(name, raw))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _SPEC and _OUT:
    for item in filter(None, (s.strip() for s in _SPEC.split(","))):
        label, _, target = item.partition("=")
        mod, _, qual = target.partition(":")
        _TARGETS.setdefault(mod, []).append((label, qual))
        _STEP = _STEP or label
    for mod in list(_TARGETS):
        if mod in sys.modules:
            _patch(sys.modules[mod])
    sys.meta_path.insert(0, _Finder())
