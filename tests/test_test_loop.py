"""The test loop's own set-up (tests/conftest.py, tests/slow_tests.txt, the Makefile): what ``make test-fast``
leaves out is named by a list that names real tests, the marks land where the list says, and a pytest run that
collects nothing fails ``make test``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import SHARED_MODULE_FIXTURES, SLOW_LIST, TESTS, _key, is_listed, read_slow_list, slow_rank, work_unit

ROOT = TESTS.parent


def _names(path: Path) -> dict[str, set[str]]:
    """Top-level functions and classes of a test file, each class with the functions defined in its body."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return out


def test_every_slow_entry_names_a_test_file_class_or_function():
    entries = read_slow_list()
    assert entries, f"{SLOW_LIST} lists nothing"
    stale = []
    for entry in entries:
        file, *rest = entry.split("::")
        path = TESTS / file
        if not path.is_file() or not file.endswith(".py"):
            stale.append(entry)
            continue
        names = _names(path)
        if rest and rest[0] not in names:
            stale.append(entry)
        elif len(rest) == 2 and names[rest[0]] and rest[1] not in names[rest[0]]:
            stale.append(entry)  # a method the class defines itself (inherited ones are not checked)
        elif len(rest) > 2:
            stale.append(entry)
    assert not stale, f"entries of {SLOW_LIST.name} that name no test: {stale}"
    assert len(entries) == len(set(entries)), "an entry is listed twice"


@pytest.mark.parametrize(
    ("key", "listed"),
    [
        ("test_a.py", True),  # the whole file
        ("test_a.py::test_x", True),
        ("test_b.py::test_y", True),  # the test itself
        ("test_b.py::test_y[1-bf16]", True),  # and each of its parameters
        ("test_b.py::test_yz", False),  # a longer name is another test
        ("test_b.py::test_x", False),
        ("test_c.py::TestK::test_z[p]", True),  # a class: every test in it
        ("test_c.py::TestKOther::test_z", False),
        ("test_ab.py::test_x", False),
    ],
)
def test_listed_means_the_entry_or_inside_it(key, listed):
    assert is_listed(key, ["test_a.py", "test_b.py::test_y", "test_c.py::TestK"]) is listed


def test_this_tests_key_is_its_file_and_name(request):
    assert _key(request.node) == "test_test_loop.py::test_this_tests_key_is_its_file_and_name"
    assert request.node.get_closest_marker("slow") is None  # not listed, so not marked


def test_slow_rank_is_the_first_entry_holding_the_test():
    slow = ["test_a.py::test_x", "test_b.py", "test_a.py"]
    assert slow_rank("test_a.py::test_x[2]", slow) == 0
    assert slow_rank("test_a.py::test_y", slow) == 2
    assert slow_rank("test_b.py::TestK::test_z", slow) == 1
    assert slow_rank("test_c.py::test_x", slow) == 3  # not listed: after every listed test


def test_work_units_are_tests_except_files_sharing_a_module_fixture():
    assert all((TESTS / name).is_file() for name in SHARED_MODULE_FIXTURES), sorted(SHARED_MODULE_FIXTURES)
    assert work_unit("tests/test_dcp_gloo.py::test_dcp_equals_unsharded[2-2]") == "tests/test_dcp_gloo.py"
    assert work_unit("tests/test_dcp_gloo.py::test_bad_dcp_arguments_without_processes") == "tests/test_dcp_gloo.py"
    # the three compile reports are units of their own, so two workers run them side by side
    assert len({work_unit(f"tests/test_triton_compile.py::{t}") for t in (
        "test_sm90a_report", "test_portable_archs_report[sm80]", "test_portable_archs_report[sm89]")}) == 3
    assert work_unit("tests/test_a.py::TestK::test_z[p]@grp") == "grp"


@pytest.mark.parametrize("case", [1, 2])
def test_marked_slow_by_the_list(request, case):
    """Listed in slow_tests.txt on purpose (it is quick): the mark must come from the list at collection, so
    this fails in ``make test-fast`` and ``make test`` alike if the list stops being applied."""
    assert request.node.get_closest_marker("slow") is not None, request.node.nodeid
    assert [m.name for m in request.node.iter_markers("slow")] == ["slow"]


def test_the_makefile_fails_on_a_run_that_collects_nothing():
    """``make test`` runs its three pytest runs (main suite, tests/vllm_engine, tests/sglang_engine, building
    the three environments side by side when missing: ``make envs``) and fails unless all exit 0: pytest's
    exit 5 (no test collected) fails it like any failure, and the fast target is a plain pytest call (make
    fails on any non-zero)."""
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"test \$\$main -eq 0 -a \$\$vllm -eq 0 -a \$\$sglang -eq 0", recipe), recipe
    assert "tests/sglang_engine" in recipe and "envs" in recipe.split("\n", 1)[0]
    envs = text.split("\nenvs:", 1)[1].split("\n\n", 1)[0]  # the three environments, built side by side
    assert all(t in envs for t in ("-j3", "$(STAMP)", "$(VLLM_EDITABLE)", "$(SGLANG_EDITABLE)")), envs
    assert "|| true" not in recipe and "-m \"not slow\"" in text.split("\ntest-fast:", 1)[1].split("\n\n", 1)[0]
