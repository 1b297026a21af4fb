"""Project-wide test set-up.

Without CUDA, Triton kernels can only run under the interpreter, and ``TRITON_INTERPRET`` must be set before
any ``@triton.jit`` module is imported, so it is set here, first. Tests that check the selector's behaviour
without the interpreter remove it with ``monkeypatch.delenv``.

The test loop (``make test-fast``, ``make test``; README, "Running the tests"):

* ``slow``: every test named in ``tests/slow_tests.txt`` (a file, a class or a test, all its parameters
  included) gets the ``slow`` mark here, at collection; ``make test-fast`` runs ``-m "not slow"``.
* under pytest-xdist, ``make test`` runs ``-n 2 --dist loadgroup --no-loadscope-reorder``: every test is a unit
  of its own, except the tests of a file in :data:`SHARED_MODULE_FIXTURES`, which go to one worker together so
  that its costly module fixture is built once (:func:`pytest_xdist_make_scheduler`: pytest-xdist's own
  ``xdist_group`` marks do not group under pytest 9.2, whose node ids no longer take xdist's suffix). The
  listed slow tests are collected first, in the list's order (longest first), so that the workers start the
  long ones early and none starts last while the other worker idles. A serial run keeps the file order.
* each xdist worker runs torch on its share of the cores (two workers on two cores: one thread each) rather
  than every worker starting a thread per core.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# the deliberately broken test plugin lives outside .venv (see the Makefile) so that normal commands
# do not load it; put it on the path of this process and of the subprocesses the tests start
_TEST_SITE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".test-site"))
if os.path.isdir(_TEST_SITE) and _TEST_SITE not in sys.path:
    sys.path.insert(0, _TEST_SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TEST_SITE, os.environ.get("PYTHONPATH")) if p)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/sglang_engine runs only in .venv-sglang (`make test` runs it there). Elsewhere it is not collected: its
# conftest would be imported before the test files sorted after it and would stand as `conftest` in sys.modules,
# where tests/test_test_loop.py imports this file's helpers from.
import importlib.util as _importlib_util  # noqa: E402

_SGLANG_SPEC = _importlib_util.find_spec("sglang")
collect_ignore = [] if _SGLANG_SPEC is not None and _SGLANG_SPEC.origin is not None else ["sglang_engine"]
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache"))

TESTS = Path(__file__).resolve().parent
SLOW_LIST = TESTS / "slow_tests.txt"

#: files whose tests share a module-scoped fixture that takes seconds to build (a generated suite run, an
#: unsharded model run, a checkpoint): under ``--dist loadgroup`` each goes to one worker as one unit
SHARED_MODULE_FIXTURES = frozenset({
    "test_conformance_catches.py",  # suite_results: the broken-backend suite, run once (30-60 s)
    "test_conformance_faults.py",  # table: the fault table, computed once (20-30 s of CPU)
    "test_dcp_gloo.py",  # model: the unsharded reference run the three world sizes compare with
    "test_pretrained.py",  # v3_folder: a sharded DeepSeek-V3-shaped checkpoint
    "test_hardening_cli2.py",  # tiny_table: a quick tuning run
})

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1:  # set before any test runs; the one_thread fixture below still pins a test to one thread
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def read_slow_list(path: Path = SLOW_LIST) -> list[str]:
    """The entries of ``tests/slow_tests.txt``: ``file.py``, ``file.py::Class`` or ``file.py::test`` (paths
    relative to ``tests/``), one a line; ``#`` starts a comment."""
    entries = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def _key(item: pytest.Item) -> str:
    """``file.py::Class::test[param]`` of ``item``, its file relative to ``tests/``."""
    rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    parts = item.nodeid.split("::", 1)
    return rel if len(parts) == 1 else f"{rel}::{parts[1]}"


def is_listed(key: str, entries: list[str]) -> bool:
    """Whether a test (its :func:`_key`) is one of ``entries`` or inside one (a file, a class, the parameters
    of a test)."""
    return any(key == e or key.startswith(e + "::") or key.startswith(e + "[") for e in entries)


def slow_rank(key: str, slow: list[str]) -> int:
    """The position in ``slow`` of the first entry that holds the test ``key``; ``len(slow)`` when none."""
    return next((i for i, e in enumerate(slow) if is_listed(key, [e])), len(slow))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = read_slow_list()
    rank: dict[str, int] = {}
    for item in items:
        try:
            key = _key(item)
        except ValueError:  # a test outside tests/ (a generated suite a test runs): not ours to mark
            continue
        rank[item.nodeid] = slow_rank(key, slow)
        if rank[item.nodeid] < len(slow):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and all must agree: a stable sort
        items.sort(key=lambda item: rank.get(item.nodeid, len(slow)))


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test under ``--dist loadgroup``: its file when the file is one of
    :data:`SHARED_MODULE_FIXTURES`, else the test itself (an ``@group`` suffix, were xdist's to work, wins)."""
    if "@" in nodeid:
        return nodeid.rsplit("@", 1)[1]
    file = nodeid.split("::", 1)[0]
    return file if Path(file).name in SHARED_MODULE_FIXTURES else nodeid


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """``--dist loadgroup`` with the units of :func:`work_unit`; other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTestScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileOrTestScheduling(config, log)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread, restoring the previous count afterwards.

    Tiny float64 ops and matmuls are dominated by thread hand-offs on a loaded 2-core machine. Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fakes(monkeypatch):
    """The selector fakes' registry (``tests/selector_fakes.py``) made the process-wide one for a test."""
    from selector_fakes import fake_registry, install

    return install(monkeypatch, fake_registry())


@pytest.fixture
def cpu_fused_not_built(monkeypatch, tmp_path):
    """This machine as one where ``mla-backends build`` never ran: CPU_FUSED's build cache is an empty folder, so
    the CPU ladder's dense decode falls to REF_TORCH (the selector's cache cleared before and after). For
    tests whose subject is not the CPU kernel but which name the CPU choice; tests/test_cpu_fused.py covers
    both states."""
    from mla_backends.cpu_fused.build import CACHE_DIR_ENV
    from selector.select import clear_cache

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mla-backends-cache"))
    clear_cache()
    yield
    clear_cache()
