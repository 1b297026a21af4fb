"""``torchvision.transforms.functional`` of the stand-in: the names SGLang imports, none usable."""

from .. import absent
from . import InterpolationMode

__all__ = ["InterpolationMode", "pil_to_tensor"]

pil_to_tensor = absent("transforms.functional.pil_to_tensor")
