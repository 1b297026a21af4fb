"""Device input: simulated names, NVML probing through fake pynvml modules, and selecting for a probed GPU."""

from __future__ import annotations

import logging
import sys
import types

import pynvml
import pytest
from selector_fakes import fake_registry, install

from mla_backends.core.device import CPU_DEVICE, DeviceInfo, parse_device_spec, simulated_device
from mla_backends.core.dims import MLADims
from selector.detect import clear_device_cache, detect_device, resolve_device
from selector.select import select_backend


@pytest.mark.parametrize("spec,cc", [
    ("sm90", (9, 0)), ("SM100", (10, 0)), ("sm_120", (12, 0)), ("sm90a", (9, 0)), ("sm100f", (10, 0)),
    ("sm80", (8, 0)), ("sm86", (8, 6)), ("sm89", (8, 9)), ("sm103", (10, 3)), ("sm110", (11, 0)),
    ("sm121", (12, 1)), ((9, 0), (9, 0)), ((10, 3), (10, 3)),
])
def test_simulated_devices(spec, cc):
    dev = resolve_device(spec)
    assert dev.is_cuda and dev.simulated and dev.compute_capability == cc
    assert dev.arch_label == f"sm{cc[0]}{cc[1]}" and "(simulated)" in dev.describe()


def test_cpu_and_deviceinfo_pass_through():
    assert resolve_device("cpu") is CPU_DEVICE and resolve_device("CPU") is CPU_DEVICE
    mine = DeviceInfo(kind="cuda", name="my GPU", compute_capability=(9, 0))
    assert resolve_device(mine) is mine
    assert parse_device_spec("cuda:1") == 1 and parse_device_spec("cuda") == 0 and parse_device_spec(2) == 2
    assert parse_device_spec("auto") is None and parse_device_spec(None) is None


@pytest.mark.parametrize("bad,exc,text", [
    ("tpu", ValueError, "device: got 'tpu'"),
    ((9,), ValueError, r"device: got tuple \(9,\)"),
    ((9, "0"), TypeError, "minor: got str"),
    ((42, 0), ValueError, r"device: got compute capability \(42, 0\)"),
    (-1, ValueError, "device: got index -1"),
    (True, TypeError, "device: got bool"),
    (1.5, TypeError, "device: got float"),
])
def test_bad_devices_are_named(bad, exc, text):
    with pytest.raises(exc, match=text):
        resolve_device(bad)


# ---- fake pynvml modules ----------------------------------------------------------------------------------
class _Mem:
    def __init__(self, total):
        self.total = total


def fake_nvml(gpus=(), init_error=None, query_error=None):
    """A stand-in ``pynvml`` module: ``gpus`` is a list of (name, (major, minor), total bytes)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = pynvml.NVMLError
    calls = {"init": 0, "shutdown": 0}

    def init():
        calls["init"] += 1
        if init_error is not None:
            raise init_error

    def handle(i):
        if query_error is not None:
            raise query_error
        if i >= len(gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return i

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    mod.nvmlDeviceGetCount = lambda: len(gpus)
    mod.nvmlDeviceGetHandleByIndex = handle
    mod.nvmlDeviceGetName = lambda h: gpus[h][0].encode()  # older bindings return bytes
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h][1]
    mod.nvmlDeviceGetMemoryInfo = lambda h: _Mem(gpus[h][2])
    mod.calls = calls
    return mod


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml; the device cache is cleared before and after."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clear_device_cache()

    def use(mod):
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        clear_device_cache()
        return mod

    yield use
    clear_device_cache()


def test_pynvml_missing_means_cpu(nvml, caplog):
    nvml(None)  # sys.modules[name] = None makes the import raise ImportError
    with caplog.at_level(logging.DEBUG, logger="selector.detect"):
        assert detect_device() is CPU_DEVICE
    assert "pynvml not importable" in caplog.text


def test_nvml_library_not_found_means_cpu(nvml, caplog):
    mod = nvml(fake_nvml(init_error=pynvml.NVMLError_LibraryNotFound()))
    with caplog.at_level(logging.DEBUG, logger="selector.detect"):
        assert resolve_device(None) is CPU_DEVICE
        assert resolve_device("auto") is CPU_DEVICE
    assert "NVMLError_LibraryNotFound" in caplog.text
    assert mod.calls["init"] == 1  # probed once, then cached


@pytest.mark.parametrize("mod", [
    fake_nvml(gpus=[]),
    fake_nvml(gpus=[("H100", (9, 0), 80 << 30)], query_error=pynvml.NVMLError_GpuIsLost()),
    fake_nvml(init_error=pynvml.NVMLError_DriverNotLoaded()),
], ids=["no-gpu", "query-fails", "driver-not-loaded"])
def test_other_nvml_failures_mean_cpu(nvml, mod):
    nvml(mod)
    assert detect_device(0) is CPU_DEVICE


TWO_GPUS = [("NVIDIA H100 80GB HBM3", (9, 0), 80 << 30), ("NVIDIA GeForce RTX 5090", (12, 0), 32 << 30)]


def test_two_gpus_of_different_architectures(nvml, monkeypatch):
    mod = nvml(fake_nvml(TWO_GPUS))
    d0, d1 = detect_device(0), resolve_device("cuda:1")
    assert (d0.name, d0.compute_capability, d0.index, d0.total_memory) == ("NVIDIA H100 80GB HBM3", (9, 0), 0,
                                                                           80 << 30)
    assert (d1.name, d1.compute_capability, d1.index) == ("NVIDIA GeForce RTX 5090", (12, 0), 1)
    assert not d0.simulated and mod.calls["shutdown"] == mod.calls["init"] == 2
    assert detect_device(5) is CPU_DEVICE  # not there: never a crash
    # CUDA_VISIBLE_DEVICES renumbers: logical 0 is physical 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert detect_device(0).compute_capability == (12, 0)


def test_selection_follows_the_probed_gpu(nvml, monkeypatch):
    nvml(fake_nvml(TWO_GPUS))
    install(monkeypatch, fake_registry())
    dims = MLADims.deepseek_v3().tensor_parallel(8)
    assert select_backend(dims).name == "FLASHINFER_MLA"
    assert select_backend(dims, device="cuda:1").name == "FLASHINFER_MLA_XQA"
    assert select_backend(dims, device=1).device.name == "NVIDIA GeForce RTX 5090"


def test_simulated_device_validation():
    with pytest.raises(TypeError, match="major: got bool"):
        simulated_device(True, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device and its driver")
def test_real_gpu_is_read_through_nvml():
    import torch

    clear_device_cache()
    dev = detect_device(0)
    assert dev.is_cuda and not dev.simulated
    assert dev.compute_capability == torch.cuda.get_device_capability(0)
    assert dev.total_memory > 0 and dev.name
    sel = select_backend(MLADims.deepseek_v3().tensor_parallel(8))
    assert sel.device == dev and sel.verdicts[0].name == sel.verdicts[0].name.upper()
