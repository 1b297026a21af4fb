"""The backend contract: declared :class:`Capabilities`, the :class:`AttentionSpec` a selection asks about,
and the :class:`MLABackend` base class whose ``forward_mqa`` every backend implements.

A backend states what it handles as data. :meth:`MLABackend.not_supported_reasons` turns those declarations
into *every* reason a request does not fit, each worded ``"<what>: got X; supported Y"``. A backend with extra
rules overrides it and extends the list returned by ``super()``; it never re-implements the shared checks.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from .device import CPU_DEVICE, DeviceInfo
from .dtypes import FP8_CACHE_DTYPES, KV_CACHE_DTYPES, canonical_kv_cache_dtype, dtype_name, resolve_kv_cache_dtype

if TYPE_CHECKING:
    from .cache import LatentKVCache
    from .metadata import BatchMetadata

__all__ = ["QueryLenSupport", "Capabilities", "AttentionSpec", "MLABackend", "Tolerance"]


class QueryLenSupport(enum.IntEnum):
    """How many query tokens per request ``forward_mqa`` accepts (each level includes the ones before)."""

    SINGLE = 1  # exactly one token per request
    UNIFORM = 2  # several, the same count for every request
    VARLEN = 3  # any count per request


_STORAGE_NAMES = tuple(n for n in KV_CACHE_DTYPES if n != "auto")


def _is_storage_kv_cache_dtype(name: object) -> bool:
    """True for a canonical storage name: what a spec's cache dtype resolves to, so the only names that can
    match (aliases such as ``"bf16"`` and ``"auto"``, which resolves to the model dtype, never do)."""
    try:
        return name != "auto" and canonical_kv_cache_dtype(name) == name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Tolerance:
    """Allowed error against the float64 reference: ``|x - ref| <= atol + rtol * |ref|``."""

    atol: float
    rtol: float


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-9),
    "float32": Tolerance(2e-5, 2e-5),
    "float16": Tolerance(2e-3, 2e-3),
    "bfloat16": Tolerance(1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class Capabilities:
    """Everything a backend declares about what it runs. Frozen: a declaration, not state.

    Compute capabilities: ``compute_capabilities`` (an explicit set) or ``min_compute_capability`` /
    ``max_compute_capability`` (inclusive bounds); ``cpu`` says whether the CPU is fine.
    Page sizes: ``page_sizes`` (explicit values) or ``page_size_multiple`` (any multiple of it); None in both
    means any page size. ``dims`` lists the ``(kv_lora_rank, qk_rope_head_dim)`` pairs (None: any).
    ``num_heads`` lists the exact head counts, or ``max_num_heads`` bounds them (None: any).
    ``fp8_min_compute_capability`` is an extra lower bound that applies only to fp8 caches.
    ``requires`` names importable modules; ``extra`` is the pip extra that provides them.
    """

    dtypes: frozenset[torch.dtype]
    kv_cache_dtypes: frozenset[str]
    cpu: bool = False
    compute_capabilities: frozenset[tuple[int, int]] | None = None
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    fp8_min_compute_capability: tuple[int, int] | None = None
    page_sizes: tuple[int, ...] | None = None
    page_size_multiple: int | None = None
    preferred_page_size: int = 16
    dims: frozenset[tuple[int, int]] | None = None
    num_heads: frozenset[int] | None = None
    max_num_heads: int | None = None
    query_len: QueryLenSupport = QueryLenSupport.VARLEN
    decode_threshold: int = 1
    dense: bool = True
    sparse: bool = False
    returns_lse: bool = True
    deterministic: bool = True
    requires: tuple[str, ...] = ()
    extra: str | None = None
    tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES), hash=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("malformed Capabilities: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Inconsistencies in the declaration itself (used to reject malformed plugin declarations)."""
        out = []
        if not self.dtypes:
            out.append("dtypes: got an empty set; supported at least one torch dtype")
        elif not all(isinstance(d, torch.dtype) for d in self.dtypes):
            out.append(f"dtypes: got {sorted(map(str, self.dtypes))}; supported torch dtypes")
        if not self.kv_cache_dtypes:
            out.append("kv_cache_dtypes: got an empty set; supported at least one cache dtype name")
        for n in sorted(self.kv_cache_dtypes, key=repr):
            if not _is_storage_kv_cache_dtype(n):
                out.append(f"kv_cache_dtypes: got {n!r}; supported canonical names {', '.join(_STORAGE_NAMES)}")
        for cc_name in ("min_compute_capability", "max_compute_capability", "fp8_min_compute_capability"):
            cc = getattr(self, cc_name)
            if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2):
                out.append(f"{cc_name}: got {cc!r}; supported a (major, minor) tuple")
        lo, hi = self.min_compute_capability, self.max_compute_capability
        if lo is not None and hi is not None and isinstance(lo, tuple) and isinstance(hi, tuple) and lo > hi:
            out.append(f"compute capability bounds: got min {lo} > max {hi}; supported min <= max")
        if self.page_sizes is not None and (not self.page_sizes or any(p <= 0 for p in self.page_sizes)):
            out.append(f"page_sizes: got {self.page_sizes}; supported positive ints")
        if self.page_size_multiple is not None and self.page_size_multiple <= 0:
            out.append(f"page_size_multiple: got {self.page_size_multiple}; supported a positive int")
        if not isinstance(self.preferred_page_size, int) or self.preferred_page_size <= 0:
            out.append(f"preferred_page_size: got {self.preferred_page_size!r}; supported a positive int")
        elif self.page_size_reason(self.preferred_page_size) is not None:
            out.append(f"preferred_page_size: got {self.preferred_page_size}; supported one of its own page sizes")
        if not (self.dense or self.sparse):
            out.append("dense/sparse: got neither; supported at least one")
        if self.decode_threshold < 1:
            out.append(f"decode_threshold: got {self.decode_threshold}; supported >= 1")
        if self.query_len == QueryLenSupport.SINGLE and self.decode_threshold != 1:
            out.append(f"decode_threshold: got {self.decode_threshold} with single-token queries; supported 1")
        return out

    # ---- individual checks: each returns None or a reason ---------------------------------------------
    def page_size_reason(self, block_size: int) -> str | None:
        if self.page_sizes is not None and block_size not in self.page_sizes:
            return f"page size: got {block_size}; supported {', '.join(map(str, self.page_sizes))}"
        if self.page_size_multiple is not None and block_size % self.page_size_multiple:
            return f"page size: got {block_size}; supported multiples of {self.page_size_multiple}"
        return None

    def supported_page_sizes_text(self) -> str:
        if self.page_sizes is not None:
            return ", ".join(map(str, self.page_sizes))
        if self.page_size_multiple is not None:
            return f"multiples of {self.page_size_multiple}"
        return "any"

    def compute_capability_text(self) -> str:
        if self.compute_capabilities is not None:
            return ", ".join(f"SM{a}{b}" for a, b in sorted(self.compute_capabilities))
        lo, hi = self.min_compute_capability, self.max_compute_capability
        if lo and hi:
            return f"SM{lo[0]}{lo[1]}..SM{hi[0]}{hi[1]}"
        if lo:
            return f"SM{lo[0]}{lo[1]}+"
        if hi:
            return f"up to SM{hi[0]}{hi[1]}"
        return "any CUDA GPU"


