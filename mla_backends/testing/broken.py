"""Deliberately broken backends: the suite's self-test. Each one must be reported by the conformance suite.

Every class wraps :class:`~mla_backends.ref_torch.RefTorchBackend` (its kernel method ``forward_mqa_kernel``;
``forward_mqa`` stays the base class's) and breaks exactly one thing a real kernel can get wrong. None is
registered: pass the class itself (``backend = NextPageBackend``) or its import path
(``mla-backends conformance mla_backends.testing.broken:NextPageBackend``).

==============================  ===============================================  ============================
class                           bug                                              failing test
==============================  ===============================================  ============================
``NextPageBackend``             reads block-table entry ``i + 1`` for page ``i``  output_matches_reference
``LatentScaleBackend``          uses ``kv_lora_rank ** -0.5``, not ``scale``      output_matches_reference
``AbsorbedWidthScaleBackend``   uses ``(kv_lora_rank + rope) ** -0.5``            output_matches_reference
``NoMscaleBackend``             recomputes ``(nope + rope) ** -0.5``, no mscale   output_matches_reference
``Log2eScaleBackend``           multiplies the scale by ``log2(e)``               output_matches_reference
``Base2LseBackend``             returns a base-2 LSE                             output_matches_reference
``IgnoresFp8ScaleBackend``      reads fp8 caches as if the scale were 1          output_matches_reference
``WritesCacheBackend``          overwrites the new tokens' cache rows            inputs_not_written
``WritesPastOutBackend``        stores one row past the end of ``out=``          out_rows_outside_batch_...
``NondeterministicBackend``     perturbs the output by an ulp at random          deterministic
``PaddedHeadsBackend``          hands back ``out`` with one padding head         output_matches_reference
``LyingDeclarationsBackend``    says yes to every request                        undeclared_combinations_...
``HostSyncBackend``             declares ``host_sync_free`` but reads ``.item()``  no_host_sync
==============================  ===============================================  ============================
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import ClassVar

import torch

from ..backends.contract import AttentionSpec
from ..ref_torch import RefTorchBackend
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata

__all__ = [
    "NextPageBackend",
    "LatentScaleBackend",
    "AbsorbedWidthScaleBackend",
    "NoMscaleBackend",
    "Log2eScaleBackend",
    "Base2LseBackend",
    "IgnoresFp8ScaleBackend",
    "WritesCacheBackend",
    "WritesPastOutBackend",
    "NondeterministicBackend",
    "PaddedHeadsBackend",
    "LyingDeclarationsBackend",
    "HostSyncBackend",
    "BROKEN_BACKENDS",
]

class NextPageBackend(RefTorchBackend):
    """Off-by-one in the page walk: page ``i`` of a sequence is read from block-table entry ``i + 1``."""

    name: ClassVar[str] = "BROKEN_NEXT_PAGE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta: BatchMetadata, **kw) -> None:  # type: ignore[override]
        shifted = torch.roll(meta.block_table, shifts=-1, dims=1)
        shifted = torch.where(shifted >= 0, shifted, torch.zeros_like(shifted))  # -1 entries read block 0
        kw["state"] = None  # the step's prepared page ids describe the real table: walk the shifted one afresh
        super().forward_mqa_kernel(q_latent, q_rope, cache, dataclasses.replace(meta, block_table=shifted), **kw)


class LatentScaleBackend(RefTorchBackend):
    """Uses the absorbed width's ``kv_lora_rank ** -0.5`` instead of the unabsorbed scale it is given."""

    name: ClassVar[str] = "BROKEN_LATENT_SCALE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta, *, scale: float,  # type: ignore[override]
                          **kw) -> None:
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=cache.kv_lora_rank**-0.5, **kw)


class AbsorbedWidthScaleBackend(RefTorchBackend):
    """Takes the scale from the absorbed row's width, ``(kv_lora_rank + qk_rope_head_dim) ** -0.5``."""

    name: ClassVar[str] = "BROKEN_ABSORBED_WIDTH_SCALE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta, *, scale: float,  # type: ignore[override]
                          **kw) -> None:
        width = cache.kv_lora_rank + cache.qk_rope_head_dim
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=width**-0.5, **kw)


class NoMscaleBackend(RefTorchBackend):
    """Recomputes ``(qk_nope + qk_rope) ** -0.5`` (nope 128) and so drops DeepSeek-YaRN's ``mscale ** 2``."""

    name: ClassVar[str] = "BROKEN_NO_MSCALE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta, *, scale: float,  # type: ignore[override]
                          **kw) -> None:
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=(128 + cache.qk_rope_head_dim) ** -0.5, **kw)


