"""What a backend declares and what a caller asks: :class:`Capabilities`, :class:`AttentionSpec`,
:class:`QueryLenSupport` and :class:`Tolerance` (pure data; :mod:`mla_backends.backend` re-exports them).

The checks that compare the two live in :meth:`mla_backends.backend.MLABackend.not_supported_reasons`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import torch

from .device import CPU_DEVICE, DeviceInfo
from .dtypes import KV_CACHE_DTYPES, canonical_kv_cache_dtype, resolve_kv_cache_dtype
from .reasons import Reason, ReasonKind

__all__ = ["QueryLenSupport", "Capabilities", "AttentionSpec", "Tolerance", "DEFAULT_TOLERANCES",
           "env_switch_on"]


def env_switch_on(name: str) -> bool:
    """True when the environment variable ``name`` is set to anything but ``""`` or ``"0"``."""
    return os.environ.get(name, "0") not in ("", "0")


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
    ``max_compute_capability`` (inclusive bounds); ``cpu`` says whether the CPU is fine. ``cpu_env_switch``
    names an environment variable that, set to anything but ``""``/``"0"``, makes the CPU fine after all
    (Triton's interpreter, for testing); ``cpu_hint`` is appended to the CPU reason otherwise.
    Page sizes: ``page_sizes`` (explicit values) or ``page_size_multiple`` (any multiple of it); None in both
    means any page size. ``dims`` lists the ``(kv_lora_rank, qk_rope_head_dim)`` pairs (None: any).
    ``num_heads`` lists the exact head counts, or ``max_num_heads`` bounds them (None: any).
    ``fp8_min_compute_capability`` is an extra lower bound that applies only to fp8 caches.
    ``requires`` names importable modules; ``extra`` is the pip extra that provides them.
    ``host_sync_free``: once ``BatchMetadata.build`` ran (and ``meta.prepare(backend)``), a dense
    ``forward_mqa`` makes no device-to-host sync (the conformance suite runs it under
    :func:`mla_backends.host_sync.no_host_sync`). ``cuda_graphs``: it also replays correctly under a captured
    CUDA graph with static shapes whose metadata tensors are updated in place (it reads lengths and block
    ids from device tensors, never from the host lists); implies ``host_sync_free``.
    """

    dtypes: frozenset[torch.dtype]
    kv_cache_dtypes: frozenset[str]
    cpu: bool = False
    cpu_env_switch: str | None = None
    cpu_hint: str | None = None
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
    host_sync_free: bool = False
    cuda_graphs: bool = False
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
        if self.cuda_graphs and not self.host_sync_free:
            out.append("cuda_graphs: got True with host_sync_free False; supported a sync-free backend "
                       "(a captured graph cannot sync)")
        if self.query_len == QueryLenSupport.SINGLE and self.decode_threshold != 1:
            out.append(f"decode_threshold: got {self.decode_threshold} with single-token queries; supported 1")
        return out

    # ---- individual checks: each returns None or a reason ---------------------------------------------
    def page_size_reason(self, block_size: int) -> Reason | None:
        """None when ``block_size`` is a declared page size, else the ``PAGE_SIZE`` reason."""
        if self.page_sizes is not None and block_size not in self.page_sizes:
            return Reason(ReasonKind.PAGE_SIZE, "page size", str(block_size), ", ".join(map(str, self.page_sizes)))
        if self.page_size_multiple is not None and block_size % self.page_size_multiple:
            return Reason(ReasonKind.PAGE_SIZE, "page size", str(block_size),
                          f"multiples of {self.page_size_multiple}")
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
