"""The measurement tool above the layer: the absorbed/expanded crossover ``mla-backends tune`` measures.

It uses the layer only through its public methods; the table it writes is defined in
:mod:`mla_backends.backends.thresholds` and read by :mod:`mla_backends.backends.dispatch` (the layer never imports this
module).

The cost model (:mod:`mla_backends.planning.costs`) says where the two paths of an MLA layer cost the same FLOPs; the
engines hard-code a per-backend "decode threshold" instead and mark it "tune this". This module measures it:
for each available backend it runs :class:`~mla_backends.layer.attention.MLAAttention` on one request with ``Q`` new
tokens over ``S`` cached tokens, once with the dispatch forced to the absorbed path (``forward_mqa`` between
the folds) and once forced to the expanded path (``forward_mha``), and finds the ``Q`` where they cost the
same. The projections and RoPE are identical on both runs, so they add to both times without moving the
crossover.

The result is a :class:`~mla_backends.backends.thresholds.ThresholdTable`, written as JSON::

    {"format": "mla-backends/threshold-table/v1", "date": "...", "device": {...}, "versions": {...},
     "model": {...}, "grid": {"query_lens": [...], "contexts": [...]},
     "backends": {"REF_TORCH": {"entries": [{"max_context": 512, "threshold": 40}, ...],
                                "crossovers": [...], "timings": [...]}}}

A layer given the table (``MLAAttention(..., threshold_table=path)`` or the environment variable
``MLA_BACKENDS_THRESHOLD_TABLE``) dispatches with :class:`~mla_backends.layer.dispatch.PerRequestPolicy` over its
backend's entries: a request whose query length is ``<=`` the threshold for its context runs absorbed.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata as _md
from typing import Any

import torch

from ..backends.contract import AttentionSpec
from ..backends.reasons import reasons_of
from ..backends.thresholds import ContextThresholds, ThresholdTable
from ..core.device import device_info_for
from ..core.dims import MLADims
from ..core.dtypes import dtype_name, parse_model_dtype
from ..core.memory import require_fits
from ..core.progress import ProgressBar
from ..core.validation import require_device, require_int
from ..layer.attention import MLAAttention
from ..loading.hf import random_hf_state_dict
from ..plugins.loading import get_backend, registered_backends
from ..step.metadata import BatchMetadata
from ..step.plan import StepPlan, plan_step
from . import costs

__all__ = [
    "DEFAULT_QUERY_LENS",
    "DEFAULT_CONTEXTS",
    "DEFAULT_REPEATS",
    "QUICK_QUERY_LENS",
    "QUICK_CONTEXTS",
    "QUICK_REPEATS",
    "QUICK_NOTE",
    "Timing",
    "Crossover",
    "measured_crossover",
    "context_buckets",
    "tunable_backends",
    "PathTimer",
    "timer_bytes",
    "check_grid_fits",
    "ProgressBar",
    "tune",
]

#: default grid: 1-2 minutes on a 2-core CPU for DeepSeek-V3 at TP=8 (16 heads) in float32, repeats 2
DEFAULT_QUERY_LENS: tuple[int, ...] = (1, 4, 16, 64, 128, 192, 256, 384)
DEFAULT_CONTEXTS: tuple[int, ...] = (256, 1024, 4096)
DEFAULT_REPEATS = 2
#: a few seconds; for tests and smoke runs
QUICK_QUERY_LENS: tuple[int, ...] = (1, 4, 16)
QUICK_CONTEXTS: tuple[int, ...] = (64, 256)
#: passes over the quick grid (after the first pass's warm-up round); quick tables are marked not for use
QUICK_REPEATS = 3
QUICK_NOTE = "quick run (small grid, few repeats): not for use; run a full `mla-backends tune` for a layer"


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
    FLOP model's crossover (:func:`mla_backends.planning.costs.crossover_query_len` with ``causal=True``).
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


# ---- measuring -------------------------------------------------------------------------------------------
def tunable_backends(
    dims: MLADims, dtype: torch.dtype, device: str | torch.device, names: Sequence[str] | None = None
) -> dict[str, str]:
    """Backends that can run ``dims`` here, mapped to ``""``; with ``names``, unusable ones map to the reason.

    A backend qualifies when its packages are installed and it accepts the device, dtype, head count and
    multi-token queries (single-token backends have no absorbed path for ``Q > 1``).
    """
    info = device_info_for(require_device("device", device))
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
        reasons = reasons_of(cls, spec)  # a plugin's crashing check is a reason, not the end of `tune`
        if names or not reasons:
            out[cls.name] = "; ".join(map(str, reasons))
    return out


def timer_bytes(dims: MLADims, max_tokens: int, dtype: torch.dtype) -> int:
    """Bytes a :class:`PathTimer` for ``max_tokens`` positions allocates (its cache and random rows, with their
    float32 temporaries, and its queries ``[max_tokens, H, nope + rope]``): ``max_tokens`` times
    ``W * (e + 8) + H * (N + P) * (e + 4)`` for an ``e``-byte dtype."""
    e = torch.empty(0, dtype=dtype).element_size()
    per_token = dims.cache_row_width * (e + 8) + dims.num_heads * dims.qk_head_dim * (e + 4)
    return max_tokens * per_token


def check_grid_fits(dims: MLADims, query_lens: Sequence[int], contexts: Sequence[int], dtype: torch.dtype,
                    device: str | torch.device, *, name: str = "contexts") -> None:
    """Raise ``ValueError`` naming ``name`` when the largest context plus the largest query length cannot be
    timed in the memory free on ``device`` (checked before anything is allocated)."""
    longest, widest = max(contexts), max(query_lens)
    require_fits(name, f"{longest} (with query length {widest})", timer_bytes(dims, longest + widest, dtype),
                 require_device("device", device), "the timing cache and queries")


class PathTimer:
    """The two attention paths of one :class:`~mla_backends.layer.attention.MLAAttention`, timed on one request.

    The layer (random weights, ``dims`` heads, on ``backend``) gets a one-request cache holding
    ``max_tokens`` random rows. ``time(context_len, query_len)`` runs exactly what the layer's forward runs
    for an absorbed request (``q_nope @ W_UK_T``, ``backend.forward_mqa``, ``@ W_UV``:
    :meth:`MLAAttention.absorbed_attention <mla_backends.layer.attention.MLAAttention.absorbed_attention>`) and for an
    expanded one (``forward_mha`` with the layer's ``kv_b_proj`` and workspace:
    :meth:`~mla_backends.layer.attention.MLAAttention.expanded_attention`), alternating the two ``repeats`` times
    after a warm-up and keeping each path's best time.
    The projections, RoPE and cache write are the same for both paths and are left out (which is also why
    the layer is built with a small ``hidden_size``: it only feeds the projections).
    """

    def __init__(
        self,
        dims: MLADims,
        backend: str,
        *,
        dtype: str | torch.dtype | None,
        device: str | torch.device,
        max_tokens: int,
        block_size: int | None = None,
        repeats: int = 3,
        seed: int = 0,
    ) -> None:
        require_int("repeats", repeats, minimum=1)
        require_int("max_tokens", max_tokens, minimum=1)
        if block_size is not None:
            require_int("block_size", block_size, minimum=1)
        self.device = require_device("device", device)
        require_fits("max_tokens", max_tokens, timer_bytes(dims, max_tokens, parse_model_dtype(
            dtype, default=torch.float32)), self.device, "the timing cache and queries")
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
        # an explicit dispatch: the timer calls both paths itself, so MLA_BACKENDS_THRESHOLD_TABLE plays no part
        self.layer = MLAAttention(small, backend=cls, dtype=dtype, device=self.device, dispatch="per-request")
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
        self.r = r

    def absorbed(self, plan: StepPlan, q: int) -> torch.Tensor:
        """The layer's absorbed path for ``q`` query tokens of the one-request step ``plan``: ``[q, H,
        v_head_dim]``."""
        return self.layer.absorbed_attention(self.q[:q], self.cache, plan, (0, 1))

    def expanded(self, plan: StepPlan, q: int) -> torch.Tensor:
        """The layer's expanded path (``forward_mha``) for ``q`` query tokens: ``[q, H, v_head_dim]``."""
        meta = plan.meta
        start = meta.context_lens_list[0]
        rows = self.rows[start : start + q]  # the new tokens' rows, as already written to the cache
        return self.layer.expanded_attention(self.q[:q], rows[:, : self.r], rows[:, self.r :], self.cache, meta)

    def time(self, context_len: int, query_len: int, *, warmup: bool = True) -> Timing:
        """Best of ``repeats`` alternating calls per path (after one warm-up round when ``warmup``)."""
        if context_len + query_len > self.max_tokens:
            raise ValueError(
                f"context_len + query_len: got {context_len + query_len}; supported <= "
                f"max_tokens {self.max_tokens}"
            )
        meta = BatchMetadata.build(
            [query_len], [context_len], self.block_table, self.block_size, decode_threshold=query_len
        )
        plan = plan_step(meta, [self.layer.backend])  # both paths over the whole step (planned untimed)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        best = {"a": math.inf, "e": math.inf}
        with torch.inference_mode():
            for i in range(self.repeats + int(warmup)):
                for key, fn in (("a", self.absorbed), ("e", self.expanded)):
                    sync()
                    t0 = time.perf_counter()
                    fn(plan, query_len)
                    sync()
                    if i or not warmup:  # a warm-up round is not kept
                        best[key] = min(best[key], time.perf_counter() - t0)
        return Timing(context_len, query_len, best["a"], best["e"])