@dataclass(frozen=True)
class AttentionSpec:
    """What a caller asks a backend to run: the question every capability check answers.

    ``block_size`` None means "the backend's preferred page size". ``kv_cache_dtype`` is a canonical cache
    dtype name or ``auto`` (resolved against ``dtype``).
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    sparse: bool = False
    max_query_len: int = 1
    uniform_query_len: bool = True
    need_lse: bool = False
    device: DeviceInfo = CPU_DEVICE

    @property
    def resolved_kv_cache_dtype(self) -> str:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)


class MLABackend:
    """Base class of every MLA decode backend.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`forward_mqa`. They may extend
    :meth:`not_supported_reasons` (call ``super()`` and append).
    """

    name: ClassVar[str] = "ABSTRACT"
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]

    # ---- capability checks -------------------------------------------------------------------------------
    @classmethod
    def missing_requirements(cls) -> list[str]:
        """Modules in ``capabilities.requires`` that cannot be found (``importlib.util.find_spec``; no import)."""
        missing = []
        for mod in cls.capabilities.requires:
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                missing.append(mod)
        return missing

    @classmethod
    def device_reasons(cls, device: DeviceInfo) -> list[str]:
        """Reasons the device does not fit (CPU/CUDA, compute capability range)."""
        caps = cls.capabilities
        if not device.is_cuda:
            return [] if caps.cpu else ["device: got CPU; supported a CUDA device "
                                        f"({caps.compute_capability_text()})"]
        cc = device.compute_capability
        assert cc is not None
        label = f"SM{cc[0]}{cc[1]}"
        if caps.compute_capabilities is not None:
            if cc not in caps.compute_capabilities:
                return [f"compute capability: got {label}; supported {caps.compute_capability_text()}"]
            return []
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        if (lo is not None and cc < lo) or (hi is not None and cc > hi):
            return [f"compute capability: got {label}; supported {caps.compute_capability_text()}"]
        return []

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Every reason ``spec`` does not fit this backend; empty when it fits."""
        caps = cls.capabilities
        reasons: list[str] = []
        missing = cls.missing_requirements()
        if missing:
            extra = f": pip install 'mla-backends[{caps.extra}]'" if caps.extra else ""
            reasons.append(f"package: got {', '.join(missing)} not installed; supported with it installed{extra}")
        reasons += cls.device_reasons(spec.device)
        if spec.dtype not in caps.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in caps.dtypes))
            reasons.append(f"dtype: got {dtype_name(spec.dtype)}; supported {names}")
        try:
            kv = spec.resolved_kv_cache_dtype
        except (ValueError, TypeError) as exc:
            reasons.append(str(exc))
            kv = None
        if kv is not None:
            if kv not in caps.kv_cache_dtypes:
                reasons.append(f"kv cache dtype: got {kv}; supported {', '.join(sorted(caps.kv_cache_dtypes))}")
            elif (kv in FP8_CACHE_DTYPES and caps.fp8_min_compute_capability is not None
                  and spec.device.is_cuda and spec.device.compute_capability < caps.fp8_min_compute_capability):
                a, b = caps.fp8_min_compute_capability
                c0, c1 = spec.device.compute_capability
                reasons.append(f"fp8 cache: got SM{c0}{c1}; supported SM{a}{b}+ (native fp8 conversion)")
        if spec.block_size is not None:
            r = caps.page_size_reason(spec.block_size)
            if r:
                reasons.append(r)
        pair = (spec.kv_lora_rank, spec.qk_rope_head_dim)
        if caps.dims is not None and pair not in caps.dims:
            allowed = ", ".join(f"{a}/{b}" for a, b in sorted(caps.dims))
            reasons.append(f"kv_lora_rank/qk_rope_head_dim: got {pair[0]}/{pair[1]}; supported {allowed}")
        if caps.num_heads is not None and spec.num_heads not in caps.num_heads:
            reasons.append(f"num_heads: got {spec.num_heads}; supported {', '.join(map(str, sorted(caps.num_heads)))}")
        if caps.max_num_heads is not None and spec.num_heads > caps.max_num_heads:
            reasons.append(f"num_heads: got {spec.num_heads}; supported <= {caps.max_num_heads}")
        if spec.max_query_len > 1:
            if caps.query_len == QueryLenSupport.SINGLE:
                reasons.append(f"query length: got {spec.max_query_len}; supported 1 (single-token decode)")
            elif caps.query_len == QueryLenSupport.UNIFORM and not spec.uniform_query_len:
                reasons.append("query length: got varying lengths per request; supported uniform lengths")
        if spec.sparse and not caps.sparse:
            reasons.append("attention: got sparse (top-k indices); supported dense only")
        if not spec.sparse and not caps.dense:
            reasons.append("attention: got dense; supported sparse only (top-k indices)")
        if spec.need_lse and not caps.returns_lse:
            reasons.append("LSE: got a request for it; supported output only (no LSE)")
        return reasons

    @classmethod
    def is_available(cls) -> bool:
        """True when the packages it needs are importable (says nothing about the device)."""
        return not cls.missing_requirements()

    # ---- per-step preparation ------------------------------------------------------------------------------
    def prepare(self, meta: BatchMetadata) -> object | None:
        """Work this backend does once per step, before any layer runs it; returns its per-step state.

        Called through the step plan, never directly: ``meta.prepare(backend)`` (what an engine calls before
        the first layer, outside any CUDA-graph capture) or on the backend's first ``forward_mqa`` of the step.
        It runs once per backend class and step (every layer's instance of a class shares the result), so it
        must depend only on ``meta`` and be free of side effects a second step could trip over. ``forward_mqa``
        reads the state back with ``meta.prepare(self)``. Default: nothing to prepare (None). FlashInfer's
        backends keep their dense block tables and ``plan()`` tokens here.

        Args:
            meta: the step's :class:`~mla_backends.metadata.BatchMetadata` (or a sub-batch of it).
        """
        return None

    # ---- the kernel ------------------------------------------------------------------------------------
    def forward_mqa(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentKVCache,
        meta: BatchMetadata,
        *,
        scale: float,
        topk_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed (MQA-shaped) attention over the paged latent cache.

        Args:
            q_latent: ``[tokens, heads, kv_lora_rank]`` absorbed query (``q_nope @ W_UK_T``), processing order.
            q_rope: ``[tokens, heads, qk_rope_head_dim]`` roped query slice.
            cache: the layer's :class:`LatentKVCache`, already holding this step's new rows.
            meta: :class:`BatchMetadata` whose tokens are exactly the rows of ``q_latent``.
            scale: softmax scale (the unabsorbed ``MLADims.softmax_scale``).
            topk_indices: sparse attention only: ``[tokens, topk]`` positions in each token's sequence,
                ``-1`` for padding.
            out / lse_out: optional preallocated ``[tokens, heads, kv_lora_rank]`` / ``[tokens, heads]`` buffers.

        Returns:
            ``(out [tokens, heads, kv_lora_rank], lse [tokens, heads])``: the output in latent space, in the
            query's dtype, and the natural-log LSE in float32 (None for backends declaring no LSE).
        """
        raise NotImplementedError
