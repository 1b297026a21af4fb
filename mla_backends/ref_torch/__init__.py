"""Reference PyTorch backend (``REF_TORCH``): the semantics every other backend reproduces, and the CPU path."""

from .backend import RefTorchBackend

__all__ = ["RefTorchBackend"]
