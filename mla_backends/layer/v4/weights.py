"""Loading transformers-named DeepSeek-V4 attention weights into a :class:`~mla_backends.layer.v4.V4Attention`.

The same guarantees as the V2/V3 layer (:mod:`mla_backends.layer.weights`): every key is checked first (missing,
unexpected, misshaped and ``meta`` tensors listed together in one ``StateDictError``), block-quantised fp8 pairs
(``X.weight`` + ``X.weight_scale_inv``) are dequantised, full tensors are sliced to the rank
(:func:`~mla_backends.loading.v4.v4_shard_range`), every value is converted before the first is written, and
parameters are copied in place (their storage stays put). Values are exact: a float64 layer holds the
checkpoint's numbers unchanged.
"""

from __future__ import annotations

import torch

from ...loading.fp8 import dequantize_fp8_checkpoint
from ...loading.hf import check_hf_state_dict
from ...loading.v4 import v4_expected_shapes, v4_rank_shapes, v4_shard_range
from ..weights import staged_value

__all__ = ["load_v4_weights", "v4_weight_targets"]


def v4_weight_targets(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{transformers name: parameter}`` of every tensor a checkpoint provides for ``layer``."""
    params = dict(layer.named_parameters())
    return {name: params[name] for name in v4_expected_shapes(layer.dims, layer.layer_idx)}


@torch.no_grad()
def load_v4_weights(layer: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, prefix: str = "",
                    sharded: bool = False) -> None:
    """Load ``state_dict`` (keys under ``prefix``, e.g. ``"model.layers.3.self_attn."``) into ``layer``; all
    or nothing (module docstring). ``sharded=True``: the tensors are already this rank's slices."""
    dims, idx = layer.dims, layer.layer_idx
    state_dict = dequantize_fp8_checkpoint(state_dict, layer.weight_block_size, dtype=layer.dtype)
    shapes = v4_rank_shapes(dims, idx, layer.tp_rank) if sharded else v4_expected_shapes(dims, idx)
    found = check_hf_state_dict(state_dict, shapes, prefix)
    targets = v4_weight_targets(layer)
    staged = {}
    for name, value in found.items():
        rng = None if sharded else v4_shard_range(name, dims, layer.tp_rank)
        part = value if rng is None else value.narrow(rng[0], rng[1], rng[2] - rng[1])
        staged[name] = staged_value(f"{prefix}{name}", part, targets[name])
    for name, value in staged.items():
        targets[name].copy_(value)
