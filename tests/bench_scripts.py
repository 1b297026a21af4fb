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


def fake_h200(monkeypatch, bench: ModuleType) -> None:
    """Make ``bench_decode_gpu``'s timed path run on the CPU: CUDA reported available, an H200 detected,
    ``build_inputs`` giving small CPU inputs (batch 2, context 40, page 16) of the point's heads and query
    length. The caller replaces ``bench.time_backend`` with its fake timer."""
    import torch

    from mla_backends.core.device import DeviceInfo

    real_build = bench.build_inputs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "detect", lambda _torch: DeviceInfo(
        kind="cuda", name="NVIDIA H200", compute_capability=(9, 0), total_memory=141 * 10**9, sm_count=132))
    monkeypatch.setattr(bench, "build_inputs", lambda _t, pt, page, _dev: real_build(
        torch, dict(pt, batch=2, context=40), 16, "cpu"))
