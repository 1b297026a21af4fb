"""Measured absorbed/expanded crossover (``mla-backends tune``) and the threshold table the layer loads.

The cost model (:mod:`mla_backends.costs`) says where the two paths of an MLA layer cost the same FLOPs; the
engines hard-code a per-backend "decode threshold" instead and mark it "tune this". This module measures it:
for each available backend it runs :class:`~mla_backends.layer.MLAAttention` on one request with ``Q`` new
tokens over ``S`` cached tokens, once with the dispatch forced to the absorbed path (``forward_mqa`` between
the folds) and once forced to the expanded path (``forward_mha``), and finds the ``Q`` where they cost the
same. The projections and RoPE are identical on both runs, so they add to both times without moving the
crossover.

The result is a :class:`TunedThresholds`, written as JSON::

    {"format": "mla-backends/threshold-table/v1", "date": "...", "device": {...}, "versions": {...},
     "model": {...}, "grid": {"query_lens": [...], "contexts": [...]},
     "backends": {"REF_TORCH": {"entries": [{"max_context": 512, "threshold": 40}, ...],
                                "crossovers": [...], "timings": [...]}}}

A layer given the table (``MLAAttention(..., threshold_table=path)`` or the environment variable
``MLA_BACKENDS_THRESHOLD_TABLE``) dispatches with :class:`~mla_backends.dispatch.PerRequestPolicy` over its
backend's entries: a request whose query length is ``<=`` the threshold for its context runs absorbed.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as _md
from typing import Any, TextIO

from .dispatch import PerRequestPolicy
from .dispatch import ThresholdTable as ContextThresholds
from .validation import require_int

__all__ = [
    "THRESHOLD_TABLE_ENV",
    "TABLE_FORMAT",
    "DEFAULT_QUERY_LENS",
    "DEFAULT_CONTEXTS",
    "DEFAULT_REPEATS",
    "QUICK_QUERY_LENS",
    "QUICK_CONTEXTS",
    "Timing",
    "Crossover",
    "TunedThresholds",
    "measured_crossover",
    "context_buckets",
    "policy_from_table",
    "table_from_env",
    "layer_policy",
    "tunable_backends",
    "PathTimer",
    "ProgressBar",
    "tune",
]

log = logging.getLogger(__name__)

#: environment variable naming a threshold-table JSON file every new layer loads
THRESHOLD_TABLE_ENV = "MLA_BACKENDS_THRESHOLD_TABLE"
TABLE_FORMAT = "mla-backends/threshold-table/v1"

#: default grid: 1-2 minutes on a 2-core CPU for DeepSeek-V3 at TP=8 (16 heads) in float32, repeats 2
DEFAULT_QUERY_LENS: tuple[int, ...] = (1, 4, 16, 64, 128, 192, 256, 384)
DEFAULT_CONTEXTS: tuple[int, ...] = (256, 1024, 4096)
DEFAULT_REPEATS = 2
#: a few seconds; for tests and smoke runs
QUICK_QUERY_LENS: tuple[int, ...] = (1, 4, 16)
QUICK_CONTEXTS: tuple[int, ...] = (64, 256)


# ---- measured results ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Best-of-``repeats`` wall time (seconds) of one layer call on each path."""

    context_len: int
    query_len: int
    absorbed_s: float
    expanded_s: float

    @property
    def ratio(self) -> float:
        """``absorbed / expanded``: below 1 the absorbed path is faster."""
        return self.absorbed_s / self.expanded_s


@dataclass(frozen=True)
class Crossover:
    """Where the two paths meet at one context length.

    ``measured``: interpolated query length at which the times are equal, or None when the grid never crosses
    (``bound`` then says ``"above"``: absorbed faster on the whole grid, or ``"below"``: expanded faster even
    at the smallest ``Q``). ``threshold``: the largest integer ``Q`` run absorbed. ``modelled``: the causal
    FLOP model's crossover (:func:`mla_backends.costs.crossover_query_len` with ``causal=True``).
    """

    context_len: int
    measured: float | None
    bound: str
    threshold: int
    modelled: float


