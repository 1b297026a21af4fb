"""The prefill workspace, in one place: :class:`PrefillWorkspace`, its default size
(:func:`default_workspace_rows`, :data:`MAX_WORKSPACE_ROWS`), its row widths (:func:`workspace_widths`) and the
one workspace per device every layer shares (:func:`shared_workspace`, :func:`workspace_key`).

``forward_mha`` packs a step's cached context into chunks of at most ``workspace_rows`` rows and up-projects
each chunk into a :class:`PrefillWorkspace` (``rows * heads * (qk_nope + v)`` values:
512 MiB for DeepSeek-V3 at TP=8 in bf16 at 64k rows). Layers run one after another on a stream, so they can
all use the same buffers: the rule is **one workspace per (device, dtype, stream, chunk bound)**, shared by
every layer that runs there. It grows to the largest chunk a step needs (never past the bound the layer
derives, :func:`default_workspace_rows`) and is never shrunk, so what the layers hold
beyond their weights does not grow with the number of layers.

Streams: two streams may run layers at the same time, so each CUDA stream gets its own workspace (the
stream current when the layer runs). CPU work runs in the calling thread, so on the CPU each thread gets its
own (layers in several threads under one step plan never share a chunk buffer). An engine that wants its own
buffers passes ``MLAAttention(..., workspace=PrefillWorkspace(rows))``; that workspace is then used for every
call of that layer, whatever the stream (ordering them is the engine's job).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from ..core.validation import require_device, require_int

__all__ = ["PrefillWorkspace", "MAX_WORKSPACE_ROWS", "default_workspace_rows", "workspace_widths", "shared_workspace",
           "workspace_key", "shared_workspaces", "clear_shared_workspaces"]

#: cap of the default workspace (vLLM's 64k rows)
MAX_WORKSPACE_ROWS = 64 * 1024


def default_workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 65536)``: room for eight full-length
    requests or four pages per running request, capped at 64k rows (vLLM's sizing)."""
    require_int("max_model_len", max_model_len, minimum=1)
    require_int("max_num_seqs", max_num_seqs, minimum=1)
    require_int("block_size", block_size, minimum=1)
    return min(max(8 * max_model_len, 4 * max_num_seqs * block_size), MAX_WORKSPACE_ROWS)


def workspace_widths(kv_lora_rank: int, qk_rope_head_dim: int, heads: int, qk_nope_head_dim: int,
                     v_head_dim: int) -> tuple[int, int]:
    """``(R + P, H * (N + V))``: the values per row of a :class:`PrefillWorkspace`'s ``latent`` buffer (a
    gathered cache row) and ``kv`` buffer (this rank's ``heads`` of up-projected K-nope and V). The one
    formula of the workspace's size: ``forward_mha`` allocates with it and the sizing reports count with it."""
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim), ("heads", heads),
                        ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
        require_int(name, value, minimum=1)
    return kv_lora_rank + qk_rope_head_dim, heads * (qk_nope_head_dim + v_head_dim)


class PrefillWorkspace:
    """Buffers for one context chunk of at most ``rows`` cache rows, grown on demand and reused.

    ``rows`` is the bound (the chunk size ``forward_mha`` packs the cached context into); the buffers are
    only as large as the largest chunk a step needed so far (never shrunk, never past the bound).
    ``latent``: ``[rows_used, kv_lora_rank + qk_rope_head_dim]`` gathered cache rows (model dtype; used directly
    when the cache stores the model dtype, else the dequantised read is used). ``kv``: ``[rows_used, heads *
    (qk_nope + v)]`` up-projected keys/values, the large buffer (``rows * heads * 256`` values for DeepSeek).
    ``allocations`` counts (re)allocations. One workspace may serve every layer of a device
    (:mod:`mla_backends.layer.workspace`); calls using it must be ordered on one stream.
    """

    def __init__(self, rows: int) -> None:
        require_int("workspace_rows", rows, minimum=1)
        self.rows = rows
        self.latent: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        self.allocations = 0

    def buffers(self, row_width: int, kv_width: int, dtype: torch.dtype, device: torch.device,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent [n, row_width], kv [n, kv_width])`` with ``n >= rows`` (default: the bound ``self.rows``);
        reallocated only when a buffer is too small or of another dtype/device."""
        need = self.rows if rows is None else min(require_int("rows", rows, minimum=1), self.rows)
        kv, lat = self.kv, self.latent
        if (kv is None or lat is None or kv.shape[0] < need or kv.shape[1] != kv_width or kv.dtype != dtype
                or kv.device != device or lat.shape[1] != row_width):
            have = 0 if kv is None or kv.shape[1] != kv_width or kv.dtype != dtype or kv.device != device \
                else kv.shape[0]
            n = max(need, have)
            # normal tensors even when first needed under torch.inference_mode() (mla-backends tune): the
            # workspace is shared, and a later call outside that mode writes into it
            with torch.inference_mode(False):
                self.latent = lat = torch.empty(n, row_width, dtype=dtype, device=device)
                self.kv = kv = torch.empty(n, kv_width, dtype=dtype, device=device)
            self.allocations += 1
        return lat, kv

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now (0 before the first prefill over cached context)."""
        return sum(t.numel() * t.element_size() for t in (self.latent, self.kv) if t is not None)



_LOCK = threading.Lock()
_SHARED: dict[Hashable, PrefillWorkspace] = {}


def workspace_key(device: str | torch.device, dtype: torch.dtype, rows: int) -> tuple[Hashable, ...]:
    """``(device, dtype, stream, rows)``: the key of the shared workspace a layer on ``device`` uses now
    (``stream`` is the current CUDA stream's id on CUDA devices; elsewhere ``("thread", id)`` of the calling
    thread, where the work runs). ``device`` is checked by
    :func:`~mla_backends.core.validation.require_device` (a CUDA index past the last device is a ValueError)."""
    device = require_device("device", device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream: Hashable = torch.cuda.current_stream(device).stream_id
    else:
        stream = ("thread", threading.get_ident())
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
