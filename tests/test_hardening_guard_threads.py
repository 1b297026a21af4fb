"""Hardening (issue 28, item 7): a host-sync guard exited in another thread than the one that entered it.

The exit raises :class:`GuardThreadError` naming both threads, and the guard is over all the same: the entering
thread is no longer guarded (or paused), its later guards work as usual, and the ``Tensor`` patches are gone
once the last guard ends. Every thread runs with a timeout."""

from __future__ import annotations

import threading

import pytest
import torch
from thread_runs import run_in_thread

from mla_backends.testing import GuardThreadError, HostSyncError, host_sync_allowed, no_host_sync

X = torch.arange(4, dtype=torch.float32)
PATCHED = ("tolist", "cpu", "numpy", "__array__", "item", "__int__", "__float__", "__bool__", "__index__")


def _exit_elsewhere(cm) -> list[BaseException]:
    """Call ``cm.__exit__`` in a new thread named ``other``; return what it raised."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            cm.__exit__(None, None, None)
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors.append(e)

    t = threading.Thread(target=body, name="other")
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    return errors


def _assert_clear(errors: list[BaseException], what: str) -> None:
    assert len(errors) == 1 and isinstance(errors[0], GuardThreadError), errors
    msg = str(errors[0])
    assert msg.startswith(f"{what}: exited in thread 'other'") and "entered in thread 'owner'" in msg, msg


@pytest.mark.parametrize("inference", [False, True])
def test_a_guard_exited_in_another_thread_ends_for_the_entering_thread(inference):
    originals = {name: getattr(torch.Tensor, name) for name in PATCHED}

    def owner() -> None:
        cm = no_host_sync()
        cm.__enter__()
        with pytest.raises(HostSyncError):
            X.sum().item()  # guarded
        _assert_clear(_exit_elsewhere(cm), "no_host_sync()")
        with torch.inference_mode(inference):
            assert X.sum().item() == 6.0 and X.tolist()[1] == 1.0  # no longer guarded
            assert torch.equal(X, X) and bool(X.nonzero().numel())  # the mode left behind is inert
            with no_host_sync(count=True) as rec:  # a later guard works, and counts once per sync
                X[0].item()
                torch.equal(X, X)
            assert rec.ops == ["Tensor.item", "aten.equal"]
            with pytest.raises(HostSyncError):
                with no_host_sync():
                    int(X[1])
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        assert _get_current_dispatch_mode() is None  # the later guards dropped the inert mode

    assert run_in_thread(owner, "owner") == []
    assert {name: getattr(torch.Tensor, name) for name in PATCHED} == originals


def test_a_pause_exited_in_another_thread_no_longer_pauses_later_guards():
    def owner() -> None:
        pause = host_sync_allowed()
        pause.__enter__()
        _assert_clear(_exit_elsewhere(pause), "host_sync_allowed()")
        with pytest.raises(HostSyncError):  # before the fix the thread stayed paused: the sync was missed
            with no_host_sync():
                X.sum().item()
        with no_host_sync(count=True) as rec:
            with host_sync_allowed():  # pauses still work in the thread
                X.tolist()
            X[2].item()
        assert rec.ops == ["Tensor.item"]

    assert run_in_thread(owner, "owner") == []


def test_a_guard_exited_in_another_thread_leaves_that_threads_own_guard_alone():
    started, handed, done = threading.Event(), threading.Event(), threading.Event()
    box: dict[str, object] = {}
    seen: list[str] = []

    def other_body() -> None:  # a thread with its own active guard exits the owner's guard
        with no_host_sync(count=True) as rec:
            started.set()
            assert handed.wait(60)
            try:
                box["cm"].__exit__(None, None, None)  # type: ignore[attr-defined]
            except GuardThreadError as e:
                seen.append(str(e))
            X[0].item()  # its own guard still sees its own syncs
            seen.extend(rec.ops)
        done.set()

    def owner() -> None:
        other = threading.Thread(target=other_body, name="other")
        other.start()
        assert started.wait(60)
        cm = no_host_sync()
        cm.__enter__()
        box["cm"] = cm
        handed.set()
        assert done.wait(60)
        other.join(timeout=60)
        assert not other.is_alive()
        X.sum().item()  # not guarded any more

    assert run_in_thread(owner, "owner") == []
    assert len(seen) == 2 and "entered in thread 'owner'" in seen[0] and seen[1] == "Tensor.item"


def test_a_guard_is_entered_once():
    cm = no_host_sync()
    with cm:
        with pytest.raises(RuntimeError, match="already entered"):
            cm.__enter__()
    with pytest.raises(TypeError, match="count: got int"):
        no_host_sync(count=1)
