"""Pieces shared by the four FlashInfer backends: selection-time reasons, per-device workspaces, the wrapper pool
a configured backend owns (:class:`WrapperPool`), the per-step state (:class:`FlashInferStep`: the wrappers
planned for the step and its dense block tables, made once in ``prepare``), query packing/padding and
block-table preparation. Imports no flashinfer.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from ..backends.contract import AttentionSpec, MLABackend
from ..backends.reasons import Reason, ReasonKind
from ..core.dtypes import FP8_CACHE_DTYPES, FP8_E4M3_MAX, dtype_name
from ..step.metadata import BatchMetadata
from ..step.plan import StepPlanError
from . import _install, api
from .api import WORKSPACE_BYTES

__all__ = [
    "FlashInferBackendBase",
    "workspace_for",
    "WrapperPool",
    "FlashInferStep",
    "pack_query",
    "live_pages",
    "dense_block_table",
    "scale_ratio",
    "output_buffers",
    "deliver_outputs",
    "fp8_query_scale",
    "run_padded_heads",
]

_LOCK = threading.Lock()
_WORKSPACES: dict[tuple[str, str], torch.Tensor] = {}


def workspace_for(device: torch.device, path: str) -> torch.Tensor:
    """The zero-initialised 128 MiB uint8 workspace of ``path`` on ``device``, allocated on first use.

    Each path (``fa``, ``cutlass``, ``trtllm``, ``xqa``) has its own: XQA keeps semaphores at the start of
    its workspace that must stay zero between launches, which another kernel's scratch use would break.
    """
    key = (str(device), path)
    with _LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None:
            ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            _WORKSPACES[key] = ws
        return ws


class WrapperPool:
    """The ``BatchMLAPagedAttentionWrapper`` s of one configured FlashInfer backend (its
    :attr:`~mla_backends.MLABackend.resources`), lent to the steps it prepares.

    A wrapper holds one ``plan()`` at a time, so each prepared step state takes its own wrappers from the pool
    and plans them once; they come back when the state is dropped (``weakref.finalize``), for a later step to
    plan again. Two steps alive at once (an engine planning step N + 1 while step N's plan is still held) hold
    different wrappers: no step's plan is ever replaced under it, and nothing is planned in a layer call. The
    pool grows to the most steps alive at once (usually one or two); every wrapper of a path shares the
    device's one workspace (:func:`workspace_for`; their runs follow one another on a stream).
    """

    def __reduce__(self) -> tuple[type[WrapperPool], tuple[()]]:
        return (WrapperPool, ())  # wrappers hold device buffers and plans: a copy starts empty

    def __init__(self) -> None:
        self._free: dict[tuple[str, str], list[Any]] = {}
        self._lock = threading.RLock()  # (a finalizer may give back while this thread holds it)
        #: wrappers made so far (each made once, then lent again and again)
        self.made = 0

    def take(self, device: torch.device, fi_backend: str) -> Any:
        """A wrapper of ``fi_backend`` (``fa2``, ``fa3``, ``cutlass``) on ``device``: a free one, else a new one."""
        key = (str(device), fi_backend)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        path = "cutlass" if fi_backend == "cutlass" else "fa"
        wrapper = api.load_wrapper_class()(**api.wrapper_init_kwargs(workspace_for(device, path), fi_backend))
        with self._lock:
            self.made += 1
        return wrapper

    def give_back(self, device: torch.device, fi_backend: str, wrappers: tuple[Any, ...]) -> None:
        """Return ``wrappers`` to the pool (their plans are no one's any more)."""
        with self._lock:
            self._free.setdefault((str(device), fi_backend), []).extend(wrappers)

    def lend(self, owner: object, device: torch.device, fi_backend: str, wrappers: tuple[Any, ...]) -> None:
        """Give ``wrappers`` back when ``owner`` (the step state planned with them) is dropped."""
        weakref.finalize(owner, self.give_back, device, fi_backend, wrappers)


@dataclass(frozen=True, eq=False)
class FlashInferStep:
    """A FlashInfer backend's complete state for one step: what its ``prepare`` returns, frozen.

    ``plan_step`` makes it once per step and ``forward_mqa`` hands it to every layer's kernel call, which only
    reads it: the dense block tables are made and the wrappers planned here, never in a layer.

    Attributes:
        block_tables: alignment -> ``[B, W]`` int32 table from :func:`dense_block_table`.
        planned: ``(requests, wrapper)`` per request group, each wrapper planned for those requests of this
            step (empty when the backend plans no wrapper, or was not configured).
        call: what the wrappers were planned for: ``(path, heads, query dtype, cache dtype, page size,
            kv_lora_rank, rope, scale)`` (a call with anything else is a :class:`StepPlanError`).
    """

    block_tables: Mapping[int, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    planned: tuple[tuple[tuple[int, ...], Any], ...] = ()
    call: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_tables, MappingProxyType):
            object.__setattr__(self, "block_tables", MappingProxyType(dict(self.block_tables)))

    def block_table(self, meta: BatchMetadata, *, align: int = 1) -> torch.Tensor:
        """The prepared :func:`dense_block_table` of ``meta`` (the step this state was prepared for).

        Raises:
            StepPlanError: no table of that alignment was prepared.
        """
        table = self.block_tables.get(align)
        if table is None:
            raise StepPlanError(f"FlashInfer: got a call needing the block table aligned to {align}; supported the "
                                f"alignments its step state was prepared with ({sorted(self.block_tables)})")
        return table

    def require_call(self, call: tuple[Any, ...], name: str) -> None:
        """Raise :class:`StepPlanError` unless the wrappers were planned for ``call``."""
        if call != self.call:
            raise StepPlanError(f"{name}: got a call for {call}; supported the call its step state planned "
                                f"FlashInfer's wrapper for ({self.call}): a configured backend runs what it was "
                                "configured for, with the cache the configuration names")


def prepared_tables(meta: BatchMetadata, *aligns: int) -> dict[int, torch.Tensor]:
    """:func:`dense_block_table` of ``meta`` for each alignment (once each)."""
    return {a: dense_block_table(meta, align=a) for a in dict.fromkeys(aligns)}


def pack_query(q_latent: torch.Tensor, q_rope: torch.Tensor, *, num_heads: int, dtype: torch.dtype,
               multiplier: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[T, H, r]`` + ``[T, H, rope]`` -> contiguous ``[T, num_heads, r + rope]`` in ``dtype``.

    Heads ``H..num_heads-1`` are zero (padding for kernels with a fixed head count; their output rows are
    discarded). ``multiplier`` scales the query (computed in float32 before the cast): used to fold a
    softmax-scale ratio or an fp8 quantisation scale into the query.
    """
    T, H, r = q_latent.shape
    width = r + q_rope.shape[-1]
    if num_heads < H:
        raise ValueError(f"num_heads: got {num_heads} < the query's {H} heads; supported >= {H}")
    scaled = isinstance(multiplier, torch.Tensor) or multiplier != 1.0
    needs_math = scaled or dtype != q_latent.dtype
    work_dtype = torch.float32 if needs_math else dtype
    q = (torch.zeros if num_heads > H else torch.empty)(T, num_heads, width, dtype=work_dtype,
                                                         device=q_latent.device)
    q[:, :H, :r] = q_latent
    q[:, :H, r:] = q_rope
    if needs_math:
        if scaled:
            q.mul_(multiplier)
        q = q.to(dtype)
    return q


def output_buffers(q_latent: torch.Tensor, out: torch.Tensor | None, lse_out: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a kernel writes: ``out [T, H, r]`` / ``lse_out [T, H]`` themselves when contiguous, otherwise
    fresh contiguous buffers (the query's dtype / float32) on the query's device."""
    T, H, _ = q_latent.shape
    result = out if out is not None and out.is_contiguous() else torch.empty_like(
        q_latent, memory_format=torch.contiguous_format)
    lse = lse_out if lse_out is not None and lse_out.is_contiguous() else torch.empty(
        T, H, dtype=torch.float32, device=q_latent.device)
    return result, lse


def deliver_outputs(result: torch.Tensor, lse: torch.Tensor, out: torch.Tensor | None,
                    lse_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy what :func:`output_buffers` allocated into the caller's non-contiguous ``out``/``lse_out``;
    returns the tensors to hand back (the caller's buffers when given)."""
    if out is not None and result is not out:
        out.copy_(result)
        result = out
    if lse_out is not None and lse is not lse_out:
        lse_out.copy_(lse)
        lse = lse_out
    return result, lse


def live_pages(meta: BatchMetadata) -> list[int]:
    """Pages each request's ``seq_len`` occupies (host ints, processing order)."""
    return [-(-s // meta.block_size) for s in meta.seq_lens_list]


def dense_block_table(meta: BatchMetadata, *, align: int = 1) -> torch.Tensor:
    """``[B, W]`` int32 contiguous block table on the batch's device: live entries copied, the rest 0.

    ``W`` is the largest live page count (at least 1) rounded up to a multiple of ``align``. Entries past a
    request's last page may be -1 in :class:`BatchMetadata`; kernels that read a whole aligned chunk of the
    table must see a valid id there, so they become page 0 (never attended: the lengths mask them).
    """
    pages = live_pages(meta)
    width = max(pages, default=0)
    width = max(1, -(-max(width, 1) // align) * align)
    bt = meta.block_table
    dev = bt.device
    out = torch.zeros(bt.shape[0], width, dtype=torch.int32, device=dev)
    n = min(width, bt.shape[1])
    if n:
        cols = torch.arange(n, device=dev)[None, :]
        live = cols < torch.tensor(pages, dtype=torch.int64, device=dev)[:, None]
        zero = torch.zeros((), dtype=torch.int32, device=dev)
        out[:, :n] = torch.where(live, bt[:, :n].to(torch.int32), zero)
    return out


class FlashInferBackendBase(MLABackend):
    """Shared behaviour of the FlashInfer backends (not registered itself).

    Selection: the base class's declared checks (a missing package reads as :data:`NOT_INSTALLED_REASON`),
    then :meth:`backend_reasons`: the installed version against the tested range and the entry points in
    ``entry_points`` read from the installed source (when flashinfer is present), then the subclass's rules
    (subclasses extend ``super().backend_reasons(spec)``).
    """

    #: ``(path under flashinfer/, name)`` that the backend calls; checked in the installed source text
    entry_points: ClassVar[tuple[tuple[str, str], ...]] = ()
    install_reason: ClassVar[Reason | None] = Reason(ReasonKind.PACKAGE, "package", text=_install.NOT_INSTALLED_REASON)

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        """The installed flashinfer-python's version and entry points (when it is installed at all)."""
        return [] if cls.missing_requirements() else list(cls.installed_reasons())

    @classmethod
    def is_available(cls) -> bool:
        """flashinfer is importable, inside the tested version range, and defines the entry points used."""
        return not cls.missing_requirements() and not cls.installed_reasons()

    @classmethod
    def installed_reasons(cls) -> list[Reason]:
        """Why the installed flashinfer-python cannot serve this backend (version, missing entry points)."""
        version = _install.installed_version()
        reasons = _install.version_reasons(version)
        for path, name in cls.entry_points:
            if not _install.source_defines(path, name):
                reasons.append(Reason(ReasonKind.VERSION, f"flashinfer-python {version}",
                                      f"no {name} in flashinfer/{path}",
                                      f"a release that defines it ({_install.TESTED_RANGE_TEXT})"))
        return reasons

    def prepare(self, meta: BatchMetadata) -> FlashInferStep | None:
        """This step's complete :class:`FlashInferStep` (subclasses plan and build their tables here)."""
        return FlashInferStep()

    def step_state(self, meta: BatchMetadata, state: object | None = None) -> FlashInferStep:
        """This step's :class:`FlashInferStep`: ``state`` (what :meth:`prepare` returned when the step was
        planned, handed to ``forward_mqa_kernel``), or, for a launch outside a step, one made for this call."""
        if state is None:
            state = self.prepare(meta)
        if not isinstance(state, FlashInferStep):
            raise TypeError(f"{self.name}.prepare: got {type(state).__name__}; supported FlashInferStep")
        return state

    def wrapper_pool(self) -> WrapperPool:
        """The configuration's :class:`WrapperPool`; a fresh one (this call's) on an unconfigured instance."""
        return self.resources if isinstance(self.resources, WrapperPool) else WrapperPool()

    def planned_step(self, meta: BatchMetadata, call: tuple[Any, ...], groups: list[list[int]],
                     plan: Callable[[Any, list[int] | None], None], tables: dict[int, torch.Tensor]) -> FlashInferStep:
        """A :class:`FlashInferStep` with one wrapper of path ``call[0]`` per request group of ``groups``, each
        taken from :meth:`wrapper_pool` and planned with ``plan(wrapper, requests or None)`` (None: the whole
        batch), lent to the state until it is dropped."""
        pool, device, path = self.wrapper_pool(), meta.device, call[0]
        taken: list[Any] = []
        try:
            for requests in groups:
                wrapper = pool.take(device, path)
                taken.append(wrapper)
                whole = len(groups) == 1 and len(requests) == meta.num_requests
                plan(wrapper, None if whole else requests)
        except BaseException:
            pool.give_back(device, path, tuple(taken))
            raise
        state = FlashInferStep(tables, tuple((tuple(g), w) for g, w in zip(groups, taken, strict=True)), call)
        pool.lend(state, device, path, tuple(taken))
        return state

    # ---- helpers for subclasses --------------------------------------------------------------------------
    @staticmethod
    def _resolved_kv(spec: AttentionSpec) -> str | None:
        try:
            return spec.resolved_kv_cache_dtype
        except (ValueError, TypeError):
            return None  # the base class already reported it

    @classmethod
    def _kv_matches_query_reason(cls, spec: AttentionSpec) -> list[Reason]:
        """A non-fp8 cache must hold the query's dtype (FlashInfer's kernels take one 16-bit type)."""
        kv = cls._resolved_kv(spec)
        if kv is None or kv in FP8_CACHE_DTYPES or kv not in cls.capabilities.kv_cache_dtypes:
            return []
        if kv != dtype_name(spec.dtype) and spec.dtype in cls.capabilities.dtypes:
            fp8 = " or fp8_e4m3" if "fp8_e4m3" in cls.capabilities.kv_cache_dtypes else ""
            return [Reason(ReasonKind.KV_CACHE_DTYPE, "kv cache dtype", f"{kv} with {dtype_name(spec.dtype)} queries",
                           f"the query dtype ({dtype_name(spec.dtype)}){fp8}")]
        return []


def fp8_query_scale(q_latent: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp8_e4m3 scale of the query, ``amax(|q_latent|, |q_rope|) / 448``: float32 ``[1]`` on the
    query's device (no host sync), at least the smallest normal float32 (an all-zero query)."""
    amax = torch.maximum(q_latent.abs().amax(), q_rope.abs().amax()).float().reshape(1)
    return (amax / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def run_padded_heads(q_latent: torch.Tensor, out: torch.Tensor | None, kernel_heads: int,
                     launch: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run a kernel with a fixed head count and return the ``[T, H, r]`` output of the query's ``H`` heads.

    ``launch(full)`` writes ``full [T, kernel_heads, r]`` (the query's dtype and device); heads ``H..`` are
    padding and dropped. Nothing is launched for ``T == 0``. The result goes into ``out`` when given.
    """
    T, H, r = q_latent.shape
    if T == 0:
        return out if out is not None else torch.empty_like(q_latent)
    full = torch.empty(T, kernel_heads, r, dtype=q_latent.dtype, device=q_latent.device)
    launch(full)
    if out is not None:
        out.copy_(full[:, :H])
        return out
    return full if H == kernel_heads else full[:, :H].contiguous()


def scale_ratio(scale: float, fixed: float) -> float:
    """Multiplier that turns a kernel's fixed softmax scale into ``scale`` when applied to the query."""
    return 1.0 if math.isclose(scale, fixed, rel_tol=1e-7, abs_tol=0.0) else scale / fixed
