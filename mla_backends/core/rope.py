"""Rotary position embedding for the decoupled 64-wide RoPE slice of MLA.

Two frequency schedules (plain RoPE and DeepSeek-YaRN) and two input layouts:

- ``interleave=True`` (DeepSeek's checkpoints): the slice holds rotation pairs ``(x0, x1), (x2, x3), ...``;
- ``interleave=False``: the pairs are ``(x_i, x_{i + d/2})`` (the "rotate half" layout).

Either way the result is returned in the *halves* layout ``[a * cos - b * sin, b * cos + a * sin]``, exactly
as transformers' ``DeepseekV3Attention`` does. Query and key slices go through the same function, so their dot
product is the same whichever layout the cache ends up holding.

Angles are computed the way transformers computes them (float32 ``inv_freq`` times float32 positions, float32
``cos``/``sin``, then cast to the activation dtype), so a float64 layer agrees with transformers to float32
rounding of the angles and no further.
"""

from __future__ import annotations

import math

import torch

from .dims import MLADims, RopeScaling, yarn_mscale
from .validation import require_finite, require_int, require_tensor

__all__ = ["RotaryEmbedding", "rope_inv_freq"]


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                           original_max: int) -> tuple[float, float]:
    """Dimension range (in pair units) over which YaRN ramps from extrapolation to interpolation."""

    def corr(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = math.floor(corr(beta_fast)), math.ceil(corr(beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) and the cos/sin magnitude factor for ``scaling``.

    DeepSeek-YaRN blends interpolated (``1 / (factor * base ** (2i / dim))``) and extrapolated frequencies
    with a linear ramp between the ``beta_fast``/``beta_slow`` correction dimensions; the magnitude factor is
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (1.0 for the published checkpoints).
    """
    require_int("qk_rope_head_dim", dim)
    if dim < 2 or dim % 2:
        raise ValueError(f"qk_rope_head_dim: got {dim}; supported an even width >= 2")
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None or scaling.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = scaling.factor
    if scaling.mscale and scaling.mscale_all_dim:
        attention_factor = yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    low, high = _yarn_correction_range(scaling.beta_fast, scaling.beta_slow, dim, base,
                                       scaling.original_max_position_embeddings)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """RoPE over the last ``dim`` channels of a tensor.

    Args:
        dim: rotated width (``qk_rope_head_dim``, 64 for DeepSeek).
        base: ``rope_theta``.
        scaling: None / default, or DeepSeek-YaRN parameters.
        interleave: input pairs are adjacent (True) or half a width apart (False).
    """

    def __init__(self, dim: int, base: float = 10000.0, scaling: RopeScaling | None = None,
                 interleave: bool = True) -> None:
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling: got {type(scaling).__name__}; supported RopeScaling or None")
        if not isinstance(interleave, bool):
            raise TypeError(f"interleave: got {interleave!r}; supported True or False")
        self.dim = dim
        self.base = require_finite("base", base, positive=True)
        self.scaling = scaling
        self.interleave = interleave
        self.inv_freq, self.attention_factor = rope_inv_freq(dim, self.base, scaling)

    @classmethod
    def from_dims(cls, dims: MLADims) -> RotaryEmbedding:
        return cls(dims.qk_rope_head_dim, dims.rope_theta, dims.rope_scaling, dims.rope_interleave)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``[tokens, dim // 2]`` in ``dtype`` for int ``positions [tokens]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return ((freqs.cos() * self.attention_factor).to(dtype),
                (freqs.sin() * self.attention_factor).to(dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [tokens, ..., dim]`` by per-token ``cos``/``sin [tokens, dim // 2]``; halves layout."""
        half = self.dim // 2
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x[..., :half], x[..., half:]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        c, s = cos.view(shape), sin.view(shape)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def __call__(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate every ``x [tokens, ..., dim]`` in ``xs`` at int ``positions [tokens]`` (new tensors)."""
        require_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
        if not xs:
            return ()
        for i, x in enumerate(xs):
            require_tensor(f"x[{i}]", x)
            if x.shape[0] != positions.shape[0] or x.shape[-1] != self.dim:
                raise ValueError(f"x[{i}]: got shape {list(x.shape)}; supported [{positions.shape[0]}, ..., "
                                 f"{self.dim}] (one row per position, rope width last)")
        cos, sin = self.cos_sin(positions, xs[0].dtype)
        return tuple(self.apply(x, cos, sin) for x in xs)
