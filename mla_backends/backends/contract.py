"""The backend contract: the :class:`MLABackend` base class and the declarations it reads
(:class:`Capabilities`, :class:`AttentionSpec`, defined in :mod:`mla_backends.backends.capabilities`, re-exported here).

A backend states what it handles as data. :meth:`MLABackend.not_supported_reasons` turns those declarations
into *every* :class:`~mla_backends.backends.reasons.Reason` a request does not fit, each reading
``"<what>: got X; supported Y"``; rules the declarations cannot express go in the one hook
:meth:`MLABackend.backend_reasons`, whose reasons are appended. Nobody overrides ``not_supported_reasons``.

:meth:`MLABackend.forward_mqa` is the one entry point and is written once, here: it validates the inputs (the
shared :func:`~mla_backends.backends.inputs.check_mqa_inputs` and the backend's declarations,
:func:`~mla_backends.backends.inputs.check_declared_support`), looks up the backend's per-step state in the step's
:class:`~mla_backends.step.plan.StepPlan`, provides ``out`` / ``lse_out``, returns at once for zero tokens,
calls the backend's kernel method :meth:`MLABackend.forward_mqa_kernel`, and checks what came back.

A backend overrides three things, all public: :meth:`MLABackend.forward_mqa_kernel` (the kernel; required),
:meth:`MLABackend.prepare` (per-step state, made once when the step is planned; optional) and
:meth:`MLABackend.backend_reasons` (rules its declarations cannot express; optional).
:func:`contract_problems` names a class that still overrides ``forward_mqa`` (recorded as a plugin problem
when registered; it keeps working). The kernel method's former name ``_forward_mqa_impl`` (no ``state``
argument) is still called, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING, ClassVar

import torch

from ..core.attention_math import distinct_topk
from ..core.device import DeviceInfo
from ..core.dtypes import FP8_CACHE_DTYPES, dtype_name, lse_dtype
from ..core.errors import USER_CODE_FAILURES
from ..step.cache import LatentKVCache
from ..step.plan import PlanRequest, Run, StepPlan, StepPlanError, plan_step, require_plan
from .capabilities import (
    DEFAULT_TOLERANCES,
    AttentionSpec,
    Capabilities,
    Precision,
    QueryLenSupport,
    Tolerance,
    env_switch_on,
)
from .inputs import check_declared_support, check_mqa_inputs, planned_declarations
from .reasons import Reason, ReasonKind, as_reason

if TYPE_CHECKING:
    from ..step.metadata import BatchMetadata

__all__ = ["QueryLenSupport", "Capabilities", "AttentionSpec", "MLABackend", "Tolerance", "DEFAULT_TOLERANCES",
           "Precision", "BackendContractError", "contract_problems"]


class BackendContractError(RuntimeError):
    """A backend's kernel method broke the ``forward_mqa`` contract (replaced or reshaped its output, returned
    a value); the message names the backend."""


def contract_problems(cls: type) -> list[str]:
    """Ways the ``MLABackend`` subclass ``cls`` departs from the contract (empty when it follows it).

    Today one: a class in its MRO below :class:`MLABackend` defines ``forward_mqa`` itself, so the shared
    validation, output allocation and result checks may be skipped. Such a backend still runs (its own
    ``forward_mqa`` is called); registration records the problem so ``mla-backends list`` shows it.
    """
    problems = []
    for klass in cls.__mro__:
        if klass is MLABackend:
            break
        if "forward_mqa" in vars(klass):
            problems.append(
                f"forward_mqa: got an override in {klass.__module__}.{klass.__qualname__}; supported "
                "implementing forward_mqa_kernel and leaving forward_mqa to MLABackend (it validates, "
                "allocates out/lse_out and checks the result once for every backend)")
            break
    return problems


class MLABackend:
    """Base class of every MLA decode backend.

    Subclasses set ``name`` and ``capabilities``, implement :meth:`forward_mqa_kernel`, and may override
    :meth:`prepare` (per-step state) and :meth:`backend_reasons` (rules the declarations cannot express).
    They do not override :meth:`forward_mqa` or :meth:`not_supported_reasons`.
    """

    name: ClassVar[str] = "ABSTRACT"
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]
    #: the reason given when a module of ``capabilities.requires`` is missing (None: the generic
    #: ``"package: got <module> not installed; supported with it installed: pip install ..."``)
    install_reason: ClassVar[Reason | None] = None

    # ---- capability checks -------------------------------------------------------------------------------
    @classmethod
    def missing_requirements(cls) -> list[str]:
        """Modules in ``capabilities.requires`` that cannot be found (``importlib.util.find_spec``; no import)."""
        missing = []
        for mod in cls.capabilities.requires:
            try:  # "pkg.sub" imports pkg, whose code may raise anything (or call sys.exit())
                found = importlib.util.find_spec(mod) is not None
            except USER_CODE_FAILURES:
                found = False
            if not found:
                missing.append(mod)
        return missing

    @classmethod
    def device_reasons(cls, device: DeviceInfo) -> list[Reason]:
        """The ``DEVICE`` reasons of the declarations (CPU/CUDA, compute capability range): the device part
        of :meth:`not_supported_reasons`. Not an override point."""
        caps = cls.capabilities
        if not device.is_cuda:
            if caps.cpu or (caps.cpu_env_switch is not None and env_switch_on(caps.cpu_env_switch)):
                return []
            return [Reason(ReasonKind.DEVICE, "device", "CPU", f"a CUDA device ({caps.compute_capability_text()})",
                           hint=caps.cpu_hint)]
        cc = device.compute_capability
        assert cc is not None
        label = f"SM{cc[0]}{cc[1]}"
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        if caps.compute_capabilities is not None:
            outside = cc not in caps.compute_capabilities
        else:
            outside = (lo is not None and cc < lo) or (hi is not None and cc > hi)
        if outside:
            return [Reason(ReasonKind.DEVICE, "compute capability", label, caps.compute_capability_text())]
        return []

    @classmethod
    def backend_reasons(cls, spec: AttentionSpec) -> list[Reason | str]:
        """The override point of *selection*: reasons ``spec`` does not fit that :class:`Capabilities` cannot
        express (empty by default). Appended after the declared reasons by :meth:`not_supported_reasons`. Return
        :class:`Reason` values; plain strings are accepted and become reasons of kind ``OTHER``."""
        return []

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec) -> list[Reason]:
        """Every reason ``spec`` does not fit this backend; empty when it fits.

        The declared checks in a fixed order (package, device, dtype, cache dtype, fp8 rule, page size, dims,
        heads, query length, dense/sparse, LSE), then :meth:`backend_reasons`.
        """
        caps = cls.capabilities
        reasons: list[Reason] = []
        missing = cls.missing_requirements()
        if missing:
            extra = f": pip install 'mla-backends[{caps.extra}]'" if caps.extra else ""
            reasons.append(cls.install_reason or Reason(
                ReasonKind.PACKAGE, "package", f"{', '.join(missing)} not installed", f"with it installed{extra}"))
        reasons += cls.device_reasons(spec.device)
        if spec.dtype not in caps.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in caps.dtypes))
            reasons.append(Reason(ReasonKind.DTYPE, "dtype", dtype_name(spec.dtype), names))
        try:
            kv = spec.resolved_kv_cache_dtype
        except (ValueError, TypeError) as exc:
            reasons.append(as_reason(str(exc), ReasonKind.KV_CACHE_DTYPE))
            kv = None
        if kv is not None:
            if kv not in caps.kv_cache_dtypes:
                reasons.append(Reason(ReasonKind.KV_CACHE_DTYPE, "kv cache dtype", kv,
                                      ", ".join(sorted(caps.kv_cache_dtypes))))
            elif (kv in FP8_CACHE_DTYPES and caps.fp8_min_compute_capability is not None
                  and spec.device.is_cuda and spec.device.compute_capability < caps.fp8_min_compute_capability):
                a, b = caps.fp8_min_compute_capability
                c0, c1 = spec.device.compute_capability
                reasons.append(Reason(ReasonKind.FP8, "fp8 cache", f"SM{c0}{c1}",
                                      f"SM{a}{b}+ (native fp8 conversion)"))
        if spec.block_size is not None:
            r = caps.page_size_reason(spec.block_size)
            if r:
                reasons.append(r)
        pair = (spec.kv_lora_rank, spec.qk_rope_head_dim)
        if caps.dims is not None and pair not in caps.dims:
            allowed = ", ".join(f"{a}/{b}" for a, b in sorted(caps.dims))
            reasons.append(Reason(ReasonKind.DIMS, "kv_lora_rank/qk_rope_head_dim", f"{pair[0]}/{pair[1]}", allowed))
        if caps.num_heads is not None and spec.num_heads not in caps.num_heads:
            reasons.append(Reason(ReasonKind.NUM_HEADS, "num_heads", str(spec.num_heads),
                                  ", ".join(map(str, sorted(caps.num_heads)))))
        if caps.max_num_heads is not None and spec.num_heads > caps.max_num_heads:
            reasons.append(Reason(ReasonKind.NUM_HEADS, "num_heads", str(spec.num_heads), f"<= {caps.max_num_heads}"))
        if spec.max_query_len > 1:
            if caps.query_len == QueryLenSupport.SINGLE:
                reasons.append(Reason(ReasonKind.QUERY_LEN, "query length", str(spec.max_query_len),
                                      "1 (single-token decode)"))
            elif caps.query_len == QueryLenSupport.UNIFORM and not spec.uniform_query_len:
                reasons.append(Reason(ReasonKind.QUERY_LEN, "query length", "varying lengths per request",
                                      "uniform lengths"))
        if spec.sparse and not caps.sparse:
            reasons.append(Reason(ReasonKind.ATTENTION, "attention", "sparse (top-k indices)", "dense only"))
        if not spec.sparse and not caps.dense:
            reasons.append(Reason(ReasonKind.ATTENTION, "attention", "dense", "sparse only (top-k indices)"))
        if spec.need_lse and not caps.returns_lse:
            reasons.append(Reason(ReasonKind.LSE, "LSE", "a request for it", "output only (no LSE)"))
        reasons += [as_reason(r) for r in cls.backend_reasons(spec)]
        return reasons

    @classmethod
    def is_available(cls) -> bool:
        """True when the packages it needs are importable (says nothing about the device)."""
        return not cls.missing_requirements()

    # ---- per-step preparation ------------------------------------------------------------------------------
    #: what the layer running this instance asks for (:meth:`configure`); None until configured
    layer_spec: AttentionSpec | None = None
    #: the layer's softmax scale (:meth:`configure`); None until configured
    layer_scale: float | None = None

    def configure(self, spec: AttentionSpec, scale: float) -> None:
        """Tell this instance what its layer runs: ``spec`` (heads, dims, dtypes, page size once the cache
        is allocated) and the softmax ``scale``. ``MLAAttention`` calls it when it builds the backend and
        again in ``allocate_cache``. Lets :meth:`prepare` do work that needs more than the metadata
        (FlashInfer's ``plan()`` needs heads, dtypes and the scale) once per step, outside any capture."""
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: got {type(spec).__name__}; supported AttentionSpec")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale: got {scale!r}; supported a positive float (the unabsorbed softmax scale)")
        self.layer_spec, self.layer_scale = spec, float(scale)

    def prepare_key(self) -> object:
        """Which instances share one prepared state per step: its class, plus its configuration when
        configured (layers asking for the same thing share; a layer configured otherwise prepares its own)."""
        if self.layer_spec is None:
            return type(self)
        return (type(self), self.layer_spec, self.layer_scale)

    def prepare(self, meta: BatchMetadata) -> object | None:
        """Work this backend does once per step, before any layer runs it; returns its per-step state.

        An override point. :func:`~mla_backends.step.plan.plan_step` calls it, never a layer: once per
        :meth:`prepare_key` and batch the step hands this backend (every layer's instance of a class,
        configured alike, shares the result), before the first layer and outside any CUDA-graph capture, so
        it may read the device. It must depend only on ``meta`` and the configuration and be free of side
        effects a second step could trip over. :meth:`forward_mqa` passes the state back to
        :meth:`forward_mqa_kernel` as ``state``. Default: nothing to prepare (None). FlashInfer's backends keep
        their dense block tables and ``plan()`` tokens here; REF_TORCH its page ids and masks.

        Args:
            meta: a batch of the step (its :class:`~mla_backends.step.metadata.BatchMetadata` or a sub-batch).
        """
        return None

    def plan_request(self, meta: BatchMetadata) -> PlanRequest:
        """What this backend runs when an engine hands it a whole step (``plan_step(meta, [backend])``): every
        request absorbed, as one batch."""
        return PlanRequest(runs_key=None, runs=(Run(True, 0, meta.num_requests),), backend=self)

    def planned_declarations(self, meta: BatchMetadata, *, sparse: bool = False) -> frozenset:
        """The input combination this configured instance's declarations accept on ``meta``, recorded in the
        step plan so that ``forward_mqa`` looks it up instead of re-deriving it on every layer (empty when not
        configured). Not an override point."""
        return planned_declarations(self, meta, sparse=sparse)

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
        plan: StepPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed (MQA-shaped) attention over the paged latent cache. Defined once, here; backends implement
        :meth:`forward_mqa_kernel`.

        Args:
            q_latent: ``[tokens, heads, kv_lora_rank]`` absorbed query (``q_nope @ W_UK_T``), processing order.
            q_rope: ``[tokens, heads, qk_rope_head_dim]`` roped query slice.
            cache: the layer's :class:`LatentKVCache`, already holding this step's new rows.
            meta: :class:`BatchMetadata` whose tokens are exactly the rows of ``q_latent``.
            scale: softmax scale (the unabsorbed ``MLADims.softmax_scale``).
            topk_indices: sparse attention only: ``[tokens, topk]`` positions in each token's sequence,
                ``-1`` for padding.
            out / lse_out: optional preallocated ``[tokens, heads, kv_lora_rank]`` (query dtype) /
                ``[tokens, heads]`` (float32; float64 for float64 queries) buffers; ``lse_out`` only for
                backends that return an LSE.
            plan: the step's :class:`~mla_backends.step.plan.StepPlan` (``plan_step``), which holds this
                backend's prepared state for ``meta``; what layers and engines pass. Without it the call is a
                step of its own, planned here for this backend alone (refused while a CUDA graph is being
                captured, since ``prepare`` may read the device).

        Returns:
            ``(out [tokens, heads, kv_lora_rank], lse [tokens, heads])``: the output in latent space, in the
            query's dtype, and the natural-log LSE in float32 (float64 for float64 queries; None for backends
            declaring no LSE). These are ``out`` / ``lse_out`` themselves when given.

        Raises:
            TypeError / ValueError: bad or unsupported inputs (naming the argument), before any kernel runs.
            BackendContractError: the backend's kernel method replaced or reshaped its output.
            StepPlanError: ``plan`` was made for other metadata or without this backend, or no plan was given
                while a CUDA graph is being captured.
        """
        # while a CUDA graph is captured, skip the checks that read device values (they would synchronise)
        capturing = (isinstance(cache, LatentKVCache) and cache.device.type == "cuda"
                     and torch.cuda.is_current_stream_capturing())
        if plan is not None:
            plan = require_plan(plan, "forward_mqa")
        check_mqa_inputs(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices, out=out,
                         lse_out=lse_out, check_values=not capturing, plan=plan)
        check_declared_support(type(self), q_latent, cache, meta, topk_indices=topk_indices, lse_out=lse_out,
                               plan=plan)
        if plan is None:
            if capturing:
                raise StepPlanError("plan: got none while a CUDA graph is being captured; supported the step's "
                                    "plan (plan_step(meta, [backend]) before the capture)")
            plan = plan_step(meta, [self])  # a call of its own is a step of its own
        if topk_indices is not None:  # a position selected twice counts once (on the device, no sync)
            topk_indices = distinct_topk(topk_indices)
        T, H, r = q_latent.shape
        if out is None:
            out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
        if lse_out is None and self.capabilities.returns_lse:
            lse_out = torch.empty(T, H, dtype=lse_dtype(q_latent.dtype), device=q_latent.device)
        if T == 0:
            return out, lse_out
        state = plan.state(self, meta)
        if _legacy_kernel(type(self)):
            returned = self._forward_mqa_impl(q_latent, q_rope, cache, meta, scale=scale,
                                              topk_indices=topk_indices, out=out, lse_out=lse_out)
        else:
            returned = self.forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale,
                                               topk_indices=topk_indices, out=out, lse_out=lse_out, state=state)
        self._check_result(returned, out, lse_out, (T, H, r), q_latent)
        return out, lse_out

    def forward_mqa_kernel(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentKVCache,
        meta: BatchMetadata,
        *,
        scale: float,
        topk_indices: torch.Tensor | None,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        state: object | None,
    ) -> None:
        """The backend's kernel, the method every backend implements: write the output into
        ``out [T, H, kv_lora_rank]`` (query dtype; possibly non-contiguous) and the natural-log LSE into
        ``lse_out [T, H]`` (``dtypes.lse_dtype``; None for backends that return no LSE).

        Called by :meth:`forward_mqa` only with validated inputs and ``T >= 1``; ``state`` is what this
        backend's :meth:`prepare` returned for ``meta`` when the step was planned (None by default). Layout
        checks the backend needs beyond the shared ones (strides, contiguity) go here. Returns None.
        """
        raise NotImplementedError(f"{type(self).__name__}: forward_mqa_kernel is not implemented")

    def _forward_mqa_impl(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentKVCache,
        meta: BatchMetadata,
        *,
        scale: float,
        topk_indices: torch.Tensor | None,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
    ) -> None:
        """Deprecated name of :meth:`forward_mqa_kernel` (no ``state``): still called, with a
        ``DeprecationWarning``, when a class defines it and not ``forward_mqa_kernel``; removed in 0.5. Here it
        runs :meth:`forward_mqa_kernel` without a prepared state, so an old subclass of a built-in backend that
        calls ``super()._forward_mqa_impl(...)`` keeps working."""
        self.forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices, out=out,
                                lse_out=lse_out, state=None)

    def _check_result(self, returned: object, out: torch.Tensor, lse_out: torch.Tensor | None,
                      shape: tuple[int, int, int], q_latent: torch.Tensor) -> None:
        """Host-side metadata checks of what the kernel method left (no device reads)."""
        problems = []
        if returned is not None:
            problems.append(f"returned {type(returned).__name__}; supported None (write into out and lse_out)")
        if tuple(out.shape) != shape or out.dtype != q_latent.dtype or out.device != q_latent.device:
            problems.append(f"out: got {list(out.shape)} {dtype_name(out.dtype)} on {out.device}; supported "
                            f"{list(shape)} {dtype_name(q_latent.dtype)} on {q_latent.device} (written in place)")
        want_lse = lse_dtype(q_latent.dtype)
        if lse_out is not None and (tuple(lse_out.shape) != shape[:2] or lse_out.dtype != want_lse
                                    or lse_out.device != q_latent.device):
            problems.append(f"lse_out: got {list(lse_out.shape)} {dtype_name(lse_out.dtype)} on {lse_out.device}; "
                            f"supported {list(shape[:2])} {dtype_name(want_lse)} on {q_latent.device} "
                            "(written in place)")
        if problems:
            raise BackendContractError(f"{self.name} broke the forward_mqa contract: " + "; ".join(problems))


_LEGACY_WARNED: set[type] = set()


def _legacy_kernel(cls: type) -> bool:
    """Whether ``cls``'s most derived kernel method is the deprecated ``_forward_mqa_impl`` (warned once per
    class)."""
    for klass in cls.__mro__:
        if klass is MLABackend:
            return False
        if "forward_mqa_kernel" in vars(klass):
            return False
        if "_forward_mqa_impl" in vars(klass):
            if cls not in _LEGACY_WARNED:
                _LEGACY_WARNED.add(cls)
                warnings.warn(f"{cls.__module__}.{cls.__qualname__}: _forward_mqa_impl is deprecated; implement "
                              "forward_mqa_kernel(..., state) instead (state: what prepare(meta) returned)",
                              DeprecationWarning, stacklevel=3)
            return True
    return False
