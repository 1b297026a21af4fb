"""The module layering of ``mla_backends/`` and ``selector/``, read from the source with ``ast``.

Rules (docs/architecture.md, "Layers and the import rule"): every sub-package imports only from the layers
:data:`ALLOWED` gives it (its own and those below); the import graph has no cycle; no module imports another
module's private (underscore) name; the public API does not import triton, flashinfer, vllm or sglang. Nodes are
the files (a package's ``__init__`` is a node); edges are the imports as written, lazy ones inside functions and
those under ``if TYPE_CHECKING:`` included (a type checker follows them, and so does a reader); a module importing
its own package's ``__init__`` is no edge. Underscore *modules* (``flashinfer_mla/_common.py``) may be imported
within their own package. Module length is a review guideline (split by concern, never by count), not a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mla_backends", "selector")

# the layers, bottom to top: each part of the code -> the parts it may import (itself included). A part is a
# sub-package of mla_backends (``core``, ``step`` ...), a backend implementation, or ``selector``.
_IMPLS = {"ref_torch", "cpu_fused", "triton_mla", "flashinfer_mla"}
_BELOW_LAYER = {"core", "step", "backends", *_IMPLS, "plugins", "loading", "selector"}
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "step": {"core", "step"},
    "backends": {"core", "step", "backends"},
    **{impl: {"core", "step", "backends", impl} for impl in _IMPLS},
    "plugins": {"core", "step", "backends", *_IMPLS, "plugins"},
    "loading": {"core", "loading"},
    "selector": {"core", "step", "backends", "plugins", "selector"},
    "layer": _BELOW_LAYER | {"layer"},
    "planning": _BELOW_LAYER | {"layer", "planning"},
    "testing": _BELOW_LAYER | {"layer", "testing"},
    "integrations": _BELOW_LAYER | {"layer", "integrations"},
    "cli": _BELOW_LAYER | {"layer", "planning", "testing", "integrations", "cli"},
}
#: top-level modules of mla_backends and where they sit: the package init (lazy public names, resolved by
#: name), the 0.3 module aliases and ``python -m mla_backends``
_TOP = {"mla_backends": None, "mla_backends._legacy": {"core"}, "mla_backends.__main__": {"cli"}}


# ---- the graph -------------------------------------------------------------------------------------------
def find_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root/<package>``."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                skip.update(id(sub) for sub in ast.walk(node))
    return skip


def module_imports(name: str, path: Path, known: dict[str, Path],
                   packages: tuple[str, ...]) -> tuple[set[str], list[str]]:
    """``(modules name imports, private names it imports from other modules)``.

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b`` (and ``c`` is a name
    defined there: private when it starts with one underscore).
    """
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    pkg = name if is_pkg else name.rpartition(".")[0]
    skip: set[int] = set()  # nothing skipped: imports under TYPE_CHECKING are edges too
    edges: set[str] = set()
    private: list[str] = []

    def ours(target: str) -> bool:
        return any(target == p or target.startswith(p + ".") for p in packages)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if ours(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not ours(target):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    edges.add(sub)
                    continue
                edges.add(target)
                if alias.name.startswith("_") and not alias.name.startswith("__") and target != name:
                    private.append(f"{name} imports {target}.{alias.name}")
    own_packages = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    edges = {e for e in edges if e in known and e != name
             and not (e in own_packages and known[e].name == "__init__.py")}
    return edges, private


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, set[str]], list[str]]:
    """The module graph of ``packages`` under ``root`` and every cross-module private import."""
    known = find_modules(root, packages)
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for name, path in known.items():
        graph[name], found = module_imports(name, path, known, packages)
        private += found
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


# ---- the rules on this tree ------------------------------------------------------------------------------
def test_no_import_cycles():
    graph, _ = import_graph(ROOT)
    assert len(graph) > 40  # the walk found the packages
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_cross_module_private_imports():
    _, private = import_graph(ROOT)
    assert not private, "private imports: " + "; ".join(private)


def part_of(module: str) -> str | None:
    """The layer part a module belongs to (:data:`ALLOWED`), None for the package init."""
    if module in _TOP:
        return None
    bits = module.split(".")
    return "selector" if bits[0] == "selector" else bits[1]


def test_every_module_belongs_to_a_layer():
    loose = sorted(m for m in find_modules(ROOT, PACKAGES)
                   if m not in _TOP and part_of(m) not in ALLOWED)
    assert not loose, f"modules outside the layers of ALLOWED (docs/architecture.md): {loose}"


def test_each_layer_imports_only_itself_and_the_layers_below():
    graph, _ = import_graph(ROOT)
    bad = []
    for module, edges in graph.items():
        allowed = _TOP[module] if module in _TOP else ALLOWED.get(part_of(module), set())
        if allowed is None:
            continue
        for target in edges:
            part = part_of(target)
            if part is not None and part not in allowed:
                bad.append(f"{module} imports {target} ({part} is above {part_of(module) or module})")
    assert not bad, "imports against the layering: " + "; ".join(sorted(bad))


def test_mla_backends_reaches_the_selector_only_from_the_layer_and_the_cli():
    """The selector sits on the foundation; below the layer nothing in ``mla_backends`` imports it (the engine
    adapters of ``mla_backends.integrations`` sit above the layer, beside the CLI)."""
    graph, _ = import_graph(ROOT)
    reach = sorted(m for m, edges in graph.items() if m.startswith("mla_backends")
                   and any(e == "selector" or e.startswith("selector.") for e in edges))
    allowed = [m for m in reach if part_of(m) in ("layer", "planning", "testing", "integrations", "cli")]
    assert reach == allowed, f"modules below the layer importing the selector: {sorted(set(reach) - set(allowed))}"


# ---- the checker itself ----------------------------------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_graph_builder_finds_a_lazy_two_module_cycle(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from .b import B\nA = 1\n",
        "pkg/b.py": "B = 2\n\ndef f():\n    from .a import A  # lazy: still an edge\n    return A\n",
    })
    graph, private = import_graph(root, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]] and private == []


@pytest.mark.parametrize("guard", ["TYPE_CHECKING", "typing.TYPE_CHECKING"])
def test_type_checking_imports_are_edges_and_own_package_is_not(tmp_path, guard):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": f"import typing\nfrom typing import TYPE_CHECKING\nif {guard}:\n    from .b import B\nA = 1\n",
        "pkg/b.py": "from . import a\nfrom pkg import A\nB = 2\n",
    })
    graph, _ = import_graph(root, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]  # what a type checker sees


def test_private_name_across_modules_is_reported_but_underscore_modules_are_not(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/_common.py": "def helper():\n    return 1\n",
        "pkg/a.py": "def _secret():\n    return 1\n",
        "pkg/b.py": "from . import _common\nfrom ._common import helper\nfrom .a import _secret\n",
    })
    graph, private = import_graph(root, ("pkg",))
    assert graph["pkg.b"] == {"pkg._common", "pkg.a"}
    assert private == ["pkg.b imports pkg.a._secret"]
