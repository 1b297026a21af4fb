"""Hugging Face DeepSeek-V2/V3 attention weights: expected names and shapes, validation, TP slicing, folds.

State-dict names are those of transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention``:

==========================  ======================================  =====================================
name                        full shape                              tensor-parallel slice (rank's heads)
==========================  ======================================  =====================================
``q_a_proj.weight``         ``[q_lora_rank, hidden]``               replicated
``q_a_layernorm.weight``    ``[q_lora_rank]``                       replicated
``q_b_proj.weight``         ``[heads * (nope + rope), q_lora_rank]`` rows of the rank's heads
``q_proj.weight``           ``[heads * (nope + rope), hidden]``      (instead of the three above when
                                                                    ``q_lora_rank`` is None) rows
``kv_a_proj_with_mqa.weight`` ``[kv_lora_rank + rope, hidden]``     replicated
``kv_a_layernorm.weight``   ``[kv_lora_rank]``                      replicated
``kv_b_proj.weight``        ``[heads * (nope + v), kv_lora_rank]``  rows of the rank's heads
``o_proj.weight``           ``[hidden, heads * v]``                 columns of the rank's heads
==========================  ======================================  =====================================

With ``attention_bias`` the config adds ``q_a_proj.bias``, ``kv_a_proj_with_mqa.bias`` and ``o_proj.bias``
(the ``o_proj`` bias is added by rank 0 only, since the ranks' partial outputs are summed).

``kv_b_proj.weight`` viewed as ``[heads, nope + v, kv_lora_rank]`` holds each head's ``W_UK`` rows then its
``W_UV`` rows; :func:`fold_kv_b` turns them into ``W_UK_T [heads, nope, kv_lora_rank]`` and
``W_UV [heads, kv_lora_rank, v]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.dims import MLADims, hf_config_value
from ..core.dtypes import accumulate_dtype
from ..core.validation import require_int

__all__ = ["expected_hf_shapes", "check_hf_state_dict", "shard_hf_tensor", "hf_shard_range", "rank_hf_shapes",
           "sliced_shapes",
           "fold_kv_b", "hf_attention_bias", "random_hf_state_dict", "randomise_parameters", "StateDictError"]


class StateDictError(ValueError):
    """A state dict that does not match the layer; lists every missing, unexpected and misshaped key."""

    def __init__(self, missing: list[str], unexpected: list[str], misshaped: list[str]) -> None:
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        parts = []
        if missing:
            parts.append(f"missing keys: {missing}")
        if unexpected:
            parts.append(f"unexpected keys: {unexpected}")
        if misshaped:
            parts.append(f"misshaped keys: {misshaped}")
        super().__init__("state_dict: got a dict that does not match the layer (nothing was loaded); "
                         + "; ".join(parts))


def hf_attention_bias(config: Any) -> bool:
    """The ``attention_bias`` flag of a transformers config / dict / config.json path (False when absent)."""
    value = hf_config_value(config, "attention_bias", False)
    if not isinstance(value, bool):  # "false" would be truthy: refuse it rather than guess
        raise TypeError(f"config.attention_bias: got {type(value).__name__} {value!r}; supported true or false")
    return value


def expected_hf_shapes(dims: MLADims, attention_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shapes of every attention tensor a checkpoint must hold for ``dims``.

    ``dims`` may be a per-rank view; the shapes are for all ``dims.total_num_heads`` heads.
    """
    H = dims.total_num_heads
    qk = dims.qk_head_dim
    r, R, P, V, hid = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim, \
        dims.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if dims.q_lora_rank is None:
        shapes["q_proj.weight"] = (H * qk, hid)
    else:
        ql = dims.q_lora_rank
        shapes["q_a_proj.weight"] = (ql, hid)
        shapes["q_a_layernorm.weight"] = (ql,)
        shapes["q_b_proj.weight"] = (H * qk, ql)
        if attention_bias:
            shapes["q_a_proj.bias"] = (ql,)
    shapes["kv_a_proj_with_mqa.weight"] = (r + R, hid)
    shapes["kv_a_layernorm.weight"] = (r,)
    shapes["kv_b_proj.weight"] = (H * (P + V), r)
    shapes["o_proj.weight"] = (hid, H * V)
    if attention_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (r + R,)
        shapes["o_proj.bias"] = (hid,)
    return shapes


