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

The fault table (``docs/conformance.md``; :mod:`.faults` runs it) adds faults small enough to hide in rounding,
each a subclass of REF_TORCH with one change: the softmax scale times 1.005, 1.02 or 1.05
(``ScaleX1005Backend`` ...), the output times 0.98 or 1.05 (``OutputX098Backend``, ``OutputX105Backend``), the
first or the last visible position dropped (``DropsFirstTokenBackend``, ``DropsLastTokenBackend``), one page read
from its neighbour in the table (``NeighbourPageBackend``), ``k_pe`` ignored or negated (``IgnoresKpeBackend``,
``NegatesKpeBackend``), request ``i`` answered with request ``i + 1``'s context when their lengths are equal
(``NextRequestBackend``), the LSE shifted by 0.05 (``ShiftedLseBackend``), every sum kept in bf16
(``Bf16AccumulationBackend``) and slots past a request's length read with a zero weight
(``UnownedReadsBackend``: ``0 x NaN = NaN``, what REF_TORCH did before 0.5).
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
    "ScaleX1005Backend",
    "ScaleX102Backend",
    "ScaleX105Backend",
    "OutputX098Backend",
    "OutputX105Backend",
    "DropsFirstTokenBackend",
    "DropsLastTokenBackend",
    "NeighbourPageBackend",
    "IgnoresKpeBackend",
    "NegatesKpeBackend",
    "NextRequestBackend",
    "ShiftedLseBackend",
    "Bf16AccumulationBackend",
    "UnownedReadsBackend",
    "FAULT_BACKENDS",
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


# ---- the fault table: faults small enough to hide in rounding ------------------------------------------------
class _ScaledSoftmax(RefTorchBackend):
    """The softmax scale times ``factor`` (a constant folded in wrongly)."""

    factor: ClassVar[float] = 1.0

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, scale: float, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale * self.factor, **kw)


def _variant(base: type[RefTorchBackend], cls_name: str, factor: float, doc: str) -> type[RefTorchBackend]:
    """The subclass ``cls_name`` of ``base`` with its own ``factor`` and backend name (the rows are data)."""
    name = "BROKEN_" + cls_name.removesuffix("Backend").upper()
    return type(cls_name, (base,), {"name": name, "factor": factor, "__doc__": doc, "__module__": __name__})


ScaleX1005Backend = _variant(_ScaledSoftmax, "ScaleX1005Backend", 1.005, "The softmax scale 0.5 % too large.")
ScaleX102Backend = _variant(_ScaledSoftmax, "ScaleX102Backend", 1.02, "The softmax scale 2 % too large.")
ScaleX105Backend = _variant(_ScaledSoftmax, "ScaleX105Backend", 1.05, "The softmax scale 5 % too large.")


class _ScaledOutput(RefTorchBackend):
    """The output times ``factor`` (a wrong normalisation)."""

    factor: ClassVar[float] = 1.0

    def forward_mqa_kernel(self, *args, out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(*args, out=out, **kw)
        out.mul_(self.factor)


OutputX098Backend = _variant(_ScaledOutput, "OutputX098Backend", 0.98, "The output 2 % too small.")
OutputX105Backend = _variant(_ScaledOutput, "OutputX105Backend", 1.05, "The output 5 % too large.")


def _visible_lists(meta: BatchMetadata, topk: torch.Tensor | None, drop_first: bool) -> torch.Tensor:
    """``[T, K]`` int32 top-k lists of every token's visible positions without its first (position 0) or its
    last (the newest) one, ``-1`` padded: the dense call (or the given sparse lists) with one position dropped."""
    T = meta.num_tokens
    if topk is not None:
        lists = topk.long().clone()
        pos = meta.token_positions.to(lists.device)
        target = torch.zeros_like(pos) if drop_first else torch.where(lists >= 0, lists, -1).amax(dim=1)
        lists[(lists == target[:, None]) & (lists >= 0)] = -1
        return lists.to(torch.int32)
    positions = [c + j for c, n in zip(meta.context_lens_list, meta.query_lens_list, strict=True) for j in range(n)]
    K = max(positions, default=0) + 1
    lists = torch.full((T, K), -1, dtype=torch.int32)
    for t, p in enumerate(positions):
        seen = torch.arange(1, p + 1) if drop_first else torch.arange(0, p)
        lists[t, : seen.numel()] = seen.to(torch.int32)
    return lists.to(meta.token_positions.device)


class _DropsOnePosition(RefTorchBackend):
    """Attends every token's visible positions but one: the first (``drop_first``) or the newest."""

    drop_first: ClassVar[bool] = True

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta: BatchMetadata, *,  # type: ignore[override]
                           topk_indices: torch.Tensor | None, **kw) -> None:
        kw["state"] = None  # the top-k path: no dense groups of the step
        lists = _visible_lists(meta, topk_indices, self.drop_first)
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, topk_indices=lists, **kw)


