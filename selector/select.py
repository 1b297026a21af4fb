"""``select_backend()``: the best registered MLA backend for a device and request, with the reasons.

Order of authority: the ``backend=`` argument, then the ``MLA_BACKEND`` environment variable (``auto`` or
unset means no override), then the device's ladder (``selector.ladders``). A forced backend that does not fit
raises :class:`BackendNotSupportedError` with its reasons; there is no silent fallback. Selection reads
declarations only: it never runs a kernel and never imports triton or flashinfer.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from mla_backends.backends.capabilities import environment_snapshot
from mla_backends.backends.contract import AttentionSpec, MLABackend
from mla_backends.backends.reasons import Reason, ReasonKind, all_of_kinds, reasons_of
from mla_backends.core.device import DeviceInfo
from mla_backends.core.dims import MLADims
from mla_backends.core.dtypes import FP8_CACHE_DTYPES, canonical_kv_cache_dtype, parse_model_dtype
from mla_backends.core.env_switches import TRITON_INTERPRET_SWITCH, parse_switch
from mla_backends.core.v4dims import V4Dims
from mla_backends.core.validation import require_int
from mla_backends.plugins.aliases import alias_note, name_clash_note
from mla_backends.plugins.loading import get_registry
from mla_backends.plugins.registry import BackendName, PluginProblem, Registry, UnknownBackendError

from .detect import clear_device_cache, resolve_device
from .ladders import candidates, ladder_for

__all__ = [
    "MLA_BACKEND_ENV",
    "Verdict",
    "Selection",
    "SelectionError",
    "NoBackendError",
    "BackendNotSupportedError",
    "select_backend",
    "evaluate",
    "clear_cache",
]

MLA_BACKEND_ENV = "MLA_BACKEND"
#: environment variables that can change a selection (part of the cache key)
_ENV_KEYS = (MLA_BACKEND_ENV, TRITON_INTERPRET_SWITCH, "CUDA_VISIBLE_DEVICES")
_ENV_BYTES = tuple(k.encode() for k in _ENV_KEYS)


def _env_state() -> tuple:
    """The values of ``_ENV_KEYS``, read for the cache key on every call (kept cheap: ~0.2 us on POSIX).

    ``os.environ.get`` encodes and decodes on each call; on POSIX the mapping's byte-keyed ``_data`` dict
    (kept in sync by ``os.environ``) is read directly instead.
    """
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        return tuple(data.get(k) for k in _ENV_BYTES)
    return tuple(os.environ.get(k) for k in _ENV_KEYS)


@dataclass(frozen=True)
class Verdict:
    """One candidate's outcome.

    Attributes:
        name / source: the backend and the plugin that registered it (``builtin`` for ours).
        reasons: every :class:`~mla_backends.backends.reasons.Reason` it does not fit (empty when it fits); each
            reads "<what>: got X; supported Y" and compares equal to that text.
        selected: True for the chosen backend.
        block_size: the page size it would run with (the request's, or its preferred one).
        page_size_hint: set when the user's ``block_size`` was its *only* obstacle: a page size that fits.
    """

    name: str
    source: str
    reasons: tuple[Reason, ...]
    selected: bool = False
    block_size: int | None = None
    page_size_hint: int | None = None

    @property
    def fits(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_backend`.

    Attributes:
        backend: the chosen ``MLABackend`` subclass; ``name`` its registered name.
        block_size: the page size to allocate the cache with (tokens per page).
        device: the device it was selected for; spec: the request, with ``block_size`` resolved.
        verdicts: every candidate in ladder order with its reasons (one entry when forced).
        ladder: ``"<family>/<variant>"`` walked, or ``"forced"``.
        forced_by: None, ``"argument"`` or ``"MLA_BACKEND"``.
        plugin_problems: plugin failures recorded while loading the registry.
        requested_block_size: the page size the caller asked for (None: the backend's preferred one).
        notes: hints about the request, such as a forced name that means another kernel elsewhere.
    """

    backend: type[MLABackend]
    block_size: int
    device: DeviceInfo
    spec: AttentionSpec
    verdicts: tuple[Verdict, ...]
    ladder: str
    forced_by: str | None = None
    plugin_problems: tuple[PluginProblem, ...] = ()
    requested_block_size: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.backend.name.upper()

    def explain(self) -> str:
        """A readable report of every candidate, why it was or was not chosen, and plugin problems."""
        from .explain import format_selection

        return format_selection(self)

    def to_dict(self) -> dict[str, Any]:
        """The ``mla-backends select --json`` document."""
        from .explain import selection_dict

        return selection_dict(self)


class SelectionError(RuntimeError):
    """Base of the selector's errors: carries the device, the request and the verdicts."""

    def __init__(self, message: str, *, device: DeviceInfo, spec: AttentionSpec,
                 verdicts: tuple[Verdict, ...], ladder: str,
                 plugin_problems: tuple[PluginProblem, ...] = (), notes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.device = device
        self.spec = spec
        self.verdicts = verdicts
        self.ladder = ladder
        self.plugin_problems = plugin_problems
        self.notes = notes

    def to_dict(self) -> dict[str, Any]:
        from .explain import failure_dict

        return failure_dict(self)


class NoBackendError(SelectionError):
    """No candidate fits: the message lists every candidate's reasons and one actionable ``hint``."""

    def __init__(self, message: str, *, hint: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.hint = hint


class BackendNotSupportedError(SelectionError):
    """A forced backend (argument or ``MLA_BACKEND``) does not fit; ``reasons`` says why."""

    def __init__(self, message: str, *, backend: str, reasons: tuple[Reason, ...], forced_by: str,
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.backend = backend
        self.reasons = reasons
        self.forced_by = forced_by


# ---- evaluation -------------------------------------------------------------------------------------
def evaluate(cls: type[MLABackend], spec: AttentionSpec) -> tuple[Reason, ...]:
    """``cls.not_supported_reasons(spec)`` as :class:`Reason` values (a plugin's plain strings wrapped as kind
    ``OTHER``), with a plugin's crashing check turned into a ``CHECK_FAILED`` reason."""
    return tuple(reasons_of(cls, spec))  # sys.exit() in a plugin's check must not end the caller either


def _verdict(registry: Registry, name: str, spec: AttentionSpec) -> Verdict:
    entry = registry.entry(name)
    if entry is None:
        return Verdict(name=name, source="-", reasons=(Reason(
            ReasonKind.REGISTRY, "registry", "no backend registered under this name",
            "a registered backend (see `mla-backends list`)"),))
    reasons = evaluate(entry.cls, spec)
    preferred = entry.cls.capabilities.preferred_page_size
    hint = None
    if reasons and spec.block_size is not None and not evaluate(entry.cls, replace(spec, block_size=None)):
        hint = preferred
    return Verdict(name=entry.name, source=entry.source, reasons=reasons,
                   block_size=spec.block_size if spec.block_size is not None else preferred,
                   page_size_hint=hint)


def _extra_of(cls: type[MLABackend], reasons: tuple[Reason, ...] = ()) -> str:
    """What to do so that a backend refused only for missing packages fits: its pip extra, the modules it
    needs, else the remedy its own package reason names (CPU_FUSED: ``run `mla-backends build```)."""
    extra = cls.capabilities.extra
    if extra:
        return f"pip install 'mla-backends[{extra}]'"
    missing = cls.missing_requirements()
    if missing:
        return f"install {', '.join(missing)}"
    remedy = next((r.hint for r in reasons if r.hint), None)
    return remedy or "install what it needs"


def _hint(registry: Registry, names: tuple[str, ...], spec: AttentionSpec,
          verdicts: tuple[Verdict, ...]) -> str:
    """One actionable change that makes a candidate fit, most practical first."""
    for v in verdicts:  # only a package is missing
        if all_of_kinds(v.reasons, ReasonKind.PACKAGE):
            return f"{_extra_of(registry.get(v.name), v.reasons)} to enable {v.name}."
    for v in verdicts:  # only the page size
        if v.page_size_hint is not None:
            return f"use block_size={v.page_size_hint} (or leave it unset) to run {v.name}."
    tries: list[tuple[str, AttentionSpec]] = []
    for kv in ("auto", "bfloat16", "float16", "fp8_e4m3"):
        if kv != spec.kv_cache_dtype:
            tries.append((f"kv_cache_dtype={kv!r}", replace(spec, kv_cache_dtype=kv)))
    for dt in (torch.bfloat16, torch.float16):
        if dt != spec.dtype:
            tries.append((f"dtype={str(dt).removeprefix('torch.')}", replace(spec, dtype=dt)))
    if spec.need_lse:
        tries.append(("need_lse=False", replace(spec, need_lse=False)))
    for label, alt in tries:
        for name in names:
            entry = registry.entry(name)
            if entry is not None and not evaluate(entry.cls, alt):
                page = "" if spec.block_size is None else f" (block_size={spec.block_size})"
                return f"use {label}{page} to run {name}."
    if spec.device.is_cuda:
        return ("no single change of page size, cache dtype or dtype helps on this GPU; run on the CPU "
                "(device='cpu', REF_TORCH) or see `mla-backends list` for what each backend accepts.")
    return "no single change of page size, cache dtype or dtype helps; see `mla-backends list`."


# ---- the cache --------------------------------------------------------------------------------------
_CACHE: dict[tuple, Selection] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_MAX = 4096


def clear_cache() -> None:
    """Forget cached selections and probed devices (the environment or the registry changed)."""
    with _CACHE_LOCK:
        _CACHE.clear()
    clear_device_cache()


# ---- input checks -----------------------------------------------------------------------------------
def _dims(dims: object) -> MLADims | V4Dims:
    if isinstance(dims, (MLADims, V4Dims)):
        return dims
    if isinstance(dims, str):
        return MLADims.preset(dims)
    raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims, V4Dims or a preset name ('deepseek-v3')")


def _override(backend: object, env_value: str | None) -> tuple[object, str] | None:
    """(name or class, who forced it) or None; the argument beats ``MLA_BACKEND`` (its value ``env_value``,
    read once per call with the cache key); ``auto`` means none."""
    if backend is not None and not (isinstance(backend, str) and backend.strip().lower() in ("", "auto")):
        if not isinstance(backend, (str, BackendName, type)):
            raise TypeError(f"backend: got {type(backend).__name__}; supported a name, 'auto' or a class")
        return backend, "argument"
    env = (env_value or "").strip()
    if env and env.lower() != "auto":
        return env, MLA_BACKEND_ENV
    return None


# ---- the entry point --------------------------------------------------------------------------------
def select_backend(
    dims: MLADims | V4Dims | str,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    kv_cache_dtype: str | torch.dtype = "auto",
    block_size: int | None = None,
    sparse: bool = False,
    max_query_len: int = 1,
    device: object = None,
    backend: str | BackendName | type[MLABackend] | None = None,
    uniform_query_len: bool = True,
    need_lse: bool = False,
) -> Selection:
    """Choose the backend for ``dims`` on ``device``.

    Args:
        dims: the (per-rank) model dims, or a preset name; ``num_heads`` is the per-rank head count. A
            :class:`~mla_backends.core.v4dims.V4Dims` asks for DeepSeek-V4 attention: rows of ``head_dim`` with no
            separate rope slice, any query lengths, sinks, a window and (when the model compresses) compressed
            keys, from the family's V4 ordering (``sparse`` is then ignored).
        dtype: model (query) dtype. kv_cache_dtype: ``auto`` (= ``dtype``), ``bfloat16``, ``fp8_e4m3`` ...
        block_size: cache page size in tokens; None takes the chosen backend's preferred one.
        sparse: top-k sparse attention (DeepSeek-V3.2). max_query_len / uniform_query_len: the largest
            number of query tokens per request sent to ``forward_mqa`` and whether all requests send as many.
        device: None/``"auto"`` (probe CUDA device 0 through NVML), ``"cuda:N"``, an index, a simulated
            ``"sm90"``/``(10, 0)``/``"cpu"``, or a :class:`DeviceInfo`.
        backend: force a backend (beats ``MLA_BACKEND``): a registered name, vLLM's or SGLang's name for
            the same kernel (``"CUTLASS_MLA"``, ``"trtllm_mla"``), a ``"package.module:Class"`` import path
            (an uninstalled plugin) or a class; None or ``"auto"`` lets it choose.
        need_lse: the caller needs the log-sum-exp (e.g. to merge partial results).

    Raises:
        NoBackendError: nothing fits (message: every candidate's reasons and a hint).
        BackendNotSupportedError: a forced backend does not fit. UnknownBackendError: unknown forced name.
        ValueError / TypeError: an argument is malformed; EnvSwitchError (a ValueError): ``TRITON_INTERPRET``
            holds no on/off spelling (:mod:`mla_backends.core.env_switches`).
    """
    registry = get_registry()
    env = _env_state()
    try:
        key: tuple | None = (dims, dtype, kv_cache_dtype, block_size, sparse, max_query_len, device, backend,
                             uniform_query_len, need_lse, env, id(registry), registry.generation)
        hit = _CACHE.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable argument: validate and compute without the cache
        key, hit = None, None
    if hit is not None:
        return hit
    # the environment is read once, above: the selection follows exactly what its cache key says
    values = {k: (os.fsdecode(v) if isinstance(v, bytes) else v) for k, v in zip(_ENV_KEYS, env, strict=True)}
    parse_switch(TRITON_INTERPRET_SWITCH, values[TRITON_INTERPRET_SWITCH])  # a bad spelling: refused up front
    with environment_snapshot(values):
        sel = _select(registry, dims, dtype, kv_cache_dtype, block_size, sparse, max_query_len, device, backend,
                      uniform_query_len, need_lse, values[MLA_BACKEND_ENV])
    if key is not None:
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            sel = _CACHE.setdefault(key, sel)  # concurrent first calls all return the same object
    return sel


def _select(registry: Registry, dims: object, dtype: object, kv_cache_dtype: object, block_size: object,
            sparse: object, max_query_len: object, device: object, backend: object, uniform_query_len: object,
            need_lse: object, env_backend: str | None) -> Selection:
    d = _dims(dims)
    model_dtype = parse_model_dtype(dtype)  # type: ignore[arg-type]
    kv = canonical_kv_cache_dtype(kv_cache_dtype)  # type: ignore[arg-type]
    bs = None if block_size is None else require_int("block_size", block_size, minimum=1)
    mql = require_int("max_query_len", max_query_len, minimum=1)
    flags = (("sparse", sparse), ("uniform_query_len", uniform_query_len), ("need_lse", need_lse))
    for flag_name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name}: got {type(flag).__name__}; supported bool")
    dev = resolve_device(device)
    v4 = isinstance(d, V4Dims)
    if v4:  # DeepSeek-V4: whole rows, every request absorbed (prefill included), sinks, window, compressed keys
        spec = AttentionSpec(num_heads=d.num_heads, kv_lora_rank=d.head_dim, qk_rope_head_dim=0, dtype=model_dtype,
                             kv_cache_dtype=kv, block_size=bs, max_query_len=max(mql, 2), uniform_query_len=False,
                             need_lse=need_lse, device=dev, sinks=True, window=True,  # type: ignore[arg-type]
                             compressed=bool(d.ratios))
        sparse = False
    else:
        spec = AttentionSpec(num_heads=d.num_heads, kv_lora_rank=d.kv_lora_rank,  # type: ignore[arg-type]
                             qk_rope_head_dim=d.qk_rope_head_dim, dtype=model_dtype, kv_cache_dtype=kv,
                             block_size=bs, sparse=sparse, max_query_len=mql,
                             uniform_query_len=uniform_query_len, need_lse=need_lse, device=dev)
    problems = registry.problems
    forced = _override(backend, env_backend)
    if forced is not None:
        return _forced(registry, spec, *forced, problems=problems)

    fp8 = spec.resolved_kv_cache_dtype in FP8_CACHE_DTYPES
    names = candidates(dev, fp8=fp8, sparse=sparse, registry=registry, v4=v4)  # type: ignore[arg-type]
    variant = "deepseek-v4" if v4 else ("sparse" if sparse else "dense")
    ladder = f"{ladder_for(dev).family}/{variant}{', fp8 cache' if fp8 and not v4 else ''}"
    verdicts = [_verdict(registry, n, spec) for n in names]
    chosen = next((i for i, v in enumerate(verdicts) if v.fits), None)
    if chosen is None:
        vt = tuple(verdicts)
        hint = _hint(registry, names, spec, vt)
        from .explain import format_failure

        msg = format_failure(dev, spec, vt, ladder, problems, f"Hint: {hint}")
        raise NoBackendError(msg, hint=hint, device=dev, spec=spec, verdicts=vt, ladder=ladder,
                             plugin_problems=problems)
    for i, v in enumerate(verdicts):  # hints only matter for candidates ranked above the chosen one
        if i >= chosen and v.page_size_hint is not None:
            verdicts[i] = replace(v, page_size_hint=None)
    verdicts[chosen] = replace(verdicts[chosen], selected=True)
    win = verdicts[chosen]
    return Selection(backend=registry.get(win.name), block_size=win.block_size,  # type: ignore[arg-type]
                     device=dev, spec=replace(spec, block_size=win.block_size), verdicts=tuple(verdicts),
                     ladder=ladder, plugin_problems=problems, requested_block_size=bs)


def _forced(registry: Registry, spec: AttentionSpec, backend: object, forced_by: str, *,
            problems: tuple[PluginProblem, ...]) -> Selection:
    """One verdict for a forced backend: a registered name, an alias, an import path or a class."""
    try:
        entry = registry.resolve(backend)  # type: ignore[arg-type]
    except (UnknownBackendError, ValueError, TypeError) as exc:
        if forced_by == MLA_BACKEND_ENV:
            raise type(exc)(f"{MLA_BACKEND_ENV} environment variable: {exc}") from None
        raise
    cls = entry.cls
    notes: tuple[str, ...] = ()
    if isinstance(backend, str):
        found = [name_clash_note(backend, spec.device.compute_capability)]
        if registry.entry(backend) is None:  # reached through an alias, not a registered name
            found.append(alias_note(backend))
        notes = tuple(f"{n}." for n in found if n is not None)
    reasons = evaluate(cls, spec)
    bs = spec.block_size if spec.block_size is not None else cls.capabilities.preferred_page_size
    verdict = Verdict(name=cls.name.upper(), source=entry.source, reasons=reasons, selected=not reasons,
                      block_size=bs)
    if reasons:
        from .explain import format_failure

        undo = ("unset MLA_BACKEND (or set it to 'auto')" if forced_by == MLA_BACKEND_ENV
                else "pass backend=None or 'auto'")
        who = ("the MLA_BACKEND environment variable" if forced_by == MLA_BACKEND_ENV
               else "the backend argument")
        footer = (f"{verdict.name} was forced by {who} and does not fit (no silent fallback); "
                  f"{undo} to let the selector choose.")
        msg = format_failure(spec.device, spec, (verdict,), "forced", problems,
                             "\n".join([*(f"Note: {n}" for n in notes), footer]))
        raise BackendNotSupportedError(msg, backend=verdict.name, reasons=reasons, forced_by=forced_by,
                                       device=spec.device, spec=spec, verdicts=(verdict,), ladder="forced",
                                       plugin_problems=problems, notes=notes)
    return Selection(backend=cls, block_size=bs, device=spec.device, spec=replace(spec, block_size=bs),
                     verdicts=(verdict,), ladder="forced", forced_by=forced_by, plugin_problems=problems,
                     requested_block_size=spec.block_size, notes=notes)
