"""Input checks shared by every public entry point.

Each helper raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape or value) with
a message naming the argument, what was given and what is accepted. They run before any kernel launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dtypes import dtype_name

__all__ = ["require_tensor", "require_int", "require_on_device"]


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
