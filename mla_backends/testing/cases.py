"""Conformance case types (:class:`Case`, the probes, :class:`Matrix`) and the declaration helpers; the cases
themselves are generated from a backend's declared
:class:`~mla_backends.backends.capabilities.Capabilities` in :mod:`.matrix`.

A backend is tested on everything it claims and only that. Each declared value of each axis (query dtype,
cache dtype, page size, head count, ``(kv_lora_rank, qk_rope_head_dim)`` pair, query-length support,
dense/sparse) appears in at least one case; the other axes stay at a base combination. When a backend's own
``backend_reasons`` adds rules the fields cannot express (say, fp8 caches only with bf16 queries), the
generator tries the other declared values of the free axes until the combination is accepted; a declared
value that no combination accepts is recorded as *rejected* and reported by the honesty check.

Declarations are judged on a simulated device that fits them (the CPU when ``cpu=True``, otherwise a CUDA
compute capability inside the declared range), so the same cases are generated on every machine; at run time
the suite asks again with the real device and skips with the backend's reasons when it does not fit.

Two matrices: the full one, and ``quick`` (about 15-25 small kernel calls, for interpreted Triton).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from ..backends.contract import AttentionSpec, MLABackend
from ..backends.reasons import Reason, ReasonKind, without_kinds
from ..core.device import CPU_DEVICE, DeviceInfo, simulated_device
from ..core.dtypes import dtype_name

__all__ = [
    "Case",
    "Matrix",
    "UnsupportedProbe",
    "DeclaredProbe",
    "HEAD_COUNTS",
    "ANY_DIMS",
    "declaration_devices",
    "declared_reasons",
    "FP8_SCALES",
]

#: head counts exercised when declared (DeepSeek-V3 per-rank counts 128 and 16, and 1)
HEAD_COUNTS = (16, 1, 128)
#: (kv_lora_rank, qk_rope_head_dim) pairs for backends declaring any dims
ANY_DIMS = ((512, 64), (256, 32))
#: fp8 per-tensor scales used by fp8 cases (deliberately not 1 and not powers of two)
FP8_SCALES = (0.37, 3.1)


@dataclass(frozen=True)
class Case:
    """One batch the backend must run. Lengths are per request, in the caller's order.

    ``seq_lens[b]`` rows are visible to the last new token of request ``b``; its context is
    ``seq_lens[b] - query_lens[b]``. ``topk`` is the width of the top-k index lists (sparse cases only).
    ``device`` is the (simulated) device on which the declaration accepts the case; ``rejected`` holds the
    backend's reasons when no declared combination was accepted; ``draw`` is the seed of a random (property)
    case (``--seeds 1 --seed <draw>`` runs it again).
    """

    name: str
    dtype: torch.dtype
    kv_cache_dtype: str
    block_size: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    topk: int | None = None
    fp8_scale: float = 1.0
    need_lse: bool = True
    decode_threshold: int = 1
    device: DeviceInfo = CPU_DEVICE
    rejected: tuple[str, ...] = field(default=(), compare=False)
    draw: int | None = None

    @property
    def id(self) -> str:
        parts = [
            self.name,
            dtype_name(self.dtype),
            f"kv-{self.kv_cache_dtype}",
            f"page{self.block_size}",
            f"h{self.num_heads}",
            f"r{self.kv_lora_rank}x{self.qk_rope_head_dim}",
        ]
        if self.topk is not None:
            parts.append(f"topk{self.topk}")
        if self.fp8_scale != 1.0:
            parts.append(f"scale{self.fp8_scale}")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    @property
    def context_lens(self) -> tuple[int, ...]:
        return tuple(s - q for s, q in zip(self.seq_lens, self.query_lens, strict=True))

    def spec(self, device: DeviceInfo | None = None) -> AttentionSpec:
        """The :class:`AttentionSpec` this case asks about (on ``device``, default the declared one)."""
        return AttentionSpec(
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            sparse=self.topk is not None,
            max_query_len=max(self.query_lens),
            uniform_query_len=len(set(self.query_lens)) == 1,
            need_lse=self.need_lse,
            device=device or self.device,
        )

    def describe(self) -> str:
        ctx = ", ".join(f"{c}+{q}" for c, q in zip(self.context_lens, self.query_lens, strict=True))
        again = ""
        if self.draw is not None:
            again = f"; drawn from seed {self.draw}: rerun with --seeds 1 --seed {self.draw}"
        return f"case {self.id} (requests context+query: {ctx}{again})"


@dataclass(frozen=True)
class DeclaredProbe:
    """A declared value of one axis and the case that shows it accepted (or the reasons none was)."""

    axis: str
    value: str
    case: Case

    @property
    def id(self) -> str:
        return f"{self.axis}={self.value}"


@dataclass(frozen=True)
class UnsupportedProbe:
    """A combination the declarations exclude; ``not_supported_reasons`` must say why."""

    label: str
    spec: AttentionSpec

    @property
    def id(self) -> str:
        return self.label


@dataclass(frozen=True)
class Matrix:
    """Everything the suite runs for one backend."""

    backend: type[MLABackend]
    quick: bool
    output: tuple[Case, ...]
    guard: tuple[Case, ...]
    determinism: tuple[Case, ...]
    declared: tuple[DeclaredProbe, ...]
    unsupported: tuple[UnsupportedProbe, ...]

    def count_kernel_calls(self) -> int:
        """Kernel calls the matrix makes when every case runs (guard: two checks; determinism: two runs)."""
        return len(self.output) + 2 * len(self.guard) + 2 * len(self.determinism)


# ---- declarations ------------------------------------------------------------------------------------------
def declaration_devices(cls: type[MLABackend]) -> list[DeviceInfo]:
    """Simulated devices inside the declared range: the CPU (when declared) and fitting CUDA capabilities."""
    caps = cls.capabilities
    devices = [CPU_DEVICE] if caps.cpu else []
    if caps.compute_capabilities is not None:
        ccs = sorted(caps.compute_capabilities)
    else:
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        pool = {(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)}
        pool |= {c for c in (lo, hi, caps.fp8_min_compute_capability) if c is not None}
        ccs = sorted(c for c in pool if (lo is None or c >= lo) and (hi is None or c <= hi))
    devices += [simulated_device(*cc) for cc in ccs]
    return devices


def declared_reasons(cls: type[MLABackend], spec: AttentionSpec) -> list[Reason]:
    """``not_supported_reasons`` without the ``PACKAGE`` reasons (declarations, not installs)."""
    return without_kinds(cls.not_supported_reasons(spec), ReasonKind.PACKAGE)
