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
calls the backend's kernel method :meth:`MLABackend.forward_mqa_kernel`, and checks what came back. A call the
plan vouched for skips the full checks (:func:`~mla_backends.backends.inputs.is_vouched_call`).

A backend overrides three things, all public: :meth:`MLABackend.forward_mqa_kernel` (the kernel; required),
:meth:`MLABackend.prepare` (per-step state, made once when the step is planned; optional) and
:meth:`MLABackend.backend_reasons` (rules its declarations cannot express; optional).
:func:`contract_problems` names a class that still overrides ``forward_mqa`` (recorded as a plugin problem
when registered; it keeps working). The kernel method's former name ``_forward_mqa_impl`` (no ``state``
argument) is still called, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import threading
import warnings
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, ClassVar

import torch

from ..core.device import DeviceInfo, device_info_for
from ..core.dtypes import FP8_CACHE_DTYPES, dtype_name, lse_dtype
from ..core.errors import USER_CODE_FAILURES, plugin_call, plugin_error
from ..step.cache import LatentKVCache
from ..step.plan import WHOLE_STEP_ABSORBED, PlanRequest, Run, StepPlan, StepPlanError, plan_step, require_plan
from .capabilities import (
    DEFAULT_TOLERANCES,
    AttentionSpec,
    Capabilities,
    Precision,
    QueryLenSupport,
    Tolerance,
    env_switch_on,
)
from .configuration import ConfigurationKey, check_configuration
from .dispatch import resolve_policy, runs_key, step_runs
from .inputs import (
    check_configured_call,
    check_declared_support,
    check_mqa_inputs,
    is_vouched_call,
    planned_call,
    planned_declarations,
)
from .reasons import Reason, ReasonKind, as_reason, returned_reasons
from .v4_inputs import CompressedKeys, V4Keys, check_v4_inputs, v4_flags

if TYPE_CHECKING:
    from ..step.metadata import BatchMetadata
    from .inputs import PlannedCall

__all__ = ["QueryLenSupport", "Capabilities", "AttentionSpec", "MLABackend", "Tolerance", "DEFAULT_TOLERANCES",
           "Precision", "BackendContractError", "contract_problems", "configure_backend",
           "release_configured_backends", "ConfigurationKey"]


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


#: the configured backends alive now, by configuration (:func:`configure_backend`): one object per
#: configuration, shared by every layer and engine part that asks for it, dropped when none holds it
_CONFIGURED: weakref.WeakValueDictionary[Hashable, MLABackend] = weakref.WeakValueDictionary()
_CONFIGURED_LOCK = threading.RLock()
#: the most recently configured backends, held strongly, so that bare calls of an unconfigured instance (each
#: configures the backend its inputs describe) reuse one configured backend and its resources
_RECENT: collections.OrderedDict[Hashable, MLABackend] = collections.OrderedDict()
RECENT_CONFIGURATIONS = 8
_LEGACY_WARNED_CONFIGURE: set[type] = set()
#: attributes fixed once an instance is configured
_CONFIG_ATTRS = frozenset({"layer_spec", "layer_scale", "resources", "_configuration", "_options", "_kv_resolved",
                           "_planned_call"})


