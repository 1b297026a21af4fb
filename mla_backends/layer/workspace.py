"""One prefill workspace per device: :func:`shared_workspace` and :func:`workspace_key`.

``forward_mha`` packs a step's cached context into chunks of at most ``workspace_rows`` rows and up-projects
each chunk into a :class:`~mla_backends.layer.prefill.PrefillWorkspace` (``rows * heads * (qk_nope + v)`` values:
512 MiB for DeepSeek-V3 at TP=8 in bf16 at 64k rows). Layers run one after another on a stream, so they can
all use the same buffers: the rule is **one workspace per (device, dtype, stream, chunk bound)**, shared by
every layer that runs there. It grows to the largest chunk a step needs (never past the bound the layer
derives, :func:`~mla_backends.layer.prefill.default_workspace_rows`) and is never shrunk, so what the layers hold
beyond their weights does not grow with the number of layers.

Streams: two streams may run layers at the same time, so each CUDA stream gets its own workspace (the
stream current when the layer runs). CPU work has one ``stream`` (None). An engine that wants its own
buffers passes ``MLAAttention(..., workspace=PrefillWorkspace(rows))``; that workspace is then used for every
call of that layer, whatever the stream (ordering them is the engine's job).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from ..core.validation import require_device, require_int
from .prefill import PrefillWorkspace

__all__ = ["shared_workspace", "workspace_key", "shared_workspaces", "clear_shared_workspaces"]

_LOCK = threading.Lock()
_SHARED: dict[Hashable, PrefillWorkspace] = {}


def workspace_key(device: str | torch.device, dtype: torch.dtype, rows: int) -> tuple[Hashable, ...]:
    """``(device, dtype, stream, rows)``: the key of the shared workspace a layer on ``device`` uses now
    (``stream`` is the current CUDA stream's id on CUDA devices, None elsewhere). ``device`` is checked by
    :func:`~mla_backends.core.validation.require_device` (a CUDA index past the last device is a ValueError)."""
    device = require_device("device", device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream: int | None = torch.cuda.current_stream(device).stream_id
    else:
        stream = None
    return (str(device), dtype, stream, rows)


def shared_workspace(device: str | torch.device, dtype: torch.dtype, rows: int) -> PrefillWorkspace:
    """The process-wide workspace of ``(device, dtype, current stream)`` with a chunk bound of ``rows``
    (created empty on first use; its buffers grow when a prefill over cached context needs them)."""
    device = require_device("device", device)
    require_int("rows", rows, minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: got {type(dtype).__name__}; supported a torch.dtype")
    key = workspace_key(device, dtype, rows)
    with _LOCK:
        ws = _SHARED.get(key)
        if ws is None:
            ws = PrefillWorkspace(rows)
            _SHARED[key] = ws
        return ws


def shared_workspaces() -> dict[Hashable, PrefillWorkspace]:
    """A snapshot of every shared workspace, by :func:`workspace_key` (for reports and tests)."""
    with _LOCK:
        return dict(_SHARED)


def clear_shared_workspaces() -> None:
    """Forget every shared workspace (their memory is freed once no layer refers to them)."""
    with _LOCK:
        _SHARED.clear()