def measured_crossover(query_lens: Sequence[int], ratios: Sequence[float]) -> tuple[float | None, str, int]:
    """First crossing of ``absorbed / expanded`` through 1 along increasing ``query_lens``.

    Interpolates ``log(ratio)`` linearly in ``log(Q)`` between the last grid point where absorbed was faster
    and the first where it was not. Returns ``(crossover or None, bound, threshold)`` as in
    :class:`Crossover`.
    """
    if len(query_lens) != len(ratios) or not query_lens:
        raise ValueError(
            f"query_lens/ratios: got {len(query_lens)} and {len(ratios)}; supported equal, non-empty"
        )
    if any(q <= 0 for q in query_lens) or list(query_lens) != sorted(set(query_lens)):
        raise ValueError(f"query_lens: got {list(query_lens)}; supported increasing positive ints")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"ratios: got {list(ratios)}; supported positive finite numbers")
    if ratios[0] >= 1.0:
        return None, "below", query_lens[0] - 1
    for i in range(1, len(query_lens)):
        if ratios[i] >= 1.0:
            q0, q1 = query_lens[i - 1], query_lens[i]
            l0, l1 = math.log(ratios[i - 1]), math.log(ratios[i])
            frac = -l0 / (l1 - l0) if l1 != l0 else 1.0
            cross = math.exp(math.log(q0) + frac * (math.log(q1) - math.log(q0)))
            return cross, "", max(q0, math.floor(cross + 1e-9))
    return None, "above", query_lens[-1]


def context_buckets(contexts: Sequence[int], thresholds: Sequence[int]) -> ContextThresholds:
    """Per-context thresholds -> the dispatch table: each measured context covers the contexts up to the
    geometric midpoint with the next one; beyond the last, the last threshold applies."""
    pairs = sorted(zip(contexts, thresholds, strict=True))
    entries = []
    for i, (s, th) in enumerate(pairs):
        bound = s if i == len(pairs) - 1 else math.floor(math.sqrt(s * pairs[i + 1][0]))
        entries.append((bound, th))
    return ContextThresholds(tuple(entries))


# ---- the table -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TunedThresholds:
    """Measured decode thresholds per backend, with where and when they were measured.

    ``backends`` maps a backend name (upper case) to its per-context
    :class:`mla_backends.dispatch.ThresholdTable`; ``info`` holds the provenance (device, versions, date,
    model, grid) and the raw measurements, kept verbatim in the JSON.
    """

    backends: Mapping[str, ContextThresholds]
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backends, Mapping) or not self.backends:
            raise ValueError("backends: got none; supported at least one backend's thresholds")
        for name, t in self.backends.items():
            if not isinstance(t, ContextThresholds):
                raise TypeError(
                    f"backends[{name!r}]: got {type(t).__name__}; supported "
                    f"mla_backends.dispatch.ThresholdTable"
                )

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.backends))

    def for_backend(self, backend_name: str) -> ContextThresholds | None:
        """The backend's per-context table, or None when this table has no measurement for it."""
        return self.backends.get(str(backend_name).strip().upper())

    def threshold_for(self, backend_name: str, context_len: int) -> int:
        """Largest query length run absorbed for a request with ``context_len`` cached tokens."""
        if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len: got {context_len!r}; supported an int >= 0")
        t = self.for_backend(backend_name)
        if t is None:
            raise ValueError(
                f"backend_name: got {backend_name!r}; supported {', '.join(self.backend_names)} "
                f"(the backends this table measured)"
            )
        return t.threshold(context_len)

    # ---- JSON --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": TABLE_FORMAT}
        out.update({k: v for k, v in self.info.items() if k not in ("format", "backends")})
        results = self.info.get("backends", {})
        out["backends"] = {}
        for name in self.backend_names:
            entry = dict(results.get(name, {}))
            entry["entries"] = self.backends[name].to_dict()["entries"]
            out["backends"][name] = entry
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TunedThresholds:
        if not isinstance(data, Mapping):
            raise ValueError(f"table: got {type(data).__name__}; supported a JSON object")
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"table.format: got {data.get('format')!r}; supported {TABLE_FORMAT!r}")
        raw = data.get("backends")
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError("table.backends: got none; supported {name: {'entries': [...]}, ...}")
        backends = {str(k).upper(): ContextThresholds.from_dict(v) for k, v in raw.items()}
        info = {k: v for k, v in data.items() if k != "format"}
        info["backends"] = {
            str(k).upper(): {kk: vv for kk, vv in v.items() if kk != "entries"} for k, v in raw.items()
        }
        return cls(backends, info)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunedThresholds:
        """Read a table written by ``mla-backends tune --output``."""
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise ValueError(
                f"threshold_table: got {p!r}, which is not a file; supported a JSON file written "
                f"by 'mla-backends tune --output'"
            )
        try:
            with open(p, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"threshold_table: got {p!r}, not valid JSON ({exc}); supported a table "
                f"written by 'mla-backends tune --output'"
            ) from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")


