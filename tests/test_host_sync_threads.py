"""``no_host_sync`` across threads and nesting: the ``Tensor`` patches are reference-counted and process-wide,
and each guard reports only the syncs of its own thread."""

from __future__ import annotations

import threading

import pytest
import torch
from thread_runs import run_in_thread

from mla_backends.testing import HostSyncError, no_host_sync

X = torch.arange(6, dtype=torch.float32)
PATCHED = ("tolist", "cpu", "numpy", "__array__", "item", "__int__", "__float__", "__bool__", "__index__")


def _methods() -> dict[str, object]:
    return {name: getattr(torch.Tensor, name) for name in PATCHED}


def test_overlapping_guards_in_two_threads_ending_out_of_order_restore_the_originals():
    originals = _methods()
    a_in, b_in, a_out = (threading.Event() for _ in range(3))
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def first() -> None:  # enters first, leaves first
        try:
            with no_host_sync(count=True) as rec:
                a_in.set()
                assert b_in.wait(30)
                X.tolist()
            seen["a"] = list(rec.ops)
            X.tolist()  # outside any guard in this thread, while the other thread's guard is active
            seen["a_after"] = X.tolist()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            a_out.set()

    def second() -> None:  # enters second, leaves last
        try:
            assert a_in.wait(30)
            with no_host_sync(count=True) as rec:
                b_in.set()
                assert a_out.wait(30)
                X.tolist()  # the first guard has ended: this guard must still see its own thread's syncs
                with torch.inference_mode():
                    X[1].item()
            seen["b"] = list(rec.ops)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            b_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    after = _methods()
    assert all(after[name] is originals[name] for name in PATCHED), [n for n in PATCHED if after[n] is not originals[n]]
    assert seen["a"] == ["Tensor.tolist"]  # each guard sees its own thread's sync, whichever wrapper is on top
    assert seen["a_after"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert seen["b"] == ["Tensor.tolist", "Tensor.item"]
    # no guard anywhere now: no thread (whatever id it gets) sees an error
    for _ in range(4):
        assert run_in_thread(lambda: (X.tolist(), X[0].item(), float(X[2]), X.cpu())) == []


def test_a_guard_does_not_report_another_threads_syncs():
    with no_host_sync():  # raising guard in this thread
        assert run_in_thread(lambda: (X.tolist(), X[0].item(), X.numpy())) == []
    with no_host_sync(count=True) as rec:
        assert run_in_thread(lambda: X.tolist()) == []
    assert rec.count == 0


def test_nested_guards_in_one_thread():
    originals = _methods()
    with no_host_sync(count=True) as outer:
        with no_host_sync(count=True) as inner:
            X.tolist()
        assert inner.ops == ["Tensor.tolist"]
        X[0].item()  # the inner guard ended; the outer one is still active (patches stay installed)
        with pytest.raises(HostSyncError, match="Tensor.cpu"), no_host_sync():
            X.cpu()
        assert torch.Tensor.tolist is not originals["tolist"]
    assert outer.ops == ["Tensor.tolist", "Tensor.item"]  # the raising inner guard stopped Tensor.cpu
    assert all(_methods()[name] is originals[name] for name in PATCHED)


def test_guard_restores_originals_after_an_error():
    originals = _methods()
    with pytest.raises(HostSyncError), no_host_sync():
        X.tolist()
    assert all(_methods()[name] is originals[name] for name in PATCHED)
    assert X.tolist()[1] == 1.0
