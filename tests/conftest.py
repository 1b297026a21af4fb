"""Project-wide test set-up.

Without CUDA, Triton kernels can only run under the interpreter, and ``TRITON_INTERPRET`` must be set before
any ``@triton.jit`` module is imported, so it is set here, first. Tests that check the selector's behaviour
without the interpreter remove it with ``monkeypatch.delenv``.
"""

from __future__ import annotations

import os
import sys

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
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache"))


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