def policy_from_table(
    table: TunedThresholds | str | os.PathLike[str], backend_name: str, *, strict: bool = True
) -> PerRequestPolicy | None:
    """The dispatch policy a layer running ``backend_name`` uses under ``table`` (a table or a path).

    When the table has no measurement for the backend: ``strict`` raises ValueError naming the measured
    backends; otherwise a warning is logged and None returned (the backend's constant then applies).
    """
    if not isinstance(table, TunedThresholds):
        if not isinstance(table, (str, os.PathLike)):
            raise TypeError(
                f"threshold_table: got {type(table).__name__}; supported a path or a TunedThresholds"
            )
        table = TunedThresholds.load(table)
    ctx = table.for_backend(backend_name)
    if ctx is None:
        msg = (
            f"threshold_table: has no measurement for backend {backend_name!r}; supported "
            f"{', '.join(table.backend_names)}"
        )
        if strict:
            raise ValueError(msg)
        log.warning("%s; using the backend's own decode threshold", msg)
        return None
    return PerRequestPolicy(table=ctx)


def table_from_env() -> str | None:
    """The path in ``MLA_BACKENDS_THRESHOLD_TABLE``, or None when unset or empty."""
    value = os.environ.get(THRESHOLD_TABLE_ENV, "").strip()
    return value or None


def layer_policy(
    threshold_table: TunedThresholds | str | os.PathLike[str] | None, dispatch: Any, backend_name: str
) -> PerRequestPolicy | None:
    """The table-driven policy a new layer uses, or None to keep its ``dispatch`` (``MLAAttention`` calls it).

    - ``threshold_table`` given: it must hold ``backend_name``'s measurement (else ValueError), and
      ``dispatch`` must be None (both given: ValueError).
    - otherwise, when ``dispatch`` is None and ``MLA_BACKENDS_THRESHOLD_TABLE`` names a file, that table is
      used if it measured this backend (a warning is logged and the backend's constant kept if not).
    """
    if threshold_table is not None:
        if dispatch is not None:
            raise ValueError(
                "threshold_table/dispatch: got both; supported one of them (a table implies the "
                "per-request policy)"
            )
        return policy_from_table(threshold_table, backend_name, strict=True)
    env = table_from_env()
    if env is None or dispatch is not None:
        return None
    return policy_from_table(env, backend_name, strict=False)


