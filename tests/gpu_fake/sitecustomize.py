"""A faked CUDA device for whole-script runs of ``benchmarks/gpu_checks.sh`` on a CPU machine.

Put this folder on ``PYTHONPATH`` (and ``tests/gpu_fake/bin`` on ``PATH`` for ``nvidia-smi``) and set
``MLA_FAKE_CUDA=1``: every Python process the script starts then sees one H200 through ``torch.cuda``
(``is_available``, the device's properties, events, ``synchronize``), and tensors asked for on ``"cuda"`` are
made on the CPU (a torch function mode rewrites the ``device`` argument), so the benchmarks' steps run their
points on the CPU. As on the device image, FlashInfer cannot be imported. torch is patched when a process
imports it (an import hook), so processes that never import it start at full speed. Nothing is faked
without ``MLA_FAKE_CUDA=1`` (this file is then a no-op). Used by ``tests/test_gpu_checks_run.py`` only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


def _fake_cuda(torch) -> None:
    """Patch ``torch.cuda`` into one H200 and make CUDA tensors on the CPU."""
    import time
    from types import SimpleNamespace

    from torch.overrides import TorchFunctionMode

    _PROPS = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             total_memory=141 * 10**9)

    class _Event:
        """``torch.cuda.Event`` on the host clock."""

        def __init__(self, enable_timing: bool = False, **_kw) -> None:
            self.t = 0.0

        def record(self, *_a, **_kw) -> None:
            self.t = time.perf_counter()

        def elapsed_time(self, end: _Event) -> float:
            return max((end.t - self.t) * 1e3, 1e-3)

        def synchronize(self) -> None:
            pass

    def _cpu(dev):
        if isinstance(dev, str) and dev.startswith("cuda"):
            return "cpu"
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return torch.device("cpu")
        return dev

    class _CudaOnCpu(TorchFunctionMode):
        """Tensors asked for on CUDA are made (or moved) on the CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            if getattr(func, "__name__", "") in ("to", "cuda") and func is not torch.Tensor.cpu:
                if func.__name__ == "cuda":
                    return args[0]
                args = tuple(_cpu(a) for a in args)
            return func(*args, **kwargs)

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda *_a: _PROPS
    cuda.get_device_capability = lambda *_a: (9, 0)
    cuda.get_device_name = lambda *_a: _PROPS.name
    cuda.synchronize = lambda *_a: None
    cuda.empty_cache = lambda: None
    cuda.Event = _Event
    _CudaOnCpu().__enter__()  # for the whole process


class _Hook(importlib.abc.MetaPathFinder):
    """FlashInfer is absent; torch is faked right after it is first imported."""

    torch_done = False

    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/gpu_fake, as on the device)")
        if name != "torch" or self.torch_done:
            return None
        self.torch_done = True
        spec = importlib.util.find_spec("torch")  # the real one (this hook now passes)
        real_exec = spec.loader.exec_module

        def exec_module(module) -> None:
            real_exec(module)
            _fake_cuda(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MLA_FAKE_CUDA") == "1":
    sys.meta_path.insert(0, _Hook())
