"""Detect device-to-host synchronisation: :func:`no_host_sync`, :class:`HostSyncError`, :func:`host_sync_allowed`.

A sync is any operation whose result the host needs before it can go on: reading a value (``.item()``,
``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``), comparing whole tensors (``torch.equal``) or
making a shape that depends on the data (boolean-mask indexing, ``nonzero``, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``). On a GPU each one stalls the stream, and any one of them
makes CUDA-graph capture impossible. The guard catches them on the CPU too, so CPU tests prove the hot path
sync-free.

How: a ``TorchDispatchMode`` sees the aten ops (``_local_scalar_dense`` is what ``.item()``/``bool()``/
``int()`` become); ``Tensor.tolist``, ``.cpu``, ``.numpy`` and ``__array__`` never reach the dispatcher as
such, and under ``torch.inference_mode`` the scalar reads skip the mode, so those methods (and ``item``,
``__int__``, ``__float__``, ``__bool__``, ``__index__``) are patched while any guard in the process is active
(reference-counted: installed by the first guard, the originals restored by the last); the wrappers report
only to the calling thread's own stack of active guards.
:func:`host_sync_allowed` pauses the guard (Triton's interpreter copies to the host by design;
``TRITON_MLA`` wraps each interpreted launch in it).

A guard ends in the thread that entered it. Exiting one in another thread (a context manager handed over
by hand) raises :class:`GuardThreadError` naming both threads, and the guard is over all the same: the
entering thread is no longer guarded (or paused), and its later guards work as usual. (The dispatch mode
of such a guard stays on the entering thread's mode stack, inert, until that thread's next guard starts or
ends and drops it.)

This module imports only torch (foundation layer); :mod:`mla_backends.testing` re-exports the public names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = ["HostSyncError", "GuardThreadError", "SyncRecord", "no_host_sync", "host_sync_allowed", "SYNC_OPS"]


class HostSyncError(RuntimeError):
    """A device-to-host synchronisation happened under :func:`no_host_sync`; the message names the operation."""


class GuardThreadError(RuntimeError):
    """A :func:`no_host_sync` or :func:`host_sync_allowed` block was exited in a thread other than the one
    that entered it; the message names both threads. The guard is over all the same."""


#: aten overload packets that always synchronise (their result is a host value or a data-dependent shape)
SYNC_OPS: frozenset[str] = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static_unused", "masked_select",
    "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "argwhere", "masked_scatter_unused",
})
#: Tensor methods that copy to the host without a dispatcher op the mode always sees (patched while active):
#: ``tolist``/``cpu``/``numpy``/``__array__`` never reach it as such, and under ``torch.inference_mode`` the
#: scalar reads (``item``, ``int()``, ``float()``, ``bool()``, ``__index__``) skip the Python dispatch key.
#: ``_STATE.state`` (per thread): that thread's :class:`_ThreadState`
_PATCHED = ("tolist", "cpu", "numpy", "__array__", "item", "__int__", "__float__", "__bool__", "__index__")

_STATE = threading.local()


class _ThreadState:
    """One thread's guard state: ``paused`` (depth of :func:`host_sync_allowed`), ``guards`` (its active
    guards' report callbacks, outermost first). A guard keeps a reference to its thread's state, so an exit
    in another thread still ends it there."""

    __slots__ = ("paused", "guards")

    def __init__(self) -> None:
        self.paused = 0
        self.guards: list[Callable[[str], None]] = []


def _state() -> _ThreadState:
    """The calling thread's guard state (created on first use)."""
    st = getattr(_STATE, "state", None)
    if st is None:
        st = _STATE.state = _ThreadState()
    return st


def _paused() -> bool:
    st = getattr(_STATE, "state", None)
    return st is not None and st.paused > 0


def _thread_error(what: str, owner: threading.Thread) -> GuardThreadError:
    here = threading.current_thread()
    return GuardThreadError(
        f"{what}: exited in thread {here.name!r} (ident {here.ident}), entered in thread {owner.name!r} "
        f"(ident {owner.ident}); supported exiting in the thread that entered it. The guard is over: thread "
        f"{owner.name!r} is no longer affected by it")


class _Pause:
    """The context manager :func:`host_sync_allowed` returns (one ``with`` block)."""

    def __init__(self) -> None:
        self._state: _ThreadState | None = None
        self._owner: threading.Thread | None = None

    def __enter__(self) -> None:
        if self._state is not None:
            raise RuntimeError("host_sync_allowed(): this block was already entered; call host_sync_allowed() "
                               "for each with-block")
        self._state, self._owner = _state(), threading.current_thread()
        self._state.paused += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        st, owner = self._state, self._owner
        if st is None or owner is None:
            return
        self._state = None  # over, whichever thread ends it
        st.paused -= 1  # the entering thread's count, even when another thread exits
        if owner is not threading.current_thread():
            raise _thread_error("host_sync_allowed()", owner)


def host_sync_allowed() -> _Pause:
    """Pause any active :func:`no_host_sync` guard of this thread (for code that syncs by design)."""
    return _Pause()


