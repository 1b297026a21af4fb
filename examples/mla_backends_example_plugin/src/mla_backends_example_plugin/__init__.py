"""An example mla-backends plugin: one backend, registered through the ``register_mla_backends`` hook.

``EXAMPLE_MLA`` reuses the reference backend's ``forward_mqa`` under its own name and its own (narrower)
declarations, and enters the GPU ladders right before ``REF_TORCH``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mla_backends.backend import Capabilities, QueryLenSupport
from mla_backends.hookspecs import hookimpl
from mla_backends.ref_torch import RefTorchBackend

__all__ = ["ExampleMLABackend", "register_mla_backends"]


class ExampleMLABackend(RefTorchBackend):
    """Reference math under a plugin's name: 16/32-bit caches, pages in multiples of 16, dense only."""

    name: ClassVar[str] = "EXAMPLE_MLA"
    description: ClassVar[str] = "example plugin: reference PyTorch math with its own declarations"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32"}),
        cpu=True,
        min_compute_capability=(8, 0),
        page_size_multiple=16,
        preferred_page_size=32,
        query_len=QueryLenSupport.VARLEN,
        dense=True,
        sparse=False,
        returns_lse=True,
    )


@hookimpl
def register_mla_backends(register):
    """Register EXAMPLE_MLA; on GPUs it is tried right before the reference backend."""
    register(ExampleMLABackend, before="REF_TORCH", archs=("sm80", "sm90", "sm100", "sm110", "sm120"))
