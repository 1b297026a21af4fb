"""Load a script of ``benchmarks/`` as a module, for the tests of its functions (they are not a package)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark_path(name: str) -> str:
    """``benchmarks/<name>.py`` in this checkout."""
    return os.path.join(ROOT, "benchmarks", f"{name}.py")


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, benchmark_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
