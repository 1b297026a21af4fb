"""An example mla-backends plugin: one backend, registered through the ``register_mla_backends`` hook.

``EXAMPLE_MLA`` reuses the reference backend's kernel method ``forward_mqa_kernel`` under its own name and its
own (narrower) declarations, and enters the GPU ladders right before ``REF_TORCH``. Like every backend it
leaves ``forward_mqa`` (validation, output buffers, result checks) to :class:`~mla_backends.MLABackend`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mla_backends import BatchMetadata, Capabilities, LatentKVCache, QueryLenSupport, RefTorchBackend, hookimpl

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

    def forward_mqa_kernel(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                           meta: BatchMetadata, *, scale: float, topk_indices: torch.Tensor | None,
                           out: torch.Tensor, lse_out: torch.Tensor | None, state: object | None) -> None:
        """The kernel: write ``out [tokens, heads, kv_lora_rank]`` and ``lse_out [tokens, heads]`` in place
        (here the reference math; a real plugin launches its own kernel). Inputs arrive validated; ``state``
        is what ``prepare(meta)`` returned when the step was planned."""
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices,
                                   out=out, lse_out=lse_out, state=state)


@hookimpl
def register_mla_backends(register):
    """Register EXAMPLE_MLA; on GPUs it is tried right before the reference backend."""
    register(ExampleMLABackend, before="REF_TORCH", archs=("sm80", "sm90", "sm100", "sm110", "sm120"))