# ---- measuring -------------------------------------------------------------------------------------------
def tunable_backends(
    dims: Any, dtype: Any, device: Any, names: Sequence[str] | None = None
) -> dict[str, str]:
    """Backends that can run ``dims`` here, mapped to ``""``; with ``names``, unusable ones map to the reason.

    A backend qualifies when its packages are installed and it accepts the device, dtype, head count and
    multi-token queries (single-token backends have no absorbed path for ``Q > 1``).
    """
    import torch

    from selector.device import device_info_for

    from .backend import AttentionSpec
    from .registry import get_backend, registered_backends

    info = device_info_for(torch.device(device))
    spec = AttentionSpec(
        num_heads=dims.num_heads,
        kv_lora_rank=dims.kv_lora_rank,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        dtype=dtype,
        max_query_len=2,
        uniform_query_len=True,
        device=info,
    )
    classes = {n: get_backend(n) for n in names} if names else registered_backends()
    out: dict[str, str] = {}
    for cls in classes.values():
        reasons = cls.not_supported_reasons(spec)
        if names or not reasons:
            out[cls.name] = "; ".join(map(str, reasons))
    return out


class PathTimer:
    """The two attention paths of one :class:`~mla_backends.layer.MLAAttention`, timed on one request.

    The layer (random weights, ``dims`` heads, on ``backend``) gets a one-request cache holding
    ``max_tokens`` random rows. ``time(context_len, query_len)`` runs exactly what the layer's forward runs
    for an absorbed request (``q_nope @ W_UK_T``, ``backend.forward_mqa``, ``@ W_UV``: ``layer._absorbed``)
    and for an expanded one (:func:`~mla_backends.prefill.forward_mha` with the layer's ``kv_b_proj`` and
    workspace), alternating the two ``repeats`` times after a warm-up and keeping each path's best time.
    The projections, RoPE and cache write are the same for both paths and are left out (which is also why
    the layer is built with a small ``hidden_size``: it only feeds the projections).
    """

    def __init__(
        self,
        dims: Any,
        backend: str,
        *,
        dtype: Any,
        device: Any,
        max_tokens: int,
        block_size: int | None = None,
        repeats: int = 3,
        seed: int = 0,
    ) -> None:
        import dataclasses

        import torch

        from .hf_loading import random_hf_state_dict
        from .layer import MLAAttention
        from .prefill import PrefillWorkspace
        from .registry import get_backend

        require_int("repeats", repeats, minimum=1)
        require_int("max_tokens", max_tokens, minimum=1)
        if block_size is not None:
            require_int("block_size", block_size, minimum=1)
        self.torch = torch
        self.device = torch.device(device)
        cls = get_backend(backend)
        self.block_size = block_size or cls.capabilities.preferred_page_size
        self.repeats = repeats
        self.max_tokens = max_tokens
        small = dataclasses.replace(
            dims,
            hidden_size=min(dims.hidden_size, 256),
            q_lora_rank=None if dims.q_lora_rank is None else min(dims.q_lora_rank, 256),
            indexer=None,  # the dense threshold is what is tuned; V3.2's indexer plays no part in it
        )
        self.layer = MLAAttention(small, backend=cls, dtype=dtype, device=self.device)
        sd = random_hf_state_dict(small, dtype=self.layer.dtype, seed=seed)
        self.layer.load_hf_state_dict({k: v.to(self.device) for k, v in sd.items()})
        pages = -(-max_tokens // self.block_size) + 1
        self.cache = self.layer.allocate_cache(pages, self.block_size)
        self.block_table = torch.arange(pages, dtype=torch.int32, device=self.device).view(1, pages)
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        dt = self.layer.dtype
        H, P, R, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.kv_lora_rank
        rows = (torch.randn(pages * self.block_size, r + R, generator=g) * 0.5).to(self.device, dt)
        self.cache.write(rows[:, :r], rows[:, r:], torch.arange(pages * self.block_size, device=self.device))
        self.q = torch.randn(max_tokens, H, P + R, generator=g).to(self.device, dt)
        self.rows = rows  # [positions, r + R]: what the cache holds, so both paths see the same new tokens
        self.workspace = PrefillWorkspace(self.layer.workspace_rows(self.block_size))
        self.P, self.r = P, r

    def absorbed(self, meta: Any, q: int) -> Any:
        """The layer's absorbed path for ``q`` query tokens: ``[q, H, v_head_dim]``."""
        P = self.P
        return self.layer._absorbed(self.q[:q, :, :P], self.q[:q, :, P:], self.cache, meta, None)

    def expanded(self, meta: Any, q: int) -> Any:
        """The layer's expanded path (``forward_mha``) for ``q`` query tokens: ``[q, H, v_head_dim]``."""
        from .prefill import forward_mha

        start = meta.context_lens_list[0]
        rows = self.rows[start : start + q]  # the new tokens' rows, as already written to the cache
        return forward_mha(
            self.q[:q],
            rows[:, : self.r],
            rows[:, self.r :],
            self.cache,
            meta,
            self.layer.kv_b_proj.weight,
            scale=self.layer.scale,
            workspace=self.workspace,
        )

    def time(self, context_len: int, query_len: int, *, warmup: bool = True) -> Timing:
        """Best of ``repeats`` alternating calls per path (after one warm-up round when ``warmup``)."""
        from .metadata import BatchMetadata

        if context_len + query_len > self.max_tokens:
            raise ValueError(
                f"context_len + query_len: got {context_len + query_len}; supported <= "
                f"max_tokens {self.max_tokens}"
            )
        torch = self.torch
        meta = BatchMetadata.build(
            [query_len], [context_len], self.block_table, self.block_size, decode_threshold=query_len
        )
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        best = {"a": math.inf, "e": math.inf}
        with torch.inference_mode():
            for i in range(self.repeats + int(warmup)):
                for key, fn in (("a", self.absorbed), ("e", self.expanded)):
                    sync()
                    t0 = time.perf_counter()
                    fn(meta, query_len)
                    sync()
                    if i or not warmup:  # a warm-up round is not kept
                        best[key] = min(best[key], time.perf_counter() - t0)
        return Timing(context_len, query_len, best["a"], best["e"])


class ProgressBar:
    """A one-line progress bar on stderr (redrawn with ``\\r``); silent when disabled."""

    def __init__(
        self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()

    def update(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(self.width * frac)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {label:<36}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _versions() -> dict[str, str]:
    import torch

    from . import __version__

    out = {"mla_backends": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for dist in ("triton", "flashinfer-python"):
        try:
            out[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            pass
    return out


def _device_record(device: Any) -> dict[str, Any]:
    import torch

    from selector.device import device_info_for

    info = device_info_for(torch.device(device))
    rec: dict[str, Any] = {"kind": info.kind, "name": info.name}
    if info.is_cuda:
        rec.update(
            compute_capability=list(info.compute_capability),
            sm_count=info.sm_count,
            total_memory=info.total_memory,
        )
    else:
        rec.update(
            processor=platform.processor() or platform.machine(),
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
        )
    return rec


def _timing_record(dims: Any, t: Timing) -> dict[str, Any]:
    """A timing plus the causal FLOP model's count for each path (for effective GFLOP/s)."""
    from . import costs

    q, s = t.query_len, t.context_len
    return {**vars(t), "absorbed_flops": costs.absorbed_path_flops(dims, q, s, causal=True),
            "expanded_flops": costs.expanded_path_flops(dims, q, s, causal=True)}


def tune(
    dims: Any,
    *,
    backends: Iterable[str],
    query_lens: Sequence[int] = DEFAULT_QUERY_LENS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    dtype: Any = None,
    device: Any = "cpu",
    block_size: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    progress: bool = True,
    on_timing: Callable[[str, Timing], None] | None = None,
) -> TunedThresholds:
    """Measure every backend over the grid and build the :class:`TunedThresholds`.

    Args:
        dims: the layer's :class:`~mla_backends.dims.MLADims`; a tensor-parallel view
            (``dims.tensor_parallel(tp)``) times what one rank computes.
        backends: backend names to measure.
        query_lens / contexts: the grid (non-empty, positive ints; sorted and deduplicated here).
        dtype: model dtype (default float32 on the CPU, bfloat16 on CUDA).
        block_size: page size in tokens (>= 1; None = each backend's preferred size).
        repeats: passes over the grid (>= 1); each point keeps its best time per path (the first pass warms
            up).

    Raises ``ValueError``/``TypeError`` for a bad argument before anything is timed.
    """
    import torch

    from . import costs
    from .dtypes import dtype_name, parse_model_dtype

    names = [str(b).upper() for b in backends]
    if not names:
        raise ValueError("backends: got none; supported at least one backend name")
    qs = sorted({require_int(f"query_lens[{i}]", q, minimum=1) for i, q in enumerate(query_lens)})
    ss = sorted({require_int(f"contexts[{i}]", c, minimum=1) for i, c in enumerate(contexts)})
    if not qs or not ss:
        raise ValueError(
            f"query_lens/contexts: got {list(query_lens)} / {list(contexts)}; supported non-empty lists"
        )
    require_int("repeats", repeats, minimum=1)
    if block_size is not None:
        require_int("block_size", block_size, minimum=1)
    dev = torch.device(device)
    model_dtype = parse_model_dtype(dtype, default=torch.float32 if dev.type == "cpu" else torch.bfloat16)
    bar = ProgressBar(len(names) * len(qs) * len(ss) * repeats, enabled=progress)
    per_backend: dict[str, ContextThresholds] = {}
    results: dict[str, Any] = {}
    for name in names:
        timer = PathTimer(
            dims,
            name,
            dtype=model_dtype,
            device=dev,
            max_tokens=ss[-1] + qs[-1],
            block_size=block_size,
            repeats=1,
        )
        # ``repeats`` passes over the whole grid, keeping each point's best: a burst of load on a shared
        # machine then spoils one pass of a point, not all its samples
        best: dict[tuple[int, int], Timing] = {}
        for rep in range(repeats):
            for s in ss:
                for q in qs:
                    t = timer.time(s, q, warmup=rep == 0)
                    old = best.get((s, q))
                    if old is not None:
                        t = Timing(s, q, min(old.absorbed_s, t.absorbed_s), min(old.expanded_s, t.expanded_s))
                    best[(s, q)] = t
                    if on_timing is not None and rep == repeats - 1:
                        on_timing(name, t)
                    bar.update(f"{name} pass {rep + 1}/{repeats} S={s} Q={q}")
        timings = [best[(s, q)] for s in ss for q in qs]
        crossovers = []
        for s in ss:
            row = [t for t in timings if t.context_len == s]
            cross, bound, th = measured_crossover(qs, [t.ratio for t in row])
            crossovers.append(Crossover(s, cross, bound, th, costs.crossover_query_len(dims, s, causal=True)))
        per_backend[name] = context_buckets(ss, [c.threshold for c in crossovers])
        results[name] = {
            "block_size": timer.block_size,
            "constant_decode_threshold": timer.layer.backend_cls.capabilities.decode_threshold,
            "crossovers": [vars(c) for c in crossovers],
            "timings": [_timing_record(dims, t) for t in timings],
        }
        del timer
    info = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": _device_record(dev),
        "versions": _versions(),
        "model": {
            "name": dims.name,
            "tp": dims.tp_size,
            "num_heads": dims.num_heads,
            "kv_lora_rank": dims.kv_lora_rank,
            "qk_nope_head_dim": dims.qk_nope_head_dim,
            "qk_rope_head_dim": dims.qk_rope_head_dim,
            "v_head_dim": dims.v_head_dim,
            "hidden_size": dims.hidden_size,
            "dtype": dtype_name(model_dtype),
        },
        "grid": {"query_lens": qs, "contexts": ss, "repeats": repeats},
        "modelled_asymptotic_query_threshold": costs.asymptotic_query_threshold(dims),
        "backends": results,
    }
    return TunedThresholds(per_backend, info)