class DropsFirstTokenBackend(_DropsOnePosition):
    """Skips position 0 of every sequence (a loop starting at 1)."""

    name: ClassVar[str] = "BROKEN_DROPS_FIRST_TOKEN"
    drop_first: ClassVar[bool] = True


class DropsLastTokenBackend(_DropsOnePosition):
    """Skips the newest visible position of every token (a length off by one)."""

    name: ClassVar[str] = "BROKEN_DROPS_LAST_TOKEN"
    drop_first: ClassVar[bool] = False


class NeighbourPageBackend(RefTorchBackend):
    """Reads the second page of every sequence from the block-table entry after it (``-1`` entries read page 0)."""

    name: ClassVar[str] = "BROKEN_NEIGHBOUR_PAGE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta: BatchMetadata, **kw) -> None:  # type: ignore[override]
        table = meta.block_table.clone()
        if table.shape[1] > 2:
            table[:, 1] = table[:, 2].clamp_min(0)
        kw["state"] = None
        super().forward_mqa_kernel(q_latent, q_rope, cache, dataclasses.replace(meta, block_table=table), **kw)


class IgnoresKpeBackend(RefTorchBackend):
    """Scores without the RoPE half (``q_pe . k_pe`` left out)."""

    name: ClassVar[str] = "BROKEN_IGNORES_KPE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, torch.zeros_like(q_rope), cache, meta, **kw)


class NegatesKpeBackend(RefTorchBackend):
    """The RoPE half of the scores negated (a sign slip in the rotated key)."""

    name: ClassVar[str] = "BROKEN_NEGATES_KPE"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, -q_rope, cache, meta, **kw)  # q_pe . (-k_pe) = (-q_pe) . k_pe


class NextRequestBackend(RefTorchBackend):
    """A batching bug: within each run of consecutive requests of equal length and query length (the ones a
    kernel may batch together), request ``i`` is answered with request ``i + 1``'s pages (the last of the run
    with the first's). Requests of distinct lengths are answered right, so only a batch holding equal lengths
    shows it."""

    name: ClassVar[str] = "BROKEN_NEXT_REQUEST"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta: BatchMetadata, **kw) -> None:  # type: ignore[override]
        keys = list(zip(meta.seq_lens_list, meta.query_lens_list, strict=True))
        source = list(range(len(keys)))
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or keys[i] != keys[start]:
                run = list(range(start, i))
                for a, b in zip(run, run[1:] + run[:1], strict=True):
                    source[a] = b
                start = i
        table = meta.block_table[torch.tensor(source, device=meta.block_table.device)]
        kw["state"] = None
        super().forward_mqa_kernel(q_latent, q_rope, cache, dataclasses.replace(meta, block_table=table), **kw)


