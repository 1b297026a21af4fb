"""The Triton test cases pick CUDA when it can run compiled kernels (simulated here), else the CPU."""

from __future__ import annotations

import devices
import pytest
import test_triton_backend
import test_triton_mla
import torch


class _Built(Exception):
    """Raised by the stand-in cache to stop a case once its device is known."""


def _record_device(calls):
    def fake_cache(*args, device=None, **kwargs):
        calls.append(device)
        raise _Built

    return fake_cache


def _pretend_cuda(monkeypatch, *, interpret):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)


@pytest.mark.parametrize("interpret,expected", [(None, "cuda"), ("0", "cuda"), ("1", "cpu")])
def test_case_device_with_cuda_available(monkeypatch, interpret, expected):
    _pretend_cuda(monkeypatch, interpret=interpret)
    assert devices.case_device() == expected


def test_case_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert devices.case_device() == "cpu"


@pytest.mark.parametrize("build", [
    lambda: test_triton_mla.make_case([1, 1], [3, 9]),
    lambda: test_triton_backend._tiny(),
])
def test_the_cases_build_their_cache_on_cuda_when_cuda_runs_kernels(monkeypatch, build):
    calls: list = []
    _pretend_cuda(monkeypatch, interpret=None)
    for module in (test_triton_mla, test_triton_backend):
        monkeypatch.setattr(module, "LatentKVCache", _record_device(calls))
    with pytest.raises(_Built):
        build()
    assert calls == ["cuda"]
    # and on the CPU (interpreter) they stay on the CPU
    calls.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(_Built):
        build()
    assert calls == ["cpu"]
