"""Block-quantised fp8 checkpoints, as DeepSeek releases V3, R1 and V3.2.

Such a checkpoint stores a quantised linear layer ``X`` as two tensors:

- ``X.weight``: ``float8_e4m3fn`` ``[out, in]``;
- ``X.weight_scale_inv``: float ``[ceil(out / bo), ceil(in / bi)]``, one scale per ``bo x bi`` block (the
  ``quantization_config.weight_block_size`` of ``config.json``, ``[128, 128]`` in every DeepSeek release).

The real weight is ``X.weight * X.weight_scale_inv`` with each scale spread over its block (the last row and
column of blocks may be partial). Norms stay in bf16 and carry no scale. :func:`dequantize_fp8_checkpoint`
turns such a state dict into plain floating-point weights before the layer checks and loads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.dims import hf_config_value
from ..core.dtypes import accumulate_dtype
from .hf import StateDictError

__all__ = ["DEFAULT_WEIGHT_BLOCK_SIZE", "SCALE_SUFFIX", "check_weight_block_size", "weight_block_size_from_config",
           "dequantize_block_fp8", "dequantize_fp8_checkpoint"]

#: ``quantization_config.weight_block_size`` of DeepSeek's fp8 releases: one scale per 128 x 128 block
DEFAULT_WEIGHT_BLOCK_SIZE: tuple[int, int] = (128, 128)
#: suffix of a block-scale tensor; it replaces the ``weight`` of the tensor it scales
SCALE_SUFFIX = "weight_scale_inv"

_FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz") if hasattr(torch, n))


def check_weight_block_size(block_size: Any) -> tuple[int, int]:
    """``block_size`` as ``(rows, columns)``; ValueError unless it is two positive ints."""
    ok = (isinstance(block_size, Sequence) and not isinstance(block_size, str) and len(block_size) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_size))
    if not ok:
        raise ValueError(f"weight_block_size: got {block_size!r}; supported two positive ints [rows, columns], "
                         f"e.g. {list(DEFAULT_WEIGHT_BLOCK_SIZE)}")
    return int(block_size[0]), int(block_size[1])


def weight_block_size_from_config(config: Any) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of a transformers config, dict or ``config.json`` path;
    :data:`DEFAULT_WEIGHT_BLOCK_SIZE` when the config has none (an :class:`MLADims` has none)."""
    quant = hf_config_value(config, "quantization_config")
    if quant is None:
        return DEFAULT_WEIGHT_BLOCK_SIZE
    block = quant.get("weight_block_size") if isinstance(quant, Mapping) else \
        getattr(quant, "weight_block_size", None)
    if block is None:
        return DEFAULT_WEIGHT_BLOCK_SIZE
    return check_weight_block_size(tuple(block) if isinstance(block, (list, tuple)) else block)