class ShiftedLseBackend(RefTorchBackend):
    """Returns the LSE plus 0.05 (a stale constant in the log-sum-exp)."""

    name: ClassVar[str] = "BROKEN_SHIFTED_LSE"

    def forward_mqa_kernel(self, *args, lse_out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        super().forward_mqa_kernel(*args, lse_out=lse_out, **kw)
        lse_out.add_(0.05)


def _attend_pages(q: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [n, H, W]`` over ``rows [S, W]`` with ``hidden [n, S]`` positions weighted exactly 0, every sum and
    product kept in ``dtype``, page by page (16 rows) with an online softmax: ``(out [n, H, W], lse [n, H])``
    (the caller keeps the latent columns of ``out``)."""
    q, rows = q.to(dtype), rows.to(dtype)
    n, H, _ = q.shape
    m = torch.full((n, H, 1), -1e4, dtype=dtype)
    total = torch.zeros(n, H, 1, dtype=dtype)
    acc = None
    for s0 in range(0, rows.shape[0], 16):
        blk = rows[s0: s0 + 16]
        s = torch.einsum("nhw,sw->nhs", q, blk) * scale
        s = s.masked_fill(hidden[:, None, s0: s0 + 16], -1e4)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new).masked_fill(hidden[:, None, s0: s0 + 16], 0.0)
        alpha = torch.exp(m - m_new)
        total = total * alpha + p.sum(-1, keepdim=True)
        part = torch.einsum("nhs,sw->nhw", p, blk)
        acc = part if acc is None else acc * alpha + part
        m = m_new
    assert acc is not None
    return acc / total, (m + torch.log(total)).squeeze(-1)


class _PagewiseBackend(RefTorchBackend):
    """A per-request page walk (the pages of each sequence gathered whole, positions past it hidden) in
    ``compute`` (None: REF_TORCH's accumulation dtype), for faults REF_TORCH's own paths cannot show."""

    compute: ClassVar[torch.dtype | None] = None
    whole_pages: ClassVar[bool] = False

    def forward_mqa_kernel(self, q_latent, q_rope, cache: LatentKVCache, meta: BatchMetadata, *,  # type: ignore[override]
                           scale: float, topk_indices: torch.Tensor | None, out: torch.Tensor,
                           lse_out: torch.Tensor | None, state: object | None) -> None:
        from ..core.dtypes import accumulate_dtype

        if topk_indices is not None:  # sparse calls: REF_TORCH's own path
            super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices,
                                       out=out, lse_out=lse_out, state=None)
            return
        dtype = self.compute or accumulate_dtype(q_latent.dtype)
        r, P = cache.kv_lora_rank, cache.block_size
        q = torch.cat([q_latent, q_rope], -1)
        starts = meta.query_starts_list
        for b, (c, n) in enumerate(zip(meta.context_lens_list, meta.query_lens_list, strict=True)):
            if not n:
                continue
            S = c + n
            length = -(-S // P) * P if self.whole_pages else S  # whole pages: the tail of the last one too
            rows = cache.gather(meta.block_table[b].clamp_min(0), length, dtype)
            hidden = torch.arange(length)[None, :] > (c + torch.arange(n))[:, None]
            o, lse = _attend_pages(q[starts[b]: starts[b + 1]], rows, hidden.to(q.device), scale, dtype)
            out[starts[b]: starts[b + 1]] = o[..., :r].to(out.dtype)
            if lse_out is not None:
                lse_out[starts[b]: starts[b + 1]] = lse.to(lse_out.dtype)


class Bf16AccumulationBackend(_PagewiseBackend):
    """Every product, sum and running softmax statistic kept in bf16 (not float32) across the page walk."""

    name: ClassVar[str] = "BROKEN_BF16_ACCUMULATION"
    compute: ClassVar[torch.dtype | None] = torch.bfloat16


class UnownedReadsBackend(_PagewiseBackend):
    """Reads each sequence's last page whole and gives the positions past the sequence a weight of exactly 0:
    right while those slots hold finite values, NaN as soon as one holds NaN or an infinity (0 x NaN)."""

    name: ClassVar[str] = "BROKEN_UNOWNED_READS"
    whole_pages: ClassVar[bool] = True


#: the fault table's backends, in the table's order
FAULT_BACKENDS = (
    ScaleX1005Backend,
    ScaleX102Backend,
    ScaleX105Backend,
    OutputX098Backend,
    OutputX105Backend,
    DropsFirstTokenBackend,
    DropsLastTokenBackend,
    NeighbourPageBackend,
    IgnoresKpeBackend,
    NegatesKpeBackend,
    NextRequestBackend,
    Base2LseBackend,
    ShiftedLseBackend,
    IgnoresFp8ScaleBackend,
    Bf16AccumulationBackend,
    UnownedReadsBackend,
)
