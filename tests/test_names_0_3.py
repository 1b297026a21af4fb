"""Issue 48 class 5: the promise CHANGELOG 0.4.0 made, that 0.3's module paths keep working for one release, holds
for every name 0.3 gave users (``tests/names_0_3.txt``, taken from 0.3's ``__all__`` lists, README, docs and
example plugin): each resolves through its 0.3 path, a path or name that moved warns (``DeprecationWarning``)
naming its new home, and a name that no longer resolves is one CHANGELOG.md lists as removed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest

from mla_backends import _legacy

ROOT = Path(__file__).resolve().parents[1]
NAMES_FILE = Path(__file__).with_name("names_0_3.txt")
#: packages a module may need that are not part of the main test environment (the engines' own suites cover them)
ENGINE_PACKAGES = ("vllm", "sglang")


def read_names() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(kept, removed)``: module -> its 0.3 names, from ``tests/names_0_3.txt``."""
    kept: dict[str, list[str]] = {}
    removed: dict[str, list[str]] = {}
    for line in NAMES_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        head, names = line.split(":", 1)
        into = removed if head.startswith("removed ") else kept
        into.setdefault(head.removeprefix("removed ").strip(), []).extend(names.split())
    return kept, removed


KEPT, REMOVED = read_names()


def _old(module: str) -> str | None:
    """The ``_legacy.MOVED`` key of a 0.3 module path that moved, else None."""
    rest = module.removeprefix("mla_backends.")
    return rest if module != rest and rest in _legacy.MOVED else None


def _fresh_import(module: str) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``module`` as a first import would (the 0.3 alias dropped from ``sys.modules`` first, so that its
    finder runs and warns again), recording the warnings."""
    if _old(module) is not None:
        sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(module)
    return mod, caught


def _defined_in_source(module: str, name: str) -> bool:
    """Whether ``module``'s own source defines ``name`` at top level (for a module importing an engine package
    this environment lacks)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module}: not found"
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def test_the_list_holds_what_0_3_gave():
    assert sum(map(len, KEPT.values())) > 600 and len(KEPT) > 100
    assert "add_plugin" in KEPT["mla_backends.plugins"] and "default_workspace_rows" in KEPT["mla_backends.prefill"]


@pytest.mark.parametrize("module", sorted(KEPT))
def test_every_0_3_name_resolves_through_its_0_3_path_and_warns_where_it_moved(module):
    names = KEPT[module]
    try:
        mod, caught = _fresh_import(module)
    except ModuleNotFoundError as exc:
        if exc.name not in ENGINE_PACKAGES:
            raise
        missing = [n for n in names if not _defined_in_source(module, n)]
        assert not missing, f"{module}: 0.3 names no longer defined: {missing}"
        return
    old = _old(module)
    if old is not None:
        new = f"mla_backends.{_legacy.MOVED[old]}"
        assert any(w.category is DeprecationWarning and new in str(w.message) for w in caught), \
            f"{module}: imported without a DeprecationWarning naming {new}"
    public = set(getattr(mod, "__all__", ()))
    problems = []
    for name in names:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            try:
                value = getattr(mod, name)
            except AttributeError:
                problems.append(f"{name}: does not resolve")
                continue
        if value is None and name != "__version__":
            problems.append(f"{name}: is None")
        if old is None and name not in public and not any(w.category is DeprecationWarning for w in got):
            problems.append(f"{name}: no longer in {module}.__all__, yet resolves without a DeprecationWarning")
    assert not problems, f"{module}: {problems}"


def test_names_0_3_does_not_list_as_removed_what_still_resolves_and_changelog_lists_each_removal():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    problems = []
    for module, names in REMOVED.items():
        whole = f"`{module}`" in changelog
        for name in names:
            tail = f"{module.rsplit('.', 1)[-1]}.{name}"
            if not whole and not re.search(rf"`[\w.]*{re.escape(tail)}`", changelog):
                problems.append(f"{module}.{name}: not listed as removed in CHANGELOG.md")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            problems.append(f"{module}.{name}: still resolves (move it back to the kept names)")
    assert not problems, problems


def test_the_moved_plugin_names_warn_naming_their_home():
    import mla_backends.plugins as package
    from mla_backends.plugins import loading

    for name in ("add_plugin", "ENTRY_POINT_GROUP", "DISABLE_AUTOLOAD_ENV", "autoload_enabled", "run_plugin",
                 "reset_registry"):
        with pytest.warns(DeprecationWarning, match=rf"mla_backends\.plugins\.loading\.{name}\b.*0\.6"):
            assert getattr(package, name) is getattr(loading, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the package's own names stay quiet
        assert package.get_backend is loading.get_backend
