"""The engine-neutral core of the engine adapters (:mod:`.vllm`, :mod:`.sglang`), written once; imports no engine.

An adapter is an engine's own attention backend class that hands the engine's MLA layers to a backend
``select_backend()`` chose. What every such adapter needs, whatever the engine, is here:

- :class:`EngineInfo`: what the core knows of one engine (its name, switch, error class, cache dtype names);
  each adapter package defines one (``vllm.ENGINE``, ``sglang.ENGINE``).
- :class:`EngineAdapterError`: the base of each engine's start-up error (``VLLMSelectionError``,
  ``SGLangSelectionError``), and :class:`UnsupportedEngineVersionError` with :class:`VersionGate`, the version
  check each engine's ``versions`` module fills with its data.
- :class:`EngineRequest`: what one rank of an engine asks ``select_backend()`` (dims with this rank's heads,
  dtype, cache dtype, page size, LSE, device); :meth:`EngineRequest.select` turns a refusal into the engine's
  error with the selection's reasons.
- :func:`configured_backend`: **the one place** a selection becomes the configured backend instance the adapter
  plans with and runs (one per process and ``(class, spec, scale)``: vLLM's metadata builder and every layer's
  impl get the same object, so the plan's prepared state is always the one the impls run).
- :class:`Internal` and :func:`check_internals`: the engine internals an adapter touches, one table per engine
  (``vllm/internals.py``, ``sglang/internals.py``), checked at start-up: a missing or renamed one refuses
  start-up naming it, so the hot path reads them plainly, never with a default.
- The start-up checks and the hot path's helpers: :func:`check_softmax_scale`, :func:`fp8_scale`,
  :func:`device_name`, :func:`log_once`, :func:`startup_line` and :class:`LayerCaches` (each layer's cache tensor
  wrapped as a :class:`~mla_backends.step.cache.LatentKVCache` once, not per call).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.contract import configure_backend
from ..core.dims import MLADims
from ..core.dtypes import FP8_CACHE_DTYPES
from ..core.validation import require_device, require_int
from ..step.cache import LatentKVCache

__all__ = ["EngineInfo", "EngineAdapterError", "UnsupportedEngineVersionError", "VersionGate", "EngineRequest",
           "engine_kv_cache_dtype", "configured_backend", "Internal",
           "check_internals", "internals_table", "internal_names", "check_softmax_scale", "fp8_scale",
           "device_name", "log_once", "startup_line", "chosen_line", "LayerCaches", "wrap_engine_cache",
           "FP8_STORAGE"]


class EngineAdapterError(RuntimeError):
    """mla-backends cannot run this engine configuration: raised at the engine's start-up (the selection's
    reasons, an engine internal that is missing, a scale the library cannot honour). Each engine's adapter
    raises its own subclass (``VLLMSelectionError``, ``SGLangSelectionError``)."""


class UnsupportedEngineVersionError(RuntimeError):
    """The installed engine is outside the adapter's supported range (each engine has its subclass)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the core knows of one engine.

    Attributes:
        name: the engine as users write it (``"vLLM"``, ``"SGLang"``).
        switch: the environment variable that turns its plugin on.
        error: its start-up error, a subclass of :class:`EngineAdapterError`.
        kv_names: its cache dtype names -> mla-backends' canonical names (``auto`` stays ``auto``).
        page_word: what it calls a cache page in messages (``"block size"``, ``"page size"``).
        runs: what the adapter runs on mla-backends, for the start-up line (``"MLA decode"``).
    """

    name: str
    switch: str
    error: type[EngineAdapterError]
    kv_names: Mapping[str, str]
    page_word: str
    runs: str


# ---- versions ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VersionGate:
    """The versions of an engine an adapter runs on (data; :meth:`check` is the one check).

    ``tested`` and ``read`` hold version prefixes of ``parts`` numbers each (``(0, 32)`` = 0.32.x; ``(0, 5, 23)``
    = 0.5.23): run end to end, or checked by reading the engine's source. ``prereleases``: whether ``rc``/``dev``
    builds of a listed version count.
    """

    engine: str
    package: str
    supported_range: str
    tested: tuple[tuple[int, ...], ...]
    switch: str
    install: str
    error: type[UnsupportedEngineVersionError]
    read: tuple[tuple[int, ...], ...] = ()
    prereleases: bool = True

    @property
    def parts(self) -> int:
        return len(self.tested[0])

    def coverage(self) -> str:
        """``0.32.x tested, 0.33.x checked by reading its interfaces`` (what the error message says)."""
        def show(key: tuple[int, ...]) -> str:
            return ".".join(map(str, key)) + (".x" if len(key) < 3 else "")

        text = ", ".join(show(k) for k in self.tested) + " tested"
        if self.read:
            text += ", " + ", ".join(show(k) for k in self.read) + " checked by reading its interfaces"
        return text

    def check(self, version: object) -> str:
        """``"tested"`` or ``"read"`` for a supported ``version`` string (a post or local suffix allowed);
        :attr:`error` naming the range otherwise, and TypeError for a non-string."""
        if not isinstance(version, str):
            raise TypeError(f"version: got {type(version).__name__}; supported a version string such as "
                            f"'{'.'.join(map(str, self.tested[0]))}'")
        m = re.match(r"\s*v?" + r"\.".join([r"(\d+)"] * self.parts) + r"(?![\d])", version)
        key = tuple(int(g) for g in m.groups()) if m else None
        pre = bool(m) and bool(re.match(r"\s*\.?(a|b|rc|dev)", version[m.end():]))
        if key is not None and (self.prereleases or not pre):
            if key in self.tested:
                return "tested"
            if key in self.read:
                return "read"
        raise self.error(f"{self.engine} version: got {version}; supported {self.package}{self.supported_range} "
                         f"({self.coverage()}). Unset {self.switch} to run {self.engine} without mla-backends, or "
                         f"install {self.install}.")


# ---- the request and the selection ---------------------------------------------------------------------------
def engine_kv_cache_dtype(engine: EngineInfo, name: object) -> str:
    """mla-backends' cache dtype name for ``engine``'s cache dtype ``name`` (stripped, lower-cased). TypeError
    for a non-string; ``engine.error`` for a name it does not map."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype: got {type(name).__name__}; supported a {engine.name} cache dtype name "
                        f"({', '.join(engine.kv_names)})")
    key = engine.kv_names.get(name.strip().lower())
    if key is None:
        raise engine.error(f"kv cache dtype: got {engine.name}'s {name!r}; supported {', '.join(engine.kv_names)} "
                           "(mla-backends' latent cache formats)")
    return key