def configure_backend(backend: type[MLABackend] | MLABackend, spec: AttentionSpec, scale: float) -> MLABackend:
    """The one configured instance of ``backend`` for ``spec`` and the softmax ``scale``: configure once.

    ``backend`` is an :class:`MLABackend` subclass (built with no arguments) or an instance (its options, e.g.
    ``TritonMLABackend(num_kv_splits=4)``, are kept: a copy is configured; the instance itself is left as it
    was). While any part of the program holds it, every call with an equal ``(class, options, spec, scale)``
    returns the *same* object: the layers of a model configured alike, or an engine's metadata builder and
    each of its attention layers, share one configured backend by identity, and with it one prepared state per
    step and the resources it owns (:meth:`MLABackend.make_resources`: FlashInfer's planned wrappers,
    REF_TORCH's scratch arenas). A configured backend is immutable: its ``layer_spec``, ``layer_scale`` and
    ``resources`` cannot be set again (another configuration is another object), and it refuses calls with
    other heads, widths, dtypes or scale (:class:`~mla_backends.step.plan.StepPlanError`).

    Args:
        backend: the backend class or an instance of it.
        spec: what the caller runs: heads, widths, dtype, cache dtype and page size (None / ``"auto"``: taken
            from each step's metadata and the model dtype), sparse, LSE, device.
        scale: the softmax scale every call passes (the unabsorbed ``MLADims.softmax_scale``).

    Raises:
        TypeError / ValueError: ``backend``, ``spec`` or ``scale`` malformed (before anything is built).
    """
    if isinstance(backend, type):
        if not issubclass(backend, MLABackend):
            raise TypeError(f"backend: got class {backend.__name__}; supported an MLABackend subclass or instance")
    elif not isinstance(backend, MLABackend):
        raise TypeError(f"backend: got {type(backend).__name__}; supported an MLABackend subclass or instance")
    scale = check_configuration(spec, scale)
    cls = backend if isinstance(backend, type) else type(backend)
    with _CONFIGURED_LOCK:
        made: MLABackend | None = None
        if isinstance(backend, type):
            with plugin_call(cls, "__init__()"):  # sys.exit() in a plugin's code there is PluginCodeError
                made = cls()
            options = made.options_key()
        else:
            options = backend.options_key()
        parts = (cls, options if options is not None else ("instance", id(made if made is not None else backend)),
                 spec, scale)
        found = _CONFIGURED.get(parts) if options is not None else None
        if found is not None:
            if parts in _RECENT:
                _RECENT.move_to_end(parts)
            return found
        if made is None:  # the options alone (not what was set on the instance since, e.g. a spy)
            made = _rebuilt(cls, dict(options) if options is not None else {
                k: v for k, v in vars(backend).items() if k not in _CONFIG_ATTRS})
        made._set_configuration(spec, scale, ConfigurationKey(parts), options)
        if options is not None:
            _CONFIGURED[parts] = made
            _RECENT[parts] = made
            while len(_RECENT) > RECENT_CONFIGURATIONS:
                _RECENT.popitem(last=False)
        return made


def _rebuilt(cls: type[MLABackend], options: dict[str, object]) -> MLABackend:
    """An unconfigured ``cls`` instance holding ``options`` as its attributes (its constructor not run again)."""
    made = cls.__new__(cls)
    made.__dict__.update(options)
    return made


def _configured_again(cls: type[MLABackend], options: dict[str, object], spec: AttentionSpec,
                      scale: float) -> MLABackend:
    """What a pickled or copied configured backend becomes: :func:`configure_backend` of the same class, options,
    spec and scale (the same object while the original is alive in this process; its own resources elsewhere)."""
    return configure_backend(_rebuilt(cls, options), spec, scale)