def check_hf_state_dict(state_dict: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]],
                        prefix: str = "") -> dict[str, torch.Tensor]:
    """Match ``state_dict`` (keys optionally under ``prefix``) against ``expected``; returns
    ``name -> tensor``.

    Raises :class:`StateDictError` listing every missing, unexpected and misshaped key (also non-tensors and
    non-floating tensors) so that nothing is loaded from a partly matching dict.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: got {type(state_dict).__name__}; supported a mapping of name -> tensor")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: got {type(prefix).__name__}; supported str")
    found: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    for key, value in state_dict.items():
        name = key[len(prefix):] if isinstance(key, str) and key.startswith(prefix) else None
        if name is None or name not in expected:
            unexpected.append(str(key))
            continue
        want = tuple(expected[name])
        if not isinstance(value, torch.Tensor):
            misshaped.append(f"{key} (got {type(value).__name__}; supported a tensor of shape {list(want)})")
        elif tuple(value.shape) != want:
            misshaped.append(f"{key} (got shape {list(value.shape)}; supported {list(want)})")
        elif not value.is_floating_point():
            misshaped.append(f"{key} (got dtype {value.dtype}; supported a floating-point tensor)")
        elif value.is_meta:
            misshaped.append(f"{key} (got a meta tensor, which holds no values; supported a tensor with data)")
        else:
            found[name] = value
    missing = [prefix + n for n in expected if n not in found and prefix + n not in
               {k.split(" ")[0] for k in misshaped}]
    if missing or unexpected or misshaped:
        raise StateDictError(sorted(missing), sorted(unexpected), sorted(misshaped))
    return found


def hf_shard_range(name: str, dims: MLADims, tp_rank: int) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of full tensor ``name`` that rank ``tp_rank`` holds along ``dim``
    (``dims`` is the per-rank view); None when the tensor is replicated (or ``tp_size`` is 1)."""
    if dims.tp_size == 1:
        return None
    H = dims.num_heads
    widths = {"q_proj.weight": (0, dims.qk_head_dim), "q_b_proj.weight": (0, dims.qk_head_dim),
              "kv_b_proj.weight": (0, dims.qk_nope_head_dim + dims.v_head_dim),
              "o_proj.weight": (1, dims.v_head_dim)}
    if name not in widths:
        return None
    dim, per_head = widths[name]
    w = per_head * H
    return dim, tp_rank * w, (tp_rank + 1) * w


def sliced_shapes(shapes: Mapping[str, tuple[int, ...]],
                  shard_range: Any) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each tensor's sliced dimension cut to ``shard_range(name)`` (``(dim, start, stop)``, or
    None for a replicated tensor): the shapes one tensor-parallel rank holds."""
    out = {}
    for name, shape in shapes.items():
        rng = shard_range(name)
        if rng is not None:
            dim, start, stop = rng
            shape = tuple(stop - start if i == dim else n for i, n in enumerate(shape))
        out[name] = shape
    return out


def rank_hf_shapes(dims: MLADims, attention_bias: bool = False, tp_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of rank ``tp_rank``'s slices of :func:`expected_hf_shapes` (replicated tensors unchanged)."""
    return sliced_shapes(expected_hf_shapes(dims, attention_bias), lambda name: hf_shard_range(name, dims, tp_rank))


def shard_hf_tensor(name: str, tensor: torch.Tensor, dims: MLADims, tp_rank: int) -> torch.Tensor:
    """The part of full tensor ``name`` that rank ``tp_rank`` holds (``dims`` is the per-rank view)."""
    rng = hf_shard_range(name, dims, tp_rank)
    if rng is None:
        return tensor
    dim, start, stop = rng
    return tensor.narrow(dim, start, stop - start)


def fold_kv_b(kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
              v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_b_proj.weight [heads * (nope + v), r]`` into views ``W_UK_T [heads, nope, r]`` and
    ``W_UV [heads, r, v]`` (callers copy them into their own contiguous buffers)."""
    r = kv_b.shape[-1]
    per_head = kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, r)
    w_uk_t = per_head[:, :qk_nope_head_dim, :]  # [H, P, r]: q_nope @ W_UK_T gives the absorbed query
    w_uv = per_head[:, qk_nope_head_dim:, :].transpose(1, 2)  # [H, r, V]: latent output @ W_UV gives v
    return w_uk_t, w_uv


def randomise_parameters(module: torch.nn.Module, *, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """``module``'s parameters overwritten in place with random values, the same rule as
    :func:`random_hf_state_dict`: a parameter whose name contains ``norm`` gets 1 + normal(0, 0.1), every
    other one normal(0, ``std``) (drawn in float64 from ``seed``, cast to the parameter's dtype). Returns the
    module in eval mode: a tiny random model for an engine's tests, whose logits are far from uniform when
    ``std`` is large (0.2-0.3), so greedy ties are rare."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: got {type(module).__name__}; supported a torch.nn.Module")
    require_int("seed", seed, minimum=0)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        raise ValueError(f"std: got {std!r}; supported a positive number")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    return module.eval()


def random_hf_state_dict(dims: MLADims, *, attention_bias: bool = False, dtype: torch.dtype = torch.float32,
                         seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A random full-size checkpoint for ``dims`` (normal(0, std) weights, norms near 1): demos, tests."""
    g = torch.Generator().manual_seed(seed)
    gen_dtype = accumulate_dtype(dtype)
    out = {}
    for name, shape in expected_hf_shapes(dims, attention_bias).items():
        t = torch.randn(shape, generator=g, dtype=gen_dtype)
        t = 1.0 + 0.1 * t if name.endswith("layernorm.weight") else t.mul_(std)
        out[name] = t.to(dtype)
    return out
