"""``torchvision.transforms.v2`` of the stand-in: only its ``functional`` submodule is imported (by name)."""

from . import functional

__all__ = ["functional"]