def _versions() -> dict[str, str]:
    from .. import __version__

    out = {"mla_backends": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for dist in ("triton", "flashinfer-python"):
        try:
            out[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            pass
    return out


def _device_record(device: str | torch.device) -> dict[str, Any]:
    info = device_info_for(require_device("device", device))
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


def _timing_record(dims: MLADims, t: Timing) -> dict[str, Any]:
    """A timing plus the causal FLOP model's count for each path (for effective GFLOP/s)."""
    q, s = t.query_len, t.context_len
    return {**vars(t), "absorbed_flops": costs.absorbed_path_flops(dims, q, s, causal=True),
            "expanded_flops": costs.expanded_path_flops(dims, q, s, causal=True)}


def tune(
    dims: MLADims,
    *,
    backends: Iterable[str],
    query_lens: Sequence[int] = DEFAULT_QUERY_LENS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    block_size: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    progress: bool = True,
    on_timing: Callable[[str, Timing], None] | None = None,
    quick: bool = False,
) -> ThresholdTable:
    """Measure every backend over the grid and build the :class:`~mla_backends.backends.thresholds.ThresholdTable`.

    Args:
        dims: the layer's :class:`~mla_backends.core.dims.MLADims`; a tensor-parallel view
            (``dims.tensor_parallel(tp)``) times what one rank computes.
        backends: backend names to measure.
        query_lens / contexts: the grid (non-empty, positive ints; sorted and deduplicated here).
        dtype: model dtype (default float32 on the CPU, bfloat16 on CUDA).
        block_size: page size in tokens (>= 1; None = each backend's preferred size).
        repeats: passes over the grid (>= 1); each point keeps its best time per path (the first pass warms
            up).
        quick: mark the table as a quick run (``"quick": true`` and ``"note": QUICK_NOTE``): not for use.

    Raises ``ValueError``/``TypeError`` for a bad argument before anything is timed.
    """
    if not isinstance(dims, MLADims):
        raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
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
    dev = require_device("device", device)
    model_dtype = parse_model_dtype(dtype, default=torch.float32 if dev.type == "cpu" else torch.bfloat16)
    check_grid_fits(dims, qs, ss, model_dtype, dev)
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
    if quick:
        info.update(quick=True, note=QUICK_NOTE)
    return ThresholdTable(per_backend, info)
