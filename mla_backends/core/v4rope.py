"""DeepSeek-V4's rotary embedding: interleaved pairs on the *trailing* ``rope_head_dim`` channels of a row,
rotated in place (the layout is kept: V4 rows are keys and values at once, so the output's rotated tail is
rotated back by the query's position before the output projection).

Two schedules per model (:class:`V4Rotary.for_layer`): ``main`` (plain RoPE, ``rope_theta``) for window-only
layers, ``compress`` (``compress_rope_theta``, optionally YaRN with V4's ``attention_factor``, 1 in the
releases) for CSA/HCA layers, their compressors and the indexer. Angles are computed as transformers computes
them (float32 inverse frequencies times float32 positions, float32 ``cos``/``sin``, then the activation dtype),
so a float64 layer agrees with transformers to float32 rounding of the angles and no further.
"""

from __future__ import annotations

import torch

from .rope import rope_inv_freq
from .v4dims import SLIDING, V4Dims

__all__ = ["V4Rotary"]


class V4Rotary:
    """Interleaved RoPE over the last ``dim`` channels of a row.

    Args:
        dim: rotated width (``rope_head_dim``, 64). base: the theta. scaling: YaRN parameters or None.
        attention_factor: magnitude of ``cos``/``sin`` (V4: 1.0, also under YaRN).
    """

    def __init__(self, dim: int, base: float, scaling: object = None, attention_factor: float = 1.0) -> None:
        self.dim = dim
        self.inv_freq, _ = rope_inv_freq(dim, base, scaling)  # type: ignore[arg-type]
        self.attention_factor = float(attention_factor)

    @classmethod
    def for_kind(cls, dims: V4Dims, kind: str) -> V4Rotary:
        """The rotary a ``kind`` layer's attention uses: ``main`` for window-only layers, ``compress`` else."""
        if kind == SLIDING:
            return cls(dims.rope_head_dim, dims.rope_theta)
        return cls.compress(dims)

    @classmethod
    def compress(cls, dims: V4Dims) -> V4Rotary:
        """The ``compress`` rotary (CSA/HCA attention, their compressors, the indexer)."""
        return cls(dims.rope_head_dim, dims.compress_rope_theta, dims.compress_rope, dims.compress_attention_factor)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[n, dim // 2]`` in ``dtype`` for int ``positions [n]`` (float32 angles)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return ((freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """``x [n, ..., width]`` with its last ``dim`` channels rotated by per-row ``cos``/``sin [n, dim // 2]``
        (pairs ``(2i, 2i + 1)``, layout kept); ``inverse`` rotates back (``-sin``). A new tensor."""
        n, half = x.shape[0], self.dim // 2
        shape = (n,) + (1,) * (x.dim() - 2) + (half,)
        c, s = cos.view(shape), sin.view(shape)
        if inverse:
            s = -s
        tail = x[..., -self.dim:]
        a, b = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
        return torch.cat([x[..., :-self.dim], rotated], dim=-1)