class Log2eScaleBackend(RefTorchBackend):
    """Folds ``log2(e)`` into the scale for an ``exp2`` softmax, then exponentiates with ``exp``."""

    name: ClassVar[str] = "BROKEN_LOG2E_SCALE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, scale: float, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale * math.log2(math.e), **kw)


class Base2LseBackend(RefTorchBackend):
    """Returns ``log2(sum(exp(s)))`` (FlashInfer's default) instead of the natural-log LSE."""

    name: ClassVar[str] = "BROKEN_BASE2_LSE"

    def forward_mqa_kernel(self, *args, lse_out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(*args, lse_out=lse_out, **kw)
        lse_out.div_(math.log(2.0))


class IgnoresFp8ScaleBackend(RefTorchBackend):
    """Dequantises fp8 caches without multiplying by the per-tensor scale."""

    name: ClassVar[str] = "BROKEN_IGNORES_FP8_SCALE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta, **kw) -> None:  # type: ignore[override]
        if cache.is_fp8:
            unscaled = copy.copy(cache)  # shares the data, not the scale
            unscaled.scale = torch.ones_like(cache.scale)
            cache = unscaled
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)


class WritesCacheBackend(RefTorchBackend):
    """Correct output, but then zeroes the cache rows of the step's new tokens (a stray fused write)."""

    name: ClassVar[str] = "BROKEN_WRITES_CACHE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta: BatchMetadata,  # type: ignore[override]
                          **kw) -> None:
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)
        cache.data.view(-1, cache.row_width)[meta.slot_mapping] = 0


class WritesPastOutBackend(RefTorchBackend):
    """Correct output, plus one extra row stored past the end of ``out`` (grid off by one); visible when the
    caller's ``out`` is a slice of a larger buffer."""

    name: ClassVar[str] = "BROKEN_WRITES_PAST_OUT"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, out: torch.Tensor,  # type: ignore[override]
                          **kw) -> None:
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, out=out, **kw)
        T = out.shape[0]
        end = (out.storage_offset() + (T + 1) * out.stride(0)) * out.element_size()
        if end <= out.untyped_storage().nbytes():
            past = torch.as_strided(out, (T + 1, *out.shape[1:]), out.stride(), out.storage_offset())
            past[T] = out[T - 1]


class NondeterministicBackend(RefTorchBackend):
    """Output perturbed at random by about one unit in the last place (an unordered atomic reduction)."""

    name: ClassVar[str] = "BROKEN_NONDETERMINISTIC"

    def forward_mqa_kernel(self, *args, out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(*args, out=out, **kw)
        eps = torch.finfo(out.dtype).eps
        noise = 1 + 2 * eps * (2 * torch.rand(out.shape, device=out.device) - 1)
        out.copy_((out.double() * noise).to(out.dtype))


class PaddedHeadsBackend(RefTorchBackend):
    """Computes into a buffer padded by one head (as a fixed-head-count kernel does) and hands that back in
    place of ``out`` (``out.set_(padded)``) instead of copying the caller's heads: ``out`` comes back
    ``[T, H + 1, r]``. :meth:`~mla_backends.backends.contract.MLABackend.forward_mqa` must refuse it, naming the
    backend."""

    name: ClassVar[str] = "BROKEN_PADDED_HEADS"

    def forward_mqa_kernel(self, *args, out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        T, H, r = out.shape
        padded = out.new_zeros(T, H + 1, r)
        super().forward_mqa_kernel(*args, out=padded[:, :H], **kw)
        out.set_(padded)


class LyingDeclarationsBackend(RefTorchBackend):
    """Declares bf16/fp16/fp32 queries and page sizes that are multiples of 8, but accepts every request."""

    name: ClassVar[str] = "BROKEN_LYING_DECLARATIONS"
    capabilities = dataclasses.replace(
        RefTorchBackend.capabilities,
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        page_size_multiple=8,
    )

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec) -> list[str]:
        return []


class HostSyncBackend(RefTorchBackend):
    """Declares ``host_sync_free`` (as REF_TORCH does) but reads a device value per call (``.item()``)."""

    name: ClassVar[str] = "BROKEN_HOST_SYNC"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta: BatchMetadata, **kw) -> None:  # type: ignore[override]
        if meta.seq_lens.max().item() < 0:  # never true: the read itself is the bug
            raise AssertionError("unreachable")
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)


BROKEN_BACKENDS = (
    NextPageBackend,
    LatentScaleBackend,
    AbsorbedWidthScaleBackend,
    NoMscaleBackend,
    Log2eScaleBackend,
    Base2LseBackend,
    IgnoresFp8ScaleBackend,
    WritesCacheBackend,
    WritesPastOutBackend,
    NondeterministicBackend,
    PaddedHeadsBackend,
    LyingDeclarationsBackend,
    HostSyncBackend,
)