def release_configured_backends() -> None:
    """Forget the configured backends :func:`configure_backend` keeps for reuse (the recent ones it holds; those
    still held elsewhere stay alive, and with them their resources). For tests, and to free the resources of
    configurations no longer used."""
    with _CONFIGURED_LOCK:
        _RECENT.clear()
        _CONFIGURED.clear()


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
                with plugin_call(cls, f"importing {mod} (capabilities.requires)"):
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
        for flag, what in _V4_FEATURES:  # DeepSeek-V4: sinks, a sliding window, compressed keys
            if getattr(spec, flag) and not getattr(caps, flag):
                reasons.append(Reason(ReasonKind.ATTENTION, what, "required", "none"))
        if spec.need_lse and not caps.returns_lse:
            reasons.append(Reason(ReasonKind.LSE, "LSE", "a request for it", "output only (no LSE)"))
        reasons += returned_reasons(cls.backend_reasons(spec))  # a str, None or coroutine is a TypeError
        return reasons

    @classmethod
    def is_available(cls) -> bool:
        """True when the packages it needs are importable (says nothing about the device)."""
        return not cls.missing_requirements()

    # ---- configuration (once) -----------------------------------------------------------------------------
    #: what this instance was configured for (:func:`configure_backend`); None on an unconfigured instance
    layer_spec: AttentionSpec | None = None
    #: the softmax scale it was configured for; None until configured
    layer_scale: float | None = None
    #: what :meth:`make_resources` made for this configuration (None until configured, or when nothing)
    resources: object | None = None
    _configuration: ConfigurationKey | None = None
    _options: Hashable | None = None
    #: what every call of this configuration carries (``forward_mqa``'s hot path); None: unconfigured, sparse, V4
    _planned_call: PlannedCall | None = None
    #: whether :meth:`prepare` needs the configuration (heads, dtypes, scale) to build a complete step state.
    #: An unconfigured instance of such a class does not run its kernel on an incomplete state: each call
    #: runs on the configured backend its inputs describe, prepared for that call (built-in backends: True)
    prepare_needs_configuration: ClassVar[bool] = False

    def __setattr__(self, name: str, value: object) -> None:
        if name in _CONFIG_ATTRS and self.__dict__.get("_configuration") is not None:
            raise AttributeError(f"{name}: {self.name} is configured ({self._configuration!r}) and a configured "
                                 "backend is immutable; supported configure_backend(backend, spec, scale), which "
                                 "returns the configured backend of another configuration")
        object.__setattr__(self, name, value)

    def __reduce_ex__(self, protocol: object) -> object:
        """A configured backend pickles (and copies, deep or not) as its configuration: unpickled it is
        :func:`configure_backend` of it again, which shares the one configured object (and its resources, never
        pickled) instead of duplicating them. An unconfigured instance pickles as usual."""
        if self._configuration is None:
            return super().__reduce_ex__(protocol)  # type: ignore[arg-type]
        options = self.options_key()
        state = dict(options) if isinstance(options, tuple) else {
            k: v for k, v in vars(self).items() if k not in _CONFIG_ATTRS}
        return (_configured_again, (type(self), state, self.layer_spec, self.layer_scale))

    def _set_configuration(self, spec: AttentionSpec, scale: float, key: ConfigurationKey,
                           options: Hashable | None) -> None:
        """Configure this (fresh, unconfigured) instance: a 0.4 plugin's own ``configure`` override first (once
        per configuration, with a ``DeprecationWarning`` per class), then the spec and scale, its resources and
        the key that fixes them."""
        if type(self).configure is not MLABackend.configure:
            if type(self) not in _LEGACY_WARNED_CONFIGURE:
                _LEGACY_WARNED_CONFIGURE.add(type(self))
                warnings.warn(f"{type(self).__qualname__} overrides MLABackend.configure, deprecated since 0.5: "
                              "configure_backend calls it once per configuration; per-configuration resources "
                              "belong in make_resources()", DeprecationWarning, stacklevel=4)
            with warnings.catch_warnings(), plugin_call(self, "configure()"):
                warnings.simplefilter("ignore", DeprecationWarning)
                self.configure(spec, scale)  # (its super().configure configures in place; overwritten below)
            object.__setattr__(self, "_configuration", None)
        self._apply_configuration(spec, scale, key, options)

    def _apply_configuration(self, spec: AttentionSpec, scale: float, key: ConfigurationKey,
                             options: Hashable | None) -> None:
        object.__setattr__(self, "_options", options)
        try:
            kv: str | None = spec.resolved_kv_cache_dtype
        except (ValueError, TypeError):
            kv = None
        object.__setattr__(self, "_kv_resolved", kv)
        object.__setattr__(self, "layer_spec", spec)
        object.__setattr__(self, "layer_scale", scale)
        object.__setattr__(self, "resources", None)
        with plugin_call(self, "make_resources()"):
            object.__setattr__(self, "resources", self.make_resources())
        object.__setattr__(self, "_planned_call", planned_call(spec, scale, kv, key.token))
        object.__setattr__(self, "_configuration", key)

    @property
    def configured(self) -> bool:
        """Whether this instance is configured (:func:`configure_backend`; fixed from then on)."""
        return self._configuration is not None

    def options_key(self) -> Hashable | None:
        """What distinguishes this instance's construction (its options, such as ``TritonMLABackend``'s
        ``num_kv_splits``): part of its configuration's key. Default: its attributes other than the
        configuration, by name; None when one cannot be hashed (then every :func:`configure_backend` of it
        makes a new object). A configured instance keeps the names of the options it was configured with (not
        attributes set on it since)."""
        if self._configuration is not None:  # the options it was configured with, as they are now
            mine = vars(self)
            return None if self._options is None else tuple((k, mine.get(k, v)) for k, v in self._options)
        items = tuple(sorted(((k, v) for k, v in vars(self).items() if k not in _CONFIG_ATTRS), key=lambda kv: kv[0]))
        try:
            hash(items)
        except TypeError:
            return None
        return items

    def make_resources(self) -> object | None:
        """What this configured instance owns for its whole life, made once by :func:`configure_backend`
        (an override point; default None): scratch arenas, planned-wrapper pools, workspaces. ``prepare``
        takes what a step needs from it; nothing here is made per step."""
        return None

    def configure(self, spec: AttentionSpec, scale: float) -> None:
        """Deprecated since 0.5 (it mutated the instance; a re-configuration changed ``prepare_key`` under a
        plan): use :func:`configure_backend`, which returns the one configured backend of a configuration.
        Still works, with a ``DeprecationWarning``, on an unconfigured instance (configured in place, then
        immutable); the same configuration again is a no-op; another one is refused."""
        warnings.warn("MLABackend.configure(spec, scale) is deprecated and removed in 0.6; use "
                      "configure_backend(backend, spec, scale), which returns the configured backend",
                      DeprecationWarning, stacklevel=2)
        scale = check_configuration(spec, scale)
        if self._configuration is not None:
            if (spec, scale) == (self.layer_spec, self.layer_scale):
                return
            raise ValueError(f"spec: got another configuration for {self.name}, configured as "
                             f"{self._configuration!r}; supported configure_backend(backend, spec, scale), which "
                             "returns the configured backend of that configuration (a configured backend is "
                             "immutable)")
        options = self.options_key()
        self._apply_configuration(spec, scale, ConfigurationKey(
            (type(self), options if options is not None else ("instance", id(self)), spec, scale)), options)

    def prepare_key(self) -> object:
        """Which instances share one prepared state per step: its class when unconfigured, else its
        :class:`ConfigurationKey` (the configured backend of a configuration is one object; equal keys share)."""
        key = self._configuration
        return type(self) if key is None else key

    def prepare(self, meta: BatchMetadata) -> object | None:
        """Work this backend does once per step, before any layer runs it; returns its per-step state.

        An override point. :func:`~mla_backends.step.plan.plan_step` calls it, never a layer: once per
        :meth:`prepare_key` and batch the step hands this backend (the layers configured alike share the
        result), before the first layer and outside any CUDA-graph capture, so it may read the device. It must
        depend only on ``meta`` and the configuration and be free of side effects a second step could trip
        over. The state is the step's complete, frozen state: :meth:`forward_mqa` passes it back to
        :meth:`forward_mqa_kernel` as ``state`` on every layer, possibly from several threads at once, and the
        kernel only reads it (no lazy fill, no re-plan; per-call scratch comes from the call or from
        :attr:`resources`). Default: nothing to prepare (None). FlashInfer's backends keep their planned
        wrappers and dense block tables here; REF_TORCH its page ids, masks and scratch sizes; TRITON_MLA its
        launch configuration and split sizes.

        Args:
            meta: a batch of the step (its :class:`~mla_backends.step.metadata.BatchMetadata` or a sub-batch).
        """
        return None

    def plan_request(self, meta: BatchMetadata, *, dispatch: object = None) -> PlanRequest:
        """What this backend runs when an engine hands it a step (``plan_step(meta, [backend], dispatch=...)``):
        without ``dispatch`` every request absorbed, as one batch; with a dispatch policy (or its name,
        ``"per-request"`` / ``"per-batch"``) the runs that policy cuts for this backend's declarations, the ones
        a layer with that policy gets (:func:`~mla_backends.backends.dispatch.step_runs`). Not an override
        point."""
        if dispatch is None:
            return PlanRequest(runs_key=WHOLE_STEP_ABSORBED, runs=(Run(True, 0, meta.num_requests),), backend=self)
        policy = resolve_policy(dispatch)
        caps = self.capabilities
        return PlanRequest(runs_key=runs_key(policy, caps), runs=step_runs(meta, policy, caps), backend=self)

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
        sinks: torch.Tensor | None = None,
        window: int | None = None,
        compressed: CompressedKeys | None = None,
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
                ``-1`` for padding. Each entry is one key: a repeated position counts once per repeat, as in
                FlashMLA's sparse kernels (``distinct_topk`` first for once per position; docs/sparse.md).
            out / lse_out: optional preallocated ``[tokens, heads, kv_lora_rank]`` (query dtype) /
                ``[tokens, heads]`` (float32; float64 for float64 queries) buffers; ``lse_out`` only for
                backends that return an LSE.
            plan: the step's :class:`~mla_backends.step.plan.StepPlan` (``plan_step``), which holds this
                backend's prepared state for ``meta``; what layers and engines pass. Without it the call is a
                step of its own, planned here for this backend alone (refused while a CUDA graph is being
                captured, since ``prepare`` may read the device).
            sinks / window / compressed: DeepSeek-V4 only (:mod:`mla_backends.backends.v4_inputs`): per-head sink
                logits ``[H]``, the sliding window in positions, and the compressed key set; backends declaring
                ``Capabilities.sinks`` / ``window`` / ``compressed`` receive them as one ``v4=V4Keys(...)``.

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
        call = self._planned_call
        if (call is not None and isinstance(plan, StepPlan) and topk_indices is None and sinks is None
                and window is None and compressed is None
                and is_vouched_call(call, q_latent, q_rope, cache, meta, scale, out, lse_out, plan)):
            # the hot path: a configured backend's dense call that the step's plan vouched for, every input as
            # the configuration and the plan say (the checks below would all pass)
            T, H, _ = q_latent.shape
            return self._run_kernel(self, q_latent, q_rope, cache, meta, scale, None, out, lse_out,
                                    plan.state(self, meta) if T else None, {})
        # while a CUDA graph is captured, skip the checks that read device values (they would synchronise)
        capturing = (isinstance(cache, LatentKVCache) and cache.device.type == "cuda"
                     and torch.cuda.is_current_stream_capturing())
        if plan is not None:
            plan = require_plan(plan, "forward_mqa")
        check_mqa_inputs(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices, out=out,
                         lse_out=lse_out, check_values=not capturing, plan=plan)
        v4 = v4_flags(sinks, window, compressed)
        if any(v4):
            check_v4_inputs(q_latent, cache, meta, sinks=sinks, window=window, compressed=compressed,
                            topk_indices=topk_indices, check_values=not capturing)
        T, H, r = q_latent.shape
        planned = plan.state(self, meta) if plan is not None and T else None  # bound to the plan's batches
        key = self._configuration
        if key is not None:  # a configured backend runs what it was configured for
            check_configured_call(self.name, self.layer_spec, self.layer_scale, self._kv_name, q_latent, cache,
                                  topk_indices, scale, v4)
        vouched = None if key is None else (key.token, id(meta)) if lse_out is None else (key.token, id(meta), "lse")
        if not (plan is not None and key is not None and vouched in plan.accepted
                and cache.kv_cache_dtype == self._kv_name):  # (else: what the configuration did not vouch for)
            check_declared_support(type(self), q_latent, cache, meta, topk_indices=topk_indices, lse_out=lse_out,
                                   plan=plan, v4=v4)
        runner: MLABackend = self
        if key is None and type(self).prepare_needs_configuration:  # an unconfigured built-in: per call
            runner = self._call_configuration(q_latent, cache, topk_indices, lse_out, scale, v4)
        if plan is None:
            if capturing:
                raise StepPlanError("plan: got none while a CUDA graph is being captured; supported the step's "
                                    "plan (plan_step(meta, [backend]) before the capture)")
            plan = plan_step(meta, [runner])  # a call of its own is a step of its own
            planned = plan.state(runner, meta) if T else None
        elif runner is not self and T:  # a plan made with this unconfigured instance: prepared for this call
            with plugin_call(runner, "prepare()"):
                planned = runner.prepare(meta)
        extra = {"v4": V4Keys(sinks, window, compressed)} if any(v4) else {}  # only kernels declaring V4
        return self._run_kernel(runner, q_latent, q_rope, cache, meta, scale, topk_indices, out, lse_out, planned,
                                extra)

    def _run_kernel(self, runner: MLABackend, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                    meta: BatchMetadata, scale: float, topk_indices: torch.Tensor | None, out: torch.Tensor | None,
                    lse_out: torch.Tensor | None, planned: object,
                    extra: dict[str, V4Keys]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_mqa`` after its checks: ``out`` / ``lse_out`` provided, nothing run for zero tokens, the
        kernel method of ``runner`` (this backend, or the configured one an unconfigured call describes) called
        with the prepared state ``planned``, and what it left checked."""
        T, H, r = q_latent.shape
        if out is None:
            out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
        if lse_out is None and self.capabilities.returns_lse:
            lse_out = torch.empty(T, H, dtype=lse_dtype(q_latent.dtype), device=q_latent.device)
        if T == 0:
            return out, lse_out
        try:  # plugin_call's rule (sys.exit() in a kernel becomes PluginCodeError), free while nothing is raised
            if _legacy_kernel(type(self)):
                returned = runner._forward_mqa_impl(q_latent, q_rope, cache, meta, scale=scale,
                                                    topk_indices=topk_indices, out=out, lse_out=lse_out)
            else:
                returned = runner.forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale,
                                                     topk_indices=topk_indices, out=out, lse_out=lse_out,
                                                     state=planned, **extra)
        except BaseException as exc:
            error = plugin_error(exc, self, "forward_mqa_kernel()")
            if error is exc:
                raise
            raise error from exc
        self._check_result(returned, out, lse_out, (T, H, r), q_latent)
        return out, lse_out

    @property
    def _kv_name(self) -> str | None:
        """The cache dtype name the configuration resolves to (None: unconfigured or unresolvable)."""
        return self.__dict__.get("_kv_resolved")

    def _call_configuration(self, q_latent: torch.Tensor, cache: LatentKVCache, topk_indices: torch.Tensor | None,
                            lse_out: torch.Tensor | None, scale: float,
                            v4: tuple[bool, bool, bool] = (False, False, False)) -> MLABackend:
        """The configured backend a call on this unconfigured instance describes (its options kept)."""
        sinks, window, compressed = v4
        spec = AttentionSpec(num_heads=q_latent.shape[1], kv_lora_rank=cache.kv_lora_rank,
                             qk_rope_head_dim=cache.qk_rope_head_dim, dtype=q_latent.dtype,
                             kv_cache_dtype=cache.kv_cache_dtype, block_size=cache.block_size,
                             sparse=topk_indices is not None, need_lse=lse_out is not None,
                             device=device_info_for(cache.device), sinks=sinks, window=window,
                             compressed=compressed)
        return configure_backend(self, spec, scale)

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
        """Host-side metadata checks of what the kernel method left (no device reads): nothing returned, ``out`` and
        ``lse_out`` still of their shapes and dtypes (in-place writes cannot move a tensor to another device, so
        devices are not compared: this runs on every call)."""
        problems = []
        if returned is not None:
            problems.append(f"returned {type(returned).__name__}; supported None (write into out and lse_out)")
        if out.shape != shape or out.dtype != q_latent.dtype:
            problems.append(f"out: got {list(out.shape)} {dtype_name(out.dtype)}; supported {list(shape)} "
                            f"{dtype_name(q_latent.dtype)} (written in place)")
        if lse_out is not None and (lse_out.shape != shape[:2] or lse_out.dtype != lse_dtype(q_latent.dtype)):
            problems.append(f"lse_out: got {list(lse_out.shape)} {dtype_name(lse_out.dtype)}; supported "
                            f"{list(shape[:2])} {dtype_name(lse_dtype(q_latent.dtype))} (written in place)")
        if problems:
            raise BackendContractError(f"{self.name} broke the forward_mqa contract: " + "; ".join(problems))


#: the DeepSeek-V4 features a spec may need and a backend may declare: (field, what the reason names)
_V4_FEATURES = (("sinks", "sinks"), ("window", "sliding window"), ("compressed", "compressed keys"))

@functools.cache
def _legacy_kernel(cls: type) -> bool:
    """Whether ``cls``'s most derived kernel method is the deprecated ``_forward_mqa_impl`` (worked out, and
    warned about, once per class: this runs on every call)."""
    for klass in cls.__mro__:  # (MLABackend itself defines forward_mqa_kernel: the walk ends there at the latest)
        if "forward_mqa_kernel" in vars(klass):
            return False
        if "_forward_mqa_impl" in vars(klass):
            warnings.warn(f"{cls.__module__}.{cls.__qualname__}: _forward_mqa_impl is deprecated; implement "
                          "forward_mqa_kernel(..., state) instead (state: what prepare(meta) returned)",
                          DeprecationWarning, stacklevel=4)
            return True
    return False
