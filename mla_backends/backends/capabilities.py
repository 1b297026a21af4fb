"""What a backend declares and what a caller asks: :class:`Capabilities`, :class:`AttentionSpec`,
:class:`QueryLenSupport`, :class:`Tolerance` and :class:`Precision` (pure data; :mod:`mla_backends.backends.contract`
re-exports them).

The checks that compare the two live in :meth:`mla_backends.backends.contract.MLABackend.not_supported_reasons`.
"""

from __future__ import annotations

import contextvars
import enum
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

from ..core.device import CPU_DEVICE, DeviceInfo
from ..core.dtypes import KV_CACHE_DTYPES, RECORD_CACHE_DTYPES, canonical_kv_cache_dtype, resolve_kv_cache_dtype
from ..core.env_switches import parse_switch
from .reasons import Reason, ReasonKind

__all__ = ["QueryLenSupport", "Capabilities", "AttentionSpec", "Tolerance", "DEFAULT_TOLERANCES", "Precision",
           "env_switch_on", "environment_snapshot", "field_type_problems"]


_ENV_SNAPSHOT: contextvars.ContextVar[Mapping[str, str | None] | None] = contextvars.ContextVar(
    "mla_backends_env_snapshot", default=None)


@contextmanager
def environment_snapshot(values: Mapping[str, str | None]) -> Iterator[None]:
    """Within the block, :func:`env_switch_on` answers from ``values`` (variable -> value, None: unset) for the
    variables it holds, instead of reading ``os.environ`` again: a selection reads the environment once, so a
    variable changed by another thread meanwhile cannot make the result disagree with its cache key."""
    token = _ENV_SNAPSHOT.set(dict(values))
    try:
        yield
    finally:
        _ENV_SNAPSHOT.reset(token)


def env_switch_on(name: str) -> bool:
    """The on/off switch ``name`` parsed by :func:`mla_backends.core.env_switches.parse_switch` (``1``/``true``/
    ``yes``/``on`` on; ``0``/``false``/``no``/``off``/empty/unset off; anything else raises
    :class:`~mla_backends.core.env_switches.EnvSwitchError`), read from the active :func:`environment_snapshot`
    when it holds ``name``."""
    snapshot = _ENV_SNAPSHOT.get()
    value = snapshot[name] if snapshot is not None and name in snapshot else os.environ.get(name)
    return parse_switch(name, value)


class QueryLenSupport(enum.IntEnum):
    """How many query tokens per request ``forward_mqa`` accepts (each level includes the ones before)."""

    SINGLE = 1  # exactly one token per request
    UNIFORM = 2  # several, the same count for every request
    VARLEN = 3  # any count per request


_STORAGE_NAMES = tuple(n for n in KV_CACHE_DTYPES if n != "auto") + tuple(sorted(RECORD_CACHE_DTYPES))


def _is_storage_kv_cache_dtype(name: object) -> bool:
    """True for a canonical storage name: what a spec's cache dtype resolves to, so the only names that can
    match (aliases such as ``"bf16"`` and ``"auto"``, which resolves to the model dtype, never do)."""
    try:
        return name != "auto" and canonical_kv_cache_dtype(name) == name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Tolerance:
    """An explicit error band a backend declares against the float64 reference: ``|x - ref| <= atol + rtol *
    |ref|`` element-wise (the LSE within the same band, but never tighter than float32's). The conformance suite
    judges a case by a declared band *instead of* its measured-rounding criteria (``docs/conformance.md``):
    declare one only for arithmetic the suite cannot emulate (fp8 query products, TF32 dots).

    Both bounds are finite and non-negative, checked on construction (so ``dataclasses.replace`` checks them
    too): a negative bound would fail every case, an infinite or NaN one would pass every case."""

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: got {type(value).__name__} {value!r}; supported a float")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: got {value!r}; supported a finite float >= 0")


#: the element-wise bands of mla-backends 0.4, per judged dtype (16-bit dtypes 8 epsilons). The suite no longer
#: judges by them (it measures each case's honest rounding, ``docs/conformance.md``); a ``tolerances`` entry
#: equal to the entry of the same key here declares nothing, so declarations written as
#: ``{**DEFAULT_TOLERANCES, "bfloat16/fp8_e4m3": Tolerance(...)}`` declare only the band they change
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-9),
    "float32": Tolerance(2e-5, 2e-5),
    "float16": Tolerance(8 * 2.0**-10, 8 * 2.0**-10),  # 7.8e-3
    "bfloat16": Tolerance(8 * 2.0**-7, 8 * 2.0**-7),  # 6.25e-2
}

#: the dtypes a :class:`Precision` may name
_PRECISION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: how a backend may round its output to the query dtype (:class:`Precision`)
ROUNDINGS = ("nearest", "toward_zero")