@dataclass(frozen=True)
class EngineRequest:
    """What one rank of an engine asks ``select_backend()``.

    Attributes:
        engine: the engine asking.
        dims: the model's dims with this rank's query heads (``dims.num_heads``; under decode context
            parallelism the group's gathered heads).
        dtype: the model dtype; kv_cache_dtype: mla-backends' canonical name or ``auto``.
        block_size: the engine's page size (tokens), None when the engine has not fixed it yet.
        need_lse: the engine needs each query's log-sum-exp (decode context parallelism).
        device: ``"cpu"`` or ``"cuda:N"`` (:func:`device_name`).
    """

    engine: EngineInfo
    dims: MLADims
    dtype: torch.dtype
    kv_cache_dtype: str
    block_size: int | None
    device: str
    need_lse: bool = False

    def select(self) -> Any:
        """``select_backend()``'s :class:`~selector.select.Selection` for this request (cached by the selector;
        ``MLA_BACKEND`` forces a backend); a refusal, an unknown forced backend or bad arguments raise the
        engine's error: ``mla-backends cannot run this <engine> MLA model (<request>): <reasons>``."""
        from selector import select_backend
        from selector.select import SelectionError

        from ..plugins.registry import UnknownBackendError

        try:
            return select_backend(dims=self.dims, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                                  block_size=self.block_size, device=self.device, need_lse=self.need_lse)
        except (SelectionError, UnknownBackendError, ValueError, TypeError) as exc:
            raise self.engine.error(f"mla-backends cannot run this {self.engine.name} MLA model "
                                    f"({self.describe()}): {exc}") from exc

    def describe(self) -> str:
        d = self.dims
        page = f"{self.engine.name}'s choice" if self.block_size is None else str(self.block_size)
        return (f"{d.num_heads} heads on this rank, kv_lora_rank {d.kv_lora_rank}, rope {d.qk_rope_head_dim}, "
                f"dtype {str(self.dtype).removeprefix('torch.')}, kv cache {self.kv_cache_dtype}, "
                f"{self.engine.page_word} {page}, device {self.device}")



