"""Input checks shared by every public entry point.

Each helper raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape or value) with
a message naming the argument, what was given and what is accepted. They run before any kernel launches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from .dtypes import dtype_name

__all__ = ["require_tensor", "require_int", "require_on_device", "require_finite", "require_scale",
           "require_device", "DEVICE_TYPES", "tensors_overlap", "require_no_alias", "require_separate",
           "first_shared"]


def require_tensor(
    name: str,
    x: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Check that ``x`` is a tensor of the given rank, shape (None entries are free) and dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: got {type(x).__name__}; supported torch.Tensor")
    if shape is not None:
        got = x.shape
        bad = len(got) != len(shape)
        if not bad:
            for g, w in zip(got, shape, strict=True):
                if w is not None and g != w:
                    bad = True
                    break
        if bad:
            spec = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]" if shape else "0-D"
            raise ValueError(f"{name}: got shape {list(got)}; supported {spec}")
    elif ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: got shape {list(x.shape)}; supported {ndim}-D")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: got dtype {dtype_name(x.dtype)}; supported {names}")
    return x


def require_int(name: str, x: object, *, minimum: int | None = None) -> int:
    """Check that ``x`` is an int (not a bool), at least ``minimum``."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: got {type(x).__name__} {x!r}; supported int")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name}: got {x}; supported >= {minimum}")
    return x


def require_on_device(device: torch.device, owner: str = "the cache's", **tensors: torch.Tensor) -> None:
    """Check that every named tensor lives on ``device`` (``owner`` names whose device it is in the message)."""
    cpu = device.type == "cpu"  # on the CPU a flag is read, not a device object made per tensor (every call)
    for name, t in tensors.items():
        if (not t.is_cpu) if cpu else t.device != device:
            raise ValueError(f"{name}: got device {t.device}; supported {owner} device {device}")


def require_finite(name: str, x: object, *, positive: bool = False, minimum: float | None = None,
                   what: str = "a finite number") -> float:
    """``x`` as a float: a real number (an int or a float, never a bool, a string or a tensor) that is finite, and
    ``> 0`` with ``positive`` / ``>= minimum`` with ``minimum``; raises naming ``name`` otherwise."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: got {type(x).__name__} {x!r}; supported {what}")
    value = float(x)
    if not math.isfinite(value) or (positive and not value > 0) or (minimum is not None and value < minimum):
        bound = " > 0" if positive else (f" >= {minimum:g}" if minimum is not None else "")
        raise ValueError(f"{name}: got {x!r}; supported {what}{bound}")
    return value


def require_scale(name: str, x: object, *, tensor_ok: bool = False,
                  what: str = "a positive finite float") -> float:
    """A softmax or cache scale as a float: a real, finite number ``> 0``. Every fault is a ``ValueError``
    naming ``name`` (a scale is a value: ``inf``, ``nan``, ``0``, negatives, bools, strings, None).

    With ``tensor_ok`` a one-element real tensor is accepted too and read on the host (a sync on GPU
    tensors; never on a hot path); a tensor of more elements (``tensor([2., 3.])``) is refused.
    """
    if type(x) is float and 0.0 < x < math.inf:  # the common case (every forward_mqa call), without the checks below
        return x
    if isinstance(x, torch.Tensor) and tensor_ok:
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name}: got a tensor of shape {list(x.shape)} dtype {dtype_name(x.dtype)}; "
                             f"supported {what} (or a one-element real tensor)")
        x = x.item()
    try:
        return require_finite(name, x, positive=True, what=what)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


#: torch device types the library places tensors on (``meta``: shapes only, for tests and dry runs)
DEVICE_TYPES = ("cpu", "cuda", "meta")


def require_device(name: str, device: object) -> torch.device:
    """``device`` (a string such as ``"cpu"`` / ``"cuda:1"``, a ``torch.device`` or a CUDA index) as a
    ``torch.device`` that exists on this machine.

    Raises ``TypeError`` for another kind of object and ``ValueError`` for a string torch cannot parse
    (``"bogus"``), a type outside :data:`DEVICE_TYPES`, ``"cuda"`` where CUDA is not available, or a CUDA
    index past the last device, naming ``name`` instead of surfacing torch's own error later.
    """
    supported = "'cpu', 'cuda' or 'cuda:N' (a CUDA device present here)"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name}: got {type(device).__name__} {device!r}; supported {supported}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name}: got {device!r}; supported {supported}") from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"{name}: got {device!r} (device type {dev.type}); supported {supported}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: got {device!r}, but CUDA is not available on this machine; "
                             "supported 'cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(f"{name}: got {device!r}; supported cuda:0 .. cuda:{count - 1} ({count} CUDA "
                             "device(s) here)")
    return dev


def _memory(t: torch.Tensor | None) -> tuple[int, int] | None:
    """``[start, end)`` of the bytes ``t`` can touch (its first to last element, strides included); None for None
    and for a tensor without memory (empty, or on the meta device: its data pointer is 0)."""
    if t is None:
        return None
    start = t.data_ptr()
    if not start:
        return None
    if t.is_contiguous():  # the common case (every forward_mqa call): no loop over the dims
        size = t.nbytes
        return (start, start + size) if size else None
    if not t.numel():
        return None
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (extent + 1) * t.element_size()


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` may share memory: same device, both non-empty, intersecting byte spans.

    Host metadata only (pointers, shapes, strides; no device read). Conservative: two interleaved views whose
    spans intersect count as overlapping. Meta tensors never overlap (they have no memory).
    """
    ma, mb = _memory(a), _memory(b)
    return ma is not None and mb is not None and ma[0] < mb[1] and mb[0] < ma[1] and a.device == b.device


def first_shared(outputs: dict[str, torch.Tensor | None],
                 inputs: dict[str, torch.Tensor | None]) -> tuple[str, str] | None:
    """The first output (in ``outputs``' order) that shares memory with an earlier output or with one of
    ``inputs``, and what it shares it with, as ``(output name, other name)``; None when every output is separate.
    Each tensor's span is worked out once (this runs on every ``forward_mqa`` call)."""
    ins = [(n, t, m) for n, t in inputs.items() if (m := _memory(t)) is not None]
    outs: list[tuple[str, torch.Tensor, tuple[int, int]]] = []
    for name, x in outputs.items():
        mx = _memory(x)
        if mx is None:
            continue
        x0, x1 = mx
        for other_name, other, (o0, o1) in outs + ins:  # earlier outputs first, then the inputs
            if x0 < o1 and o0 < x1 and other.device == x.device:  # (devices compared only where spans meet)
                return name, other_name
        outs.append((name, x, mx))
    return None


def require_separate(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Raise ``ValueError`` naming the first output (in ``outputs``' order) that shares memory with an earlier
    output or with one of ``inputs`` (what the kernel reads while it writes the outputs; aliasing them corrupts
    results silently)."""
    shared = first_shared(outputs, inputs)
    if shared is not None:
        raise ValueError(f"{shared[0]}: got a buffer sharing memory with {shared[1]}; supported a separate buffer "
                         "(an output may not alias an input or another output)")


def require_no_alias(name: str, x: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ``ValueError`` when the output buffer ``x`` shares memory with one of ``others`` (inputs the
    kernel reads while it writes ``x``; aliasing them corrupts results silently)."""
    require_separate({name: x}, others)
