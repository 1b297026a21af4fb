"""``torchvision.transforms`` of the stand-in: ``InterpolationMode`` only (SGLang reads its members at import)."""

from __future__ import annotations

from enum import Enum

__all__ = ["InterpolationMode"]


class InterpolationMode(Enum):
    """The members SGLang and transformers name; nothing interpolates with them here."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