def _check_out_dtype(dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in _FP8_DTYPES:
        raise TypeError(f"dtype: got {dtype!r}; supported a floating-point torch.dtype other than float8, "
                        "e.g. torch.bfloat16")


def _scale_shape(weight_shape: Sequence[int], block_size: tuple[int, int]) -> tuple[int, int]:
    return -(-weight_shape[0] // block_size[0]), -(-weight_shape[1] // block_size[1])


def _scale_problem(scale_inv: Any, weight_shape: Sequence[int], block_size: tuple[int, int]) -> str:
    """Why ``scale_inv`` cannot scale a weight of ``weight_shape`` in ``block_size`` blocks ("" when it can)."""
    want = _scale_shape(weight_shape, block_size)
    if isinstance(scale_inv, torch.Tensor) and scale_inv.is_floating_point() and tuple(scale_inv.shape) == want:
        return ""
    got = f"{scale_inv.dtype} tensor of shape {list(scale_inv.shape)}" if isinstance(scale_inv, torch.Tensor) \
        else type(scale_inv).__name__
    return (f"got {got}; supported a floating-point tensor of shape {list(want)} "
            f"(weight {list(weight_shape)} in {block_size[0]} x {block_size[1]} blocks)")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: Sequence[int] = DEFAULT_WEIGHT_BLOCK_SIZE,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [out, in]`` (fp8) times ``scale_inv [ceil(out / bo), ceil(in / bi)]`` spread over its blocks.

    The product is formed in float32 (float64 when ``dtype`` is float64) and returned as ``dtype``.
    """
    bo, bi = check_weight_block_size(block_size)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FP8_DTYPES or weight.dim() != 2:
        got = f"{weight.dtype} tensor of shape {list(weight.shape)}" if isinstance(weight, torch.Tensor) \
            else type(weight).__name__
        raise TypeError(f"weight: got {got}; supported a 2-D float8 tensor")
    problem = _scale_problem(scale_inv, weight.shape, (bo, bi))
    if problem:
        raise ValueError(f"scale_inv: {problem}")
    _check_out_dtype(dtype)
    cdt = accumulate_dtype(dtype)
    rows, cols = weight.shape
    nbr, nbc = _scale_shape(weight.shape, (bo, bi))
    w = weight.to(cdt)
    if nbr * bo != rows or nbc * bi != cols:  # partial last blocks: pad, scale whole blocks, crop
        w = torch.nn.functional.pad(w, (0, nbc * bi - cols, 0, nbr * bo - rows))
    # each scale broadcast over its block in place: no weight-sized scale matrix
    w.view(nbr, bo, nbc, bi).mul_(scale_inv.to(device=weight.device, dtype=cdt)[:, None, :, None])
    return w[:rows, :cols].to(dtype).contiguous()


def dequantize_fp8_checkpoint(state_dict: Mapping[str, Any], block_size: Sequence[int] = DEFAULT_WEIGHT_BLOCK_SIZE,
                              dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A copy of ``state_dict`` where every ``X.weight`` / ``X.weight_scale_inv`` pair is one dequantised
    ``X.weight`` (``dtype``); other entries are passed through untouched.

    Raises :class:`~mla_backends.loading.hf.StateDictError` listing every scale without its weight
    (unexpected), every float8 weight without its scale and every scale of the wrong shape or dtype
    (misshaped), before anything is converted.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: got {type(state_dict).__name__}; supported a mapping of name -> tensor")
    block = check_weight_block_size(block_size)
    _check_out_dtype(dtype)
    unexpected: list[str] = []
    misshaped: list[str] = []
    pairs: dict[str, str] = {}  # weight key -> scale key
    for key, value in state_dict.items():
        if not isinstance(key, str):
            continue
        if key.endswith(SCALE_SUFFIX):
            wkey = key[: -len(SCALE_SUFFIX)] + "weight"
            weight = state_dict.get(wkey)
            if not isinstance(weight, torch.Tensor):
                unexpected.append(f"{key} (no {wkey} to scale)")
            elif weight.dtype not in _FP8_DTYPES or weight.dim() != 2:
                misshaped.append(f"{wkey} (got {weight.dtype} of shape {list(weight.shape)} with a {SCALE_SUFFIX}; "
                                 "supported a 2-D float8 tensor)")
            elif problem := _scale_problem(value, weight.shape, block):
                misshaped.append(f"{key} ({problem})")
            else:
                pairs[wkey] = key
        elif isinstance(value, torch.Tensor) and value.dtype in _FP8_DTYPES:
            scale_key = key[: -len("weight")] + SCALE_SUFFIX if key.endswith("weight") else None
            if scale_key is None or scale_key not in state_dict:
                misshaped.append(f"{key} (got {value.dtype} without {scale_key or 'a block scale'}; supported "
                                 f"floating-point weights, or float8 weights with their {SCALE_SUFFIX})")
    if unexpected or misshaped:
        raise StateDictError([], sorted(unexpected), sorted(misshaped))
    scales = set(pairs.values())
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key in scales:
            continue
        out[key] = dequantize_block_fp8(value, state_dict[pairs[key]], block, dtype) if key in pairs else value
    return out