class SyncRecord:
    """What a counting guard saw: ``count`` syncs, ``ops`` their operation names in order."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    @property
    def count(self) -> int:
        return len(self.ops)

    def __repr__(self) -> str:
        return f"SyncRecord(count={self.count}, ops={self.ops})"


def _has_bool_index(args: tuple, kwargs: dict) -> bool:
    """True when an ``index``/``index_put`` call indexes with a boolean (mask) tensor."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name of the sync ``func(*args, **kwargs)`` makes (an aten overload), or None when it makes none."""
    name = func.overloadpacket.__name__.rstrip("_") if hasattr(func, "overloadpacket") else str(func)
    if name in SYNC_OPS:
        return name
    if name in ("index", "index_put", "_index_put_impl") and _has_bool_index(args, kwargs):
        return f"{name} with a boolean mask (data-dependent shape)"
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) or (len(args) == 1 and isinstance(args[0], torch.Tensor)):
            return "repeat_interleave without output_size"
    return None


class _SyncMode(TorchDispatchMode):
    def __init__(self, on_sync: Callable[[str], None]) -> None:
        super().__init__()
        self.on_sync = on_sync
        self.ended = False  # set when its guard is over: from then on it reports nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not self.ended and not _paused():
            why = sync_reason(func, args, kwargs)
            if why is not None:
                self.on_sync(f"aten.{why}")
        return func(*args, **kwargs)


#: the patching is process-wide and reference-counted: the wrappers go in when the first guard of the process
#: starts and the true originals come back when the last one ends (under ``_PATCH_LOCK``), so guards that
#: overlap in several threads and end in any order never leave a wrapper behind
_PATCH_LOCK = threading.Lock()
_PATCH_USERS = 0
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _drop_ended_modes() -> None:
    """Pop the modes of guards that ended in another thread from the top of this thread's mode stack."""
    while isinstance(top := _get_current_dispatch_mode(), _SyncMode) and top.ended:
        top.__exit__(None, None, None)


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.<name>`` that reports to the calling thread's active guards (innermost first), then runs
    ``original`` with the guards paused (so the copy is not reported again as ``_local_scalar_dense``)."""

    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        st = getattr(_STATE, "state", None)
        stack = None if st is None else st.guards
        if stack and not st.paused:
            for on_sync in reversed(list(stack)):
                on_sync(f"Tensor.{name}")
        with host_sync_allowed():
            return original(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    method.__doc__ = getattr(original, "__doc__", None)
    return method


def _acquire_patches() -> None:
    """Count one more active guard in the process; the first one installs the wrappers."""
    global _PATCH_USERS
    with _PATCH_LOCK:
        if _PATCH_USERS == 0:
            _ORIGINALS.clear()
            _ORIGINALS.update({name: getattr(torch.Tensor, name) for name in _PATCHED})
            for name, original in _ORIGINALS.items():
                setattr(torch.Tensor, name, _wrapper(name, original))
        _PATCH_USERS += 1


def _release_patches() -> None:
    """Count one guard less; the last one restores the original ``Tensor`` methods."""
    global _PATCH_USERS
    with _PATCH_LOCK:
        _PATCH_USERS -= 1
        if _PATCH_USERS == 0:
            for name, original in _ORIGINALS.items():
                setattr(torch.Tensor, name, original)
            _ORIGINALS.clear()


class _Guard:
    """The context manager :func:`no_host_sync` returns (one ``with`` block); entering yields its record."""

    def __init__(self, count: bool) -> None:
        self.count = count
        self.record = SyncRecord()
        self._report = self._on_sync  # one bound method: found again by identity in the thread's stack
        self._mode: _SyncMode | None = None
        self._state: _ThreadState | None = None
        self._owner: threading.Thread | None = None

    def _on_sync(self, what: str) -> None:
        if self.count:
            self.record.ops.append(what)
        else:
            raise HostSyncError(f"host sync under no_host_sync(): {what}")

    def __enter__(self) -> SyncRecord:
        if self._owner is not None:
            raise RuntimeError("no_host_sync(): this guard was already entered; call no_host_sync() for each "
                               "with-block")
        _drop_ended_modes()
        mode = _SyncMode(self._report)
        _acquire_patches()
        try:
            mode.__enter__()
        except BaseException:
            _release_patches()
            raise
        self._mode, self._state, self._owner = mode, _state(), threading.current_thread()
        self._state.guards.append(self._report)
        return self.record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        mode, st, owner = self._mode, self._state, self._owner
        if mode is None or st is None or owner is None or mode.ended:
            return
        mode.ended = True  # over, whichever thread ends it: it reports nothing from now on
        stack = st.guards  # the entering thread's stack, even when another thread exits
        for i in range(len(stack) - 1, -1, -1):  # by identity: this guard's entry, wherever it is
            if stack[i] is self._report:
                del stack[i]
                break
        try:
            if owner is threading.current_thread():
                _drop_ended_modes()  # pops this guard's mode when it is on top (the usual, nested case)
        finally:
            _release_patches()
        if owner is not threading.current_thread():
            raise _thread_error("no_host_sync()", owner)


def no_host_sync(*, count: bool = False) -> _Guard:
    """Raise :class:`HostSyncError` at the first device-to-host sync inside the block (``count=False``), or
    record every one in the yielded :class:`SyncRecord` and raise nothing (``count=True``).

    Works on the CPU as on a GPU (it looks at operations, not at devices). A guard sees only its own thread:
    the dispatch mode is per thread, and the patched ``Tensor`` methods (installed process-wide while any
    guard in the process is active) report to the calling thread's active guards only. Nested guards all
    see a sync, innermost first (a raising one stops it reaching those outside). Paused inside
    :func:`host_sync_allowed`. Exited in another thread than the one that entered it, the guard ends and
    :class:`GuardThreadError` names both threads (module docstring).
    """
    if not isinstance(count, bool):
        raise TypeError(f"count: got {type(count).__name__}; supported bool")
    return _Guard(count)