def configured_backend(selection: Any, scale: float) -> Any:
    """The configured backend for ``selection`` and softmax ``scale``: the one place an adapter turns a selection
    into the object it plans with (``plan_step``) and runs (``forward_mqa``).
    :func:`~mla_backends.backends.contract.configure_backend` returns one immutable object per configuration
    while it is held, so every participant of an engine's step (vLLM's metadata builder and each layer's impl;
    SGLang's backend) holds the same object and the plan's prepared state is always the one the layers run."""
    return configure_backend(selection.backend, selection.spec, float(scale))


# ---- engine internals ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Internal:
    """One engine internal an adapter touches (a row of an engine's table).

    Attributes:
        owner: where it lives: ``"package.module:Name"`` (a module attribute, checked by importing it) or a
            role (``"layer"``, ``"runner"``, ``"impl"`` ...: checked on the object the adapter is handed at
            start-up, :func:`check_internals`).
        attr: the attribute on the owner, dotted for nested ones (``"forward_mode.is_decode"``); ``""`` for a
            module-level owner itself. A dataclass field without a default counts as present on the class.
        use: what the adapter does with it and when (``"read per step"``, ``"overridden"``, ...).
    """

    owner: str
    attr: str
    use: str

    @property
    def name(self) -> str:
        owner = self.owner.split(":", 1)[1] if ":" in self.owner else self.owner
        return f"{owner}.{self.attr}" if self.attr else owner


def _has(obj: Any, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return attr in {f.name for f in dataclasses.fields(obj)}
    return False


def _resolve(obj: Any, path: str) -> tuple[bool, str]:
    """(found, the first missing part) of dotted ``path`` on ``obj`` (a class's dataclass fields count)."""
    for part in path.split(".") if path else ():
        if not _has(obj, part):
            return False, part
        try:
            obj = getattr(obj, part)
        except AttributeError:  # a dataclass field without a class default: present on every instance
            obj = None
    return True, ""


def check_internals(engine: EngineInfo, table: Iterable[Internal], *, role: str | None = None, obj: Any = None,
                    where: str = "") -> None:
    """Check that every row of ``table`` is present: with ``role`` None the module-level rows (imported), else
    the rows of that role on ``obj``. The first missing one raises ``engine.error`` naming it, its use and
    ``where`` (the engine refuses to start; nothing on the hot path reads these with a default)."""
    for row in table:
        is_module = ":" in row.owner
        if role is None and not is_module or role is not None and row.owner != role:
            continue
        target = obj
        if is_module:
            module, _, qual = row.owner.partition(":")
            try:
                target = importlib.import_module(module)
            except ImportError as exc:
                raise engine.error(f"mla-backends: {engine.name} internal {row.name} cannot be imported ({exc}); "
                                   f"the adapter {row.use}: supported {engine.name} versions that have it") from exc
            path = ".".join(p for p in (qual, row.attr) if p)
        else:
            path = row.attr
        found, missing = _resolve(target, path)
        if not found:
            on = f" on {where}" if where else ""
            raise engine.error(f"mla-backends: {engine.name} internal {row.name} is missing{on} ({missing!r} not "
                               f"found); the adapter {row.use}: supported {engine.name} versions that have it")


def internals_table(groups: Mapping[str, Mapping[str, str]]) -> tuple[Internal, ...]:
    """An engine's table written as ``{owner: {attribute: use}}`` (an attribute ``""``: the owner itself)."""
    return tuple(Internal(owner, attr, use) for owner, rows in groups.items() for attr, use in rows.items())


def internal_names(table: Iterable[Internal]) -> list[str]:
    """The names of ``table``'s rows, for docs and tests."""
    return [row.name for row in table]


# ---- start-up checks and hot-path helpers -------------------------------------------------------------------
def check_softmax_scale(engine: EngineInfo, engine_scale: object, model_scale: float) -> float:
    """``model_scale`` (``MLADims.softmax_scale``) when the engine's layer scale equals it to 1e-5 (checked once
    per layer at start-up); else ``engine.error`` naming both."""
    if isinstance(engine_scale, bool) or not isinstance(engine_scale, (int, float)):
        raise engine.error(f"mla-backends: {engine.name}'s softmax scale is {engine_scale!r}; supported a float")
    if not math.isclose(float(engine_scale), model_scale, rel_tol=1e-5):
        raise engine.error(f"mla-backends: {engine.name}'s softmax scale {engine_scale} differs from the model "
                           f"config's {model_scale} (MLADims.softmax_scale); supported equal scales")
    return model_scale


def fp8_scale(engine: EngineInfo, value: object, *, attr: str, where: str) -> float:
    """The fp8 cache scale ``value`` read from the engine's layer attribute ``attr`` (``where``: which layer),
    checked: a positive finite float, else ``engine.error`` naming the attribute (an unknown scale would misread
    every cache value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise engine.error(f"mla-backends: {where} has {attr} = {value!r}; supported a positive finite float (the "
                           f"per-tensor fp8 scale the KV cache is written and read with)")
    return float(value)


def device_name(device: object) -> str:
    """``"cpu"`` or ``"cuda:N"`` (the index filled in from the current device) for an engine's device."""
    dev = require_device("device", device)
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return dev.type


_LOGGED: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, line: str) -> bool:
    """Log ``line`` at info level the first time this process sees it on ``logger``; True when it was logged."""
    key = (logger.name, line)
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    logger.info(line)
    return True


