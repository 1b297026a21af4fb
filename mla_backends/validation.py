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

__all__ = ["require_tensor", "require_int", "require_on_device", "require_finite", "require_scale"]


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
        ndim = len(shape)
    if ndim is not None and x.dim() != ndim:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]" if shape else f"{ndim}-D"
        raise ValueError(f"{name}: got shape {list(x.shape)}; supported {want}")
    if shape is not None:
        for got, want in zip(x.shape, shape, strict=True):
            if want is not None and got != want:
                spec = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name}: got shape {list(x.shape)}; supported {spec}")
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
    for name, t in tensors.items():
        if t.device != device:
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


def require_scale(name: str, x: object) -> float:
    """A softmax or cache scale: a real, finite, positive number (a Python number, or a one-element tensor,
    read on the host), returned as a float. ``inf``, ``nan``, ``0``, negatives, bools, strings and tensors of
    more than one element are refused naming ``name``."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name}: got a tensor of shape {list(x.shape)} dtype {dtype_name(x.dtype)}; "
                             "supported a positive finite number (or a one-element real tensor)")
        x = x.item()
    return require_finite(name, x, positive=True)
