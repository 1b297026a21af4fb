"""The public API holds what the docs promise: every name the README and docs/ tell a user to import resolves,
``mla_backends.__all__`` is what it says, the example plugin needs nothing else, and the 0.3 module paths still
import (warning, naming the new home)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mla_backends
from mla_backends import _legacy

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^\s*from\s+((?:mla_backends|selector)(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n#`]+)", re.M)
IMPORT = re.compile(r"^\s*import\s+((?:mla_backends|selector)(?:\.[\w.]+)?)", re.M)
DOTTED_CALL = re.compile(r"`((?:mla_backends)\.[A-Za-z_]\w*)(?:\([^`]*\))?`")


def _code_blocks(path: Path) -> str:
    """The fenced code blocks of a page, and every inline code span that is an import statement."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            lines.append(line)
        else:
            lines += [span for span in re.findall(r"`([^`]+)`", line) if span.startswith(("from ", "import "))]
    return "\n".join(lines)


def doc_imports() -> list[tuple[str, str, str | None]]:
    """``(file, module, name or None)`` for every import statement in the docs' code blocks."""
    found = []
    for path in DOC_FILES:
        code = _code_blocks(path)
        for mod, names in FROM_IMPORT.findall(code):
            for item in names.strip("() \n").split(","):
                name = item.split(" as ")[0].strip()
                if name.isidentifier():
                    found.append((path.name, mod, name))
        for mod in IMPORT.findall(code):
            found.append((path.name, mod, None))
    return found


def test_the_docs_import_something():
    assert len(doc_imports()) > 20  # the scan found the examples


@pytest.mark.parametrize("where,module,name", doc_imports(), ids=lambda v: str(v))
def test_every_name_the_docs_import_resolves_without_a_deprecated_path(where, module, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        mod = importlib.import_module(module)
        if name is not None:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None, \
                f"{where}: from {module} import {name} fails"


def test_names_the_docs_call_on_the_package_exist():
    """Prose such as ``mla_backends.register_backend(cls)`` names a real attribute of the package."""
    named = {m for path in DOC_FILES for m in DOTTED_CALL.findall(path.read_text())}
    missing = []
    for dotted in sorted(named):
        attr = dotted.split(".", 1)[1]
        if not hasattr(mla_backends, attr) and importlib.util.find_spec(dotted) is None:
            missing.append(dotted)
    assert not missing, f"the docs name {missing}, which do not exist"


def test_all_is_the_kernel_author_and_engine_builder_surface():
    for name in ("MLABackend", "Capabilities", "Reason", "ReasonKind", "hookimpl", "register_backend",
                 "BatchMetadata", "LatentKVCache", "plan_step", "StepPlan", "DecodeGraphMetadata",
                 "PrefillWorkspace", "shared_workspace", "MLAAttention", "select_backend", "forward_mha"):
        assert name in mla_backends.__all__, name
    for name in mla_backends.__all__:
        assert getattr(mla_backends, name) is not None
    assert callable(mla_backends.register_backend) and mla_backends.hookimpl is not None


def test_the_example_plugin_imports_only_the_public_package():
    src = (ROOT / "examples/mla_backends_example_plugin/src/mla_backends_example_plugin/__init__.py").read_text()
    modules = set(re.findall(r"^\s*from\s+(mla_backends[\w.]*)\s+import", src, re.M))
    modules |= set(re.findall(r"^\s*import\s+(mla_backends[\w.]*)", src, re.M))
    assert modules == {"mla_backends"}, modules


def test_old_module_paths_import_with_a_warning_naming_the_new_home():
    """One fresh interpreter imports every 0.3 path: each is its new module, and each warns naming it."""
    code = (
        "import sys, warnings\n"
        "import mla_backends\n"
        "from mla_backends._legacy import MOVED\n"
        "bad = []\n"
        "for old, new in sorted(MOVED.items()):\n"
        "    with warnings.catch_warnings(record=True) as w:\n"
        "        warnings.simplefilter('always')\n"
        "        __import__('mla_backends.' + old)\n"
        "    if sys.modules['mla_backends.' + old] is not sys.modules['mla_backends.' + new]:\n"
        "        bad.append(old + ': another module')\n"
        "    if not any('mla_backends.' + new in str(x.message) and x.category is DeprecationWarning for x in w):\n"
        "        bad.append(old + ': no warning naming ' + new)\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(_legacy.MOVED) > 40


def test_the_old_layer_and_plugins_names_come_from_their_packages():
    from mla_backends.layer import MLAAttention
    from mla_backends.plugins import get_backend

    assert MLAAttention is mla_backends.MLAAttention and get_backend is mla_backends.get_backend
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        importlib.import_module("mla_backends.layer").nothing  # noqa: B018