def chosen_line(selection: Any) -> str:
    """The ``Chosen:`` line of ``selection.explain()`` (``Chosen: <name>`` when it has none)."""
    return next((ln.strip() for ln in selection.explain().splitlines() if ln.strip().startswith("Chosen:")),
                f"Chosen: {selection.name}")


def startup_line(engine: EngineInfo, member: str, selection: Any, *, model: str | None = None,
                 num_heads: int | None = None, extra: str = "") -> str:
    """The one start-up log line: the engine's backend ``member`` taken, the model, this rank's query heads,
    the selection's ``Chosen:`` line and ``extra`` (two models, or two head counts, each get their own line)."""
    parts = ([f"model {model}"] if model is not None else []) + (
        [f"{num_heads} heads on this rank"] if num_heads is not None else [])
    who = f" ({', '.join(parts)})" if parts else ""
    return (f"mla-backends: {engine.name} attention backend {member} runs {engine.runs} on mla-backends{who}. "
            f"{chosen_line(selection)}{extra}")


#: torch storage dtype of each fp8 cache format
FP8_STORAGE: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
assert set(FP8_STORAGE) == set(FP8_CACHE_DTYPES)


def wrap_engine_cache(data: torch.Tensor, *, kv_lora_rank: int, model_dtype: torch.dtype, scale: float,
                      previous: LatentKVCache | None = None) -> LatentKVCache:
    """``data`` (an engine's layer cache ``[pages, page_size, kv_lora_rank + rope]``, fp8 already viewed as
    fp8) as a :class:`LatentKVCache` sharing its memory (``LatentKVCache.from_tensor``'s checks); ``previous``
    is returned as it is when it wraps the very same view (address, shape, strides, dtype) with the same scale.
    ``scale`` applies to fp8 caches only."""
    fp8 = data.dtype in FP8_STORAGE.values()
    scale = scale if fp8 else 1.0
    if (previous is not None and previous.data.data_ptr() == data.data_ptr() and previous.data.shape == data.shape
            and previous.data.stride() == data.stride() and previous.data.dtype == data.dtype
            and previous.scale_value == scale):
        return previous
    return LatentKVCache.from_tensor(data, kv_lora_rank=kv_lora_rank, model_dtype=model_dtype, scale=scale)


class LayerCaches:
    """Each layer's cache tensor wrapped once: :meth:`get` returns the wrapper made for that layer, re-made (and
    re-checked) only when the engine hands another tensor or scale. ``kv_lora_rank`` and ``model_dtype`` are
    the model's, fixed at start-up."""

    def __init__(self, kv_lora_rank: int, model_dtype: torch.dtype) -> None:
        self.kv_lora_rank = require_int("kv_lora_rank", kv_lora_rank, minimum=1)
        self.model_dtype = model_dtype
        self._by_layer: dict[Hashable, LatentKVCache] = {}

    def get(self, layer: Hashable, data: torch.Tensor, scale: float) -> LatentKVCache:
        """The wrapper of ``layer``'s cache ``data`` read and written with fp8 ``scale``."""
        cache = wrap_engine_cache(data, kv_lora_rank=self.kv_lora_rank, model_dtype=self.model_dtype, scale=scale,
                                  previous=self._by_layer.get(layer))
        self._by_layer[layer] = cache
        return cache
