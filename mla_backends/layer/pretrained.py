"""Every attention layer of a checkpoint folder: :func:`load_attention_layers`.

One layer at a time is read (:class:`~mla_backends.loading.checkpoint.Checkpoint`), dequantised, loaded into its
:class:`~mla_backends.layer.attention.MLAAttention` and dropped, so the memory held beyond the result is one layer's
weights. Every requested layer's keys and shards are checked against the index before the first tensor is
read; if any layer then fails, the error propagates and no layer is returned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from ..core.progress import ProgressBar
from ..core.validation import require_int
from ..loading.checkpoint import Checkpoint, check_load_arguments
from .attention import MLAAttention
from .v4 import V4Attention

__all__ = ["load_attention_layers", "from_pretrained"]


def from_pretrained(path: str | os.PathLike, layer_idx: int, **options: Any) -> MLAAttention:
    """Same as :meth:`MLAAttention.from_pretrained`."""
    return MLAAttention.from_pretrained(path, layer_idx, **options)


def load_attention_layers(
    path: str | os.PathLike,
    layers: Iterable[int] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: bool = True,
    **options: Any,
) -> dict[int, MLAAttention | V4Attention]:
    """``{layer_idx: MLAAttention}`` for ``layers`` (default: all of the config's ``num_hidden_layers``);
    :class:`~mla_backends.layer.v4.V4Attention` layers for a DeepSeek-V4 checkpoint.

    The arguments are checked before the checkpoint is opened (``dtype``, ``tp_rank``/``tp_size``, option
    names, ``device``: :func:`~mla_backends.loading.checkpoint.check_load_arguments`), every layer's keys and shards
    before any layer is built, and the first layer (``backend``, ``dispatch`` ... against this model) before
    any tensor is read.

    Args:
        path: checkpoint folder (``config.json`` + ``model.safetensors`` or shards with an index).
        layers: layer indices to load, in any order (duplicates ignored).
        dtype: model dtype; None = the checkpoint's own (bfloat16 for fp8 releases).
        tp_rank / tp_size: this rank's heads only; it reads only its slices.
        progress: a one-line progress bar on stderr.
        options: passed to :meth:`MLAAttention.from_hf_config` (``backend``, ``device``, ``dispatch`` ...).
    """
    wanted: list[int] | None = None
    if layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers: got {type(layers).__name__}; supported an iterable of layer indices or None")
        wanted = sorted({require_int(f"layers[{i}]", v, minimum=0) for i, v in enumerate(layers)})
    if not isinstance(progress, bool):
        raise TypeError(f"progress: got {type(progress).__name__}; supported True or False")
    check_load_arguments(MLAAttention.from_hf_config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                         options=options)  # before the checkpoint is opened
    ckpt = Checkpoint(path)  # config.json and the index, no tensors
    layer_cls: Any = V4Attention if ckpt.is_v4 else MLAAttention
    if ckpt.is_v4:  # V4 layers take fewer options: a V2/V3-only one is refused by name before any read
        check_load_arguments(V4Attention.from_hf_config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                             options=options)
    if wanted is None:
        wanted = list(range(ckpt.num_layers))
    for idx in wanted:  # keys and shards of every layer checked before any layer is built or read
        ckpt.layer_files(idx)
    out_dtype = ckpt.resolve_dtype(dtype)
    bar = ProgressBar(len(wanted), enabled=progress)
    result: dict[int, MLAAttention | V4Attention] = {}
    for idx in wanted:  # the layer first: a backend= or option that fails for this model fails before a read
        layer = layer_cls.from_hf_config(ckpt.config, dtype=out_dtype, tp_rank=tp_rank, tp_size=tp_size,
                                         layer_idx=idx, **options)
        state = ckpt.read_attention_layer(idx, tp_rank=tp_rank, tp_size=tp_size, dtype=out_dtype)
        layer.load_hf_state_dict(state, sharded=True)
        del state
        result[idx] = layer
        bar.update(f"layer {idx}")
    return result
