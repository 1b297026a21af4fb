"""The attention layer's weights: creating the parameters with this rank's shapes, and loading transformers-named
checkpoints into them (fp8 dequantisation, V3.2 indexer weights, the TP slice, the ``kv_b_proj`` folds).

Parameters carry transformers' names (``q_a_proj.weight``, ``kv_b_proj.weight``, ...), so a state dict of a
``DeepseekV3Attention`` maps onto them key for key. The folds ``W_UK_T [H, N, R]`` and ``W_UV [H, R, V]`` are
buffers derived from ``kv_b_proj`` on every load.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..core.dims import MLADims
from ..loading.fp8 import dequantize_fp8_checkpoint
from ..loading.hf import (
    StateDictError,
    check_hf_state_dict,
    expected_hf_shapes,
    fold_kv_b,
    rank_hf_shapes,
    shard_hf_tensor,
)
from .sparse.layer_support import take_indexer_weights

__all__ = ["add_attention_weights", "weight_targets", "load_hf_weights", "staged_value"]


def add_attention_weights(module: torch.nn.Module, dims: MLADims, attention_bias: bool, *,
                          dtype: torch.dtype, device: torch.device) -> None:
    """Give ``module`` zeroed, frozen parameters with this rank's shapes (``dims`` is per rank) and the two
    fold buffers. ``q_proj`` when ``q_lora_rank`` is None, else ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``;
    biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` only with ``attention_bias``."""
    H, N, P, V, R = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, \
        dims.kv_lora_rank
    hid = dims.hidden_size
    kw = {"dtype": dtype, "device": device}

    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.zeros(*shape, **kw), requires_grad=False)

    def holder(name: str, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None = None,
               with_bias: bool = False) -> None:
        sub = torch.nn.Module()
        sub.weight = weight
        if with_bias:
            sub.bias = bias
        setattr(module, name, sub)

    if dims.q_lora_rank is None:
        holder("q_proj", param(H * (N + P), hid))
    else:
        holder("q_a_proj", param(dims.q_lora_rank, hid),
               param(dims.q_lora_rank) if attention_bias else None, with_bias=True)
        holder("q_a_layernorm", param(dims.q_lora_rank))
        holder("q_b_proj", param(H * (N + P), dims.q_lora_rank))
    holder("kv_a_proj_with_mqa", param(R + P, hid), param(R + P) if attention_bias else None, with_bias=True)
    holder("kv_a_layernorm", param(R))
    holder("kv_b_proj", param(H * (N + V), R))
    holder("o_proj", param(hid, H * V), param(hid) if attention_bias else None, with_bias=True)
    module.register_buffer("W_UK_T", torch.zeros(H, N, R, **kw), persistent=False)
    module.register_buffer("W_UV", torch.zeros(H, R, V, **kw), persistent=False)


def weight_targets(module: torch.nn.Module, dims: MLADims, attention_bias: bool) -> dict[str, torch.Tensor]:
    """``{transformers name: the parameter tensor}`` of every weight a checkpoint provides."""
    out = {}
    for name in expected_hf_shapes(dims, attention_bias):
        mod, attr = name.rsplit(".", 1)
        out[name] = getattr(getattr(module, mod), attr)
    return out


def staged_value(key: str, part: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``part`` converted to ``target``'s device and dtype, before anything is written; a value that cannot be
    is a :class:`~mla_backends.loading.hf.StateDictError` naming ``key``."""
    try:
        return part.to(device=target.device, dtype=target.dtype)
    except (RuntimeError, TypeError) as exc:
        raise StateDictError([], [], [f"{key} (got {part.dtype} on {part.device}, which cannot be converted to "
                                      f"{target.dtype} on {target.device}: {type(exc).__name__}: {exc})"]) from None


@torch.no_grad()
def load_hf_weights(layer: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, prefix: str = "",
                    sharded: bool = False) -> None:
    """Load transformers-named attention weights into ``layer`` (full, unsharded tensors; this rank's slice is
    taken; with ``sharded=True`` they are already this rank's slices, see ``loading.hf.rank_hf_shapes``).

    All or nothing: every key is checked before anything is written (missing, unexpected, misshaped and ``meta``
    tensors raise a :class:`~mla_backends.loading.hf.StateDictError` listing all of them), then every value is
    sliced and converted to its parameter's dtype and device, and ``kv_b_proj`` is folded into ``W_UK_T`` /
    ``W_UV`` from the new value; only when all of that succeeded are the parameters, the folds and the indexer
    written, so a failure leaves the layer as it was. Tensors are copied in place, so their storage (and
    pointers) stay put. ``prefix`` (e.g. ``"model.layers.3.self_attn."``) selects this layer's keys, so a whole
    checkpoint's dict can be given: keys outside the prefix (other layers, embeddings) are not this layer's and
    are passed over; a key under the prefix that the layer does not take is unexpected, and every key the layer
    needs must be there under the prefix. Without a prefix every key must be the layer's. Block-quantised fp8
    checkpoints (DeepSeek's releases: float8 ``X.weight`` plus ``X.weight_scale_inv``) are dequantised first
    (this layer's keys only), block by ``layer.weight_block_size`` (see :mod:`mla_backends.loading.fp8`).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: got {type(prefix).__name__}; supported str (e.g. 'model.layers.3.self_attn.')")
    if prefix and isinstance(state_dict, Mapping):  # a whole checkpoint: only this layer's keys are read
        state_dict = {k: v for k, v in state_dict.items() if isinstance(k, str) and k.startswith(prefix)}
    dims, bias = layer.dims, layer.attention_bias
    state_dict = dequantize_fp8_checkpoint(state_dict, layer.weight_block_size, dtype=layer.dtype)
    state_dict, load_indexer = take_indexer_weights(layer.indexer, state_dict, prefix)  # V3.2 indexer.*
    shapes = rank_hf_shapes(dims, bias, layer.tp_rank) if sharded else expected_hf_shapes(dims, bias)
    found = check_hf_state_dict(state_dict, shapes, prefix)
    targets = weight_targets(layer, dims, bias)
    staged = {}  # everything converted first: a value that fails here leaves the layer untouched
    for name, value in found.items():
        part = value if sharded else shard_hf_tensor(name, value, dims, layer.tp_rank)
        staged[name] = staged_value(f"{prefix}{name}", part, targets[name])
    w_uk_t, w_uv = fold_kv_b(staged["kv_b_proj.weight"], dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim)
    for name, value in staged.items():
        targets[name].copy_(value)
    layer.W_UK_T.copy_(w_uk_t)
    layer.W_UV.copy_(w_uv)
    load_indexer()