@dataclass(frozen=True)
class Precision:
    """Where a backend accumulates, how it stores its LSE and how it rounds its output, when that is below what
    the suite assumes.

    The suite assumes a correct kernel sums score products, the softmax and the value product in float32
    (float64 for float64 queries), returns a float32 LSE (:func:`~mla_backends.core.dtypes.lse_dtype`) and rounds
    its output to the nearest value of the query dtype. A kernel that accumulates in 16 bits
    (``accumulate=torch.float16``), stores its LSE in 16 bits (``lse=torch.float16``) or converts its output by
    truncation (``rounding="toward_zero"``: a bias of about -0.27 % in bf16 that the suite's bias criterion
    catches otherwise) declares it in ``Capabilities.precision``, and the suite judges it against a reference
    computed that way (:mod:`mla_backends.testing.rounding`), by the same multiples.
    """

    accumulate: torch.dtype = torch.float32
    lse: torch.dtype = torch.float32
    rounding: str = "nearest"

    def problems(self) -> list[str]:
        """``"<field>: got X; supported Y"`` for a dtype that is not float16, bfloat16, float32 or float64, or a
        rounding that is not one of :data:`ROUNDINGS`."""
        names = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"
        out = [f"Precision.{name}: got {getattr(self, name)!r}; supported {names}"
               for name in ("accumulate", "lse") if getattr(self, name) not in _PRECISION_DTYPES]
        if self.rounding not in ROUNDINGS:
            out.append(f"Precision.rounding: got {self.rounding!r}; supported {', '.join(map(repr, ROUNDINGS))}")
        return out


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
    ``sinks`` / ``window`` / ``compressed``: DeepSeek-V4 attention (:mod:`mla_backends.backends.v4_inputs`): a
    per-head sink logit in the softmax denominator, a sliding window over the cache's positions, and a second
    key set (compressed entries in a cache of their own, chosen per token).
    ``host_sync_free``: once ``BatchMetadata.build`` ran (and ``plan_step(meta, ...)``), a dense
    ``forward_mqa`` makes no device-to-host sync (the conformance suite runs it under
    :func:`mla_backends.core.host_sync.no_host_sync`). ``cuda_graphs``: it also replays correctly under a captured
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
    sinks: bool = False
    window: bool = False
    compressed: bool = False
    returns_lse: bool = True
    deterministic: bool = True
    requires: tuple[str, ...] = ()
    extra: str | None = None
    host_sync_free: bool = False
    cuda_graphs: bool = False
    tolerances: dict[str, Tolerance] = field(default_factory=dict, hash=False)
    precision: dict[str, Precision] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:  # a field of the wrong type (cpu="no") is a TypeError, an inconsistent value a ValueError
            kind = TypeError if field_type_problems(self) else ValueError
            raise kind("malformed Capabilities: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Problems of the declaration itself: every field's type first (:func:`field_type_problems`), then,
        when the types are right, the inconsistencies between fields (used to reject malformed plugin
        declarations before anything reads them)."""
        out = field_type_problems(self)
        if out:
            return out
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
        out += [p for v in self.precision.values() for p in v.problems()]
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
        if self.compute_capabilities is not None and not self.compute_capabilities:
            return "none (a CPU-only backend)"
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
    dtype name or ``auto`` (resolved against ``dtype``). ``sinks`` / ``window`` / ``compressed``: the caller
    needs DeepSeek-V4's per-head sinks, a sliding window, a second (compressed) key set.
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
    sinks: bool = False
    window: bool = False
    compressed: bool = False

    def __post_init__(self) -> None:
        """Every field's type and range, on construction and on ``dataclasses.replace``. A cache dtype *name*
        that is no cache dtype is not refused here: it is a reason of the selection
        (:meth:`~mla_backends.backends.contract.MLABackend.not_supported_reasons`), as a dtype a backend does
        not take is."""
        for name, minimum in (("num_heads", 0), ("kv_lora_rank", 0), ("qk_rope_head_dim", 0), ("max_query_len", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: got {type(value).__name__} {value!r}; supported int")
            if value < minimum:
                raise ValueError(f"{name}: got {value}; supported >= {minimum}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size < 1):
            raise ValueError(f"block_size: got {self.block_size!r}; supported an int >= 1 or None (the backend's "
                             "preferred page size)")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype: got {type(self.dtype).__name__}; supported a torch dtype")
        if not isinstance(self.kv_cache_dtype, str) or not self.kv_cache_dtype.strip():
            raise TypeError(f"kv_cache_dtype: got {self.kv_cache_dtype!r}; supported a cache dtype name "
                            f"({', '.join(KV_CACHE_DTYPES)})")
        for name in ("sparse", "uniform_query_len", "need_lse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: got {getattr(self, name)!r}; supported True or False")
        if not isinstance(self.device, DeviceInfo):
            raise TypeError(f"device: got {type(self.device).__name__}; supported DeviceInfo")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)


# ---- field types: checked before anything (the selector, `mla-backends list`) reads a declaration ----------
def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_cc(x: object) -> bool:
    """A pair of non-negative ints: a ``(major, minor)`` compute capability or a ``(rank, rope)`` dims pair."""
    return isinstance(x, tuple) and len(x) == 2 and all(_is_int(v) and v >= 0 for v in x)


def _collection_problem(name: str, value: object, item_ok: object, item_text: str, *,
                        optional: bool = True, kinds: tuple[type, ...] = (frozenset, set)) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, kinds) or not all(item_ok(v) for v in value):  # type: ignore[operator, union-attr]
        kind = " or ".join(k.__name__ for k in kinds)
        return f"{name}: got {value!r}; supported a {kind} of {item_text}" + (" or None" if optional else "")
    return None


def field_type_problems(caps: Capabilities) -> list[str]:
    """One ``"<field>: got X; supported Y"`` line per :class:`Capabilities` field of the wrong type.

    Every declared field is covered, so a declaration that passes can be read by every check without raising
    (``requires=(5,)`` is refused here instead of crashing the package probe later).
    """
    out: list[str] = []

    def check(name: str, ok: bool, supported: str) -> None:
        if not ok:
            out.append(f"{name}: got {getattr(caps, name)!r}; supported {supported}")

    opt_str = "a string or None"
    p = _collection_problem("dtypes", caps.dtypes, lambda d: isinstance(d, torch.dtype), "torch dtypes",
                            optional=False)
    out += [p] if p else []
    # (the names themselves are checked against the canonical ones by problems())
    p = _collection_problem("kv_cache_dtypes", caps.kv_cache_dtypes, lambda n: True, "cache dtype names",
                            optional=False)
    out += [p] if p else []
    for name in _BOOL_FIELDS:  # every field declared bool: a string "no" is not read as True
        check(name, isinstance(getattr(caps, name), bool), "True or False")
    for name in ("cpu_env_switch", "cpu_hint", "extra"):
        value = getattr(caps, name)
        check(name, value is None or (isinstance(value, str) and bool(value.strip())), opt_str)
    p = _collection_problem("compute_capabilities", caps.compute_capabilities, _is_cc, "(major, minor) int tuples")
    out += [p] if p else []
    for name in ("min_compute_capability", "max_compute_capability", "fp8_min_compute_capability"):
        value = getattr(caps, name)
        check(name, value is None or _is_cc(value), "a (major, minor) tuple of ints or None")
    ps = caps.page_sizes
    check("page_sizes", ps is None or (isinstance(ps, tuple) and bool(ps) and all(_is_int(v) and v > 0 for v in ps)),
          "a non-empty tuple of positive ints or None")
    for name in ("page_size_multiple", "max_num_heads"):
        value = getattr(caps, name)
        check(name, value is None or (_is_int(value) and value > 0), "a positive int or None")
    check("preferred_page_size", _is_int(caps.preferred_page_size) and caps.preferred_page_size > 0,
          "a positive int")
    p = _collection_problem("dims", caps.dims, _is_cc, "(kv_lora_rank, qk_rope_head_dim) int pairs")
    out += [p] if p else []
    p = _collection_problem("num_heads", caps.num_heads, lambda h: _is_int(h) and h > 0, "positive ints")
    out += [p] if p else []
    check("query_len", isinstance(caps.query_len, QueryLenSupport), "a QueryLenSupport member")
    check("decode_threshold", _is_int(caps.decode_threshold) and caps.decode_threshold >= 1, "an int >= 1")
    req = caps.requires
    check("requires", isinstance(req, tuple) and all(isinstance(m, str) and m.strip() for m in req),
          "a tuple of importable module names (strings)")
    tol = caps.tolerances
    check("tolerances", isinstance(tol, dict) and all(isinstance(k, str) and isinstance(v, Tolerance)
                                                      for k, v in tol.items()),
          "a dict of dtype name -> Tolerance")
    prec = caps.precision
    check("precision", isinstance(prec, dict) and all(isinstance(k, str) and isinstance(v, Precision)
                                                      for k, v in prec.items()),
          "a dict of dtype name -> Precision")
    return out


#: every :class:`Capabilities` field declared ``bool`` (read from the class, so a new flag is checked too)
_BOOL_FIELDS = tuple(f.name for f in fields(Capabilities) if f.type in ("bool", bool))
