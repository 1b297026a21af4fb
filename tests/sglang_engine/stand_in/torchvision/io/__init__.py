"""``torchvision.io`` of the stand-in: the names SGLang imports, none usable."""

from __future__ import annotations

from enum import Enum

from .. import absent

__all__ = ["ImageReadMode", "decode_image"]


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_image = absent("io.decode_image")
