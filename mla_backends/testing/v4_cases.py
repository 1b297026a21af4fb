"""DeepSeek-V4 conformance cases: a backend's ``forward_mqa`` with sinks, a sliding window and compressed keys,
against a float64 reference written out here.

    from mla_backends.testing.v4_cases import run_v4_cases
    results = run_v4_cases("TRITON_MLA")          # [V4CaseResult(case, status, detail), ...]
    assert all(r.status != "failed" for r in results)

The cases (:data:`V4_CASES`), each over scattered pages with NaN in every slot no request owns (both caches; a
table's unused tail is ``-1``), ragged lengths and a decode, an extend and a prefill where the case allows:

- ``window-1`` / ``window-edges`` / ``window-wider``: a token sees only itself; windows that reach position 0
  for the first tokens and slide for the later ones; a window wider than every sequence (the whole context);
- ``entry-visibility``: tokens at ``k r - 2``, ``k r - 1`` and ``k r`` (ratio 8) attending every visible entry:
  entry ``k - 1`` is seen from ``k r - 1`` on, never before;
- ``ratio-4``: CSA-like picks (some repeated, which count once, ``-1`` padded, some tokens with none);
- ``ratio-128``: HCA, every visible entry of sequences up to 300 tokens (pages of 64);
- ``sinks``: sink logits from -8 to +8 and one far above every score (its head's output goes to 0 and its LSE to
  the sink); ``no-sinks``: the same call without them;
- ``records``: the V4 call over ``fp8_ds_mla`` records (512-wide rows, bf16 queries), judged against the stored
  values.

A case a backend does not declare (no sinks, windows or compressed keys, or not the records) is ``skipped`` with
the declaration's reasons. Outputs and natural-log LSEs are judged with the suite's tolerance policy
(:func:`~mla_backends.testing.tolerances.tolerance_for`; records at the query's dtype). ``run_v4_cases`` returns
its own result type; wiring the cases into the suite's matrix is left to the suite.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.capabilities import AttentionSpec, Precision
from ..backends.contract import MLABackend
from ..backends.reasons import ReasonKind, without_kinds
from ..backends.v4_inputs import CompressedKeys
from ..core.device import device_info_for
from ..core.dtypes import dtype_name
from ..core.validation import require_device
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from ..step.plan import plan_step
from ..step.records import RecordCache
from .checks import judged_class
from .judge import Standard
from .rounding import rounded_mqa
from .tolerances import judged_dtype, lse_tolerance, precision_for, tolerance_for

__all__ = ["V4Case", "V4CaseResult", "V4Inputs", "V4_CASES", "v4_case_inputs", "v4_reference", "run_v4_case",
           "run_v4_cases", "scattered_table"]


@dataclass(frozen=True)
class V4Case:
    """One V4 call. ``ratio``: 0 no compressed keys, 4 picks per token (``picks`` of them, CSA-like), any other
    every visible entry (HCA-like); entry ``w`` is visible to position ``p`` once ``w < (p + 1) // ratio``."""

    name: str
    what: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    window: int
    ratio: int = 0
    block_size: int = 4
    sinks: bool = True
    picks: int = 4
    heads: int = 4
    width: int = 64
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    sink_values: tuple[float, ...] = field(default=())

    @property
    def records(self) -> bool:
        return self.kv_cache_dtype == "fp8_ds_mla"

    def spec(self, device: torch.device) -> AttentionSpec:
        return AttentionSpec(num_heads=self.heads, kv_lora_rank=self.width, qk_rope_head_dim=0, dtype=self.dtype,
                             kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size, max_query_len=2,
                             uniform_query_len=False, device=device_info_for(device), sinks=self.sinks, window=True,
                             compressed=self.ratio > 0)


V4_CASES: tuple[V4Case, ...] = (
    V4Case("window-1", "a window of one position: each token sees only its own row", (1, 3, 6), (7, 4, 0), 1),
    V4Case("window-edges", "a window of 6 reaching position 0 for the first tokens, sliding for the others",
           (1, 5, 9), (12, 3, 0), 6, block_size=2),
    V4Case("window-wider", "a window wider than every sequence: the whole causal context", (1, 4), (9, 2), 64),
    V4Case("entry-visibility", "tokens at k*8-2, k*8-1, k*8: entry k-1 visible from k*8-1 on, not before",
           (1, 4, 3), (6, 13, 22), 3, ratio=8),
    V4Case("ratio-4", "CSA-like picks (repeats count once, -1 padded, some tokens with none) and a window",
           (1, 6, 2), (17, 0, 9), 4, ratio=4, picks=5),
    V4Case("ratio-128", "HCA-like: every visible entry of ratio 128, sequences up to 300 tokens, pages of 64",
           (1, 2, 130), (299, 254, 0), 8, ratio=128, block_size=64, heads=2, width=32),
    V4Case("sinks", "sinks from -8 to +8 and one far above every score (output 0, LSE the sink)", (1, 5), (10, 0),
           4, ratio=4, sink_values=(-8.0, 0.0, 8.0, 60.0)),
    V4Case("no-sinks", "no sinks: one softmax over the window and the compressed keys", (1, 5), (10, 0), 4,
           ratio=4, sinks=False),
    V4Case("records", "fp8_ds_mla records (584 bytes: 448 fp8 + 64 bf16), bf16 queries, both caches", (1, 4),
           (9, 3), 3, ratio=4, width=512, heads=2, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla"),
)


@dataclass(frozen=True)
class V4CaseResult:
    """``status``: ``passed``, ``failed`` or ``skipped``; ``detail``: the largest error against its tolerance, what
    failed, or why the backend does not run the case."""

    case: str
    status: str
    detail: str


@dataclass
class V4Inputs:
    """A case's inputs (``meta``, the caches, the compressed table in processing order, the picks ``[T, K]``, ``q``,
    ``sinks``) and the values the caches hold per caller request (``rows`` / ``crows``, float64)."""

    meta: BatchMetadata
    cache: LatentKVCache
    ccache: LatentKVCache | None
    ctable: torch.Tensor | None
    picks: torch.Tensor | None
    q: torch.Tensor
    sinks: torch.Tensor | None
    rows: dict[int, torch.Tensor]
    crows: dict[int, torch.Tensor]


def scattered_table(lengths: list[int], page: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table ``[B, pages + 1]`` for sequences of ``lengths`` on pages of ``page`` rows, its page ids a
    random permutation (a ``-1`` tail) and the pool's page count (two pages nobody owns)."""
    need = [max(1, -(-n // page)) for n in lengths]
    total = sum(need) + 2
    ids = torch.randperm(total, generator=g)
    table = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[k:k + n]
        k += n
    return table, total


def _store(case: V4Case, pages: int, rows_a_page: int, device: torch.device) -> LatentKVCache:
    if case.records:
        cache: LatentKVCache = RecordCache(pages, rows_a_page, case.width, 0, model_dtype=case.dtype, device=device)
        cache.byte_span.fill_(0xFF)  # NaN fp8 values and a NaN bf16 tail in every unowned record
    else:
        cache = LatentKVCache(pages, rows_a_page, case.width, 0, model_dtype=case.dtype, device=device)
        cache.data.fill_(float("nan"))
    return cache


def _fill(cache: LatentKVCache, table: torch.Tensor, b: int, n: int, g: torch.Generator, case: V4Case
          ) -> torch.Tensor:
    """Write ``n`` random rows for request ``b`` (caller order) and return what the cache holds (float64)."""
    page = cache.block_size
    slots = torch.tensor([int(table[b, i // page]) * page + i % page for i in range(n)], dtype=torch.long)
    rows = torch.randn(n, case.width, generator=g, dtype=torch.float64).to(case.dtype).to(cache.device)
    cache.write(rows, rows[:, :0], slots.to(cache.device))
    return cache.read_slots(slots.to(cache.device), torch.float64).cpu()


def v4_case_inputs(case: V4Case, device: torch.device | str = "cpu") -> V4Inputs:
    """The case's inputs on ``device`` (deterministic: seeded from its name) and the values its caches hold."""
    device = require_device("device", device)
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    seq = [q + c for q, c in zip(case.query_lens, case.context_lens, strict=True)]
    table, pages = scattered_table(seq, case.block_size, g)
    meta = BatchMetadata.build(list(case.query_lens), list(case.context_lens), table.to(device), case.block_size,
                               num_blocks=pages)
    cache = _store(case, pages, case.block_size, device)
    rows = {b: _fill(cache, table, b, n, g, case) for b, n in enumerate(seq)}
    ccache = ctable = picks = None
    crows: dict[int, torch.Tensor] = {}
    if case.ratio:
        entries = [s // case.ratio for s in seq]
        per_page = 2
        ctab, cpages = scattered_table(entries, per_page, g)
        ccache = _store(case, cpages, per_page, device)
        crows = {b: _fill(ccache, ctab, b, e, g, case) for b, e in enumerate(entries) if e}
        ctable = ctab.to(device)[meta.order]
        T = meta.num_tokens
        visible = [(int(p) + 1) // case.ratio for p in meta.token_positions.tolist()]
        if case.ratio == 4:  # picks: a repeat and -1 padding
            idx = torch.full((T, case.picks + 2), -1, dtype=torch.long)
            for t, v in enumerate(visible):
                if v:
                    chosen = torch.randint(0, v, (case.picks,), generator=g)
                    idx[t, : case.picks] = chosen
                    idx[t, case.picks] = chosen[0]
        else:  # every visible entry
            width = max(1, max(visible, default=1))
            cols = torch.arange(width)[None, :]
            v = torch.tensor(visible)[:, None]
            idx = torch.where(cols < v, cols, torch.full_like(cols, -1))
        picks = idx.to(device)
    q = torch.randn(meta.num_tokens, case.heads, case.width, generator=g, dtype=torch.float64).to(case.dtype)
    sinks = None
    if case.sinks:
        base = torch.tensor(case.sink_values, dtype=torch.float64) if case.sink_values else torch.randn(
            case.heads, generator=g, dtype=torch.float64)
        sinks = base.float().to(device)
    return V4Inputs(meta, cache, ccache, ctable, picks, q.to(device), sinks, rows, crows)


def _token_keys(x: V4Inputs, case: V4Case, b: int, p: int, picks: torch.Tensor | None, t: int) -> torch.Tensor:
    """``[S, W]`` float64: the rows token ``t`` (request ``b``, position ``p``) sees, its window rows then its
    compressed entries (each once)."""
    keys = [x.rows[b][j] for j in range(max(0, p - case.window + 1), p + 1)]
    if picks is not None:
        keys += [x.crows[b][e] for e in sorted({int(v) for v in picks[t] if v >= 0})]
    return torch.stack(keys)


def v4_reference(case: V4Case, x: V4Inputs, scale: float,
                 precision: Precision | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(out [T, H, W], lse [T, H])``, plainly: per token, its window rows and its entries (each once),
    one softmax with the sink in the denominator. With ``precision``: the case's honest rounding instead
    (:func:`~mla_backends.testing.rounding.rounded_mqa` per token, the sink then folded in as a kernel folds it:
    the output scaled by ``exp(lse - lse_with_sink)``, rounded to the query dtype again)."""
    meta = x.meta
    T, H, W = x.q.shape
    out = torch.zeros(T, H, W, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    q = x.q.double().cpu()
    order, req, pos = meta.order.tolist(), meta.token_request.tolist(), meta.token_positions.tolist()
    picks = x.picks.cpu() if x.picks is not None else None
    sinks = x.sinks.double().cpu() if x.sinks is not None else None
    operand = judged_dtype(case.dtype, "auto" if case.records else case.kv_cache_dtype)
    for t in range(T):
        k = _token_keys(x, case, order[req[t]], pos[t], picks, t)
        if precision is not None:
            o, z = rounded_mqa(x.q[t: t + 1].cpu(), x.q[t: t + 1, :, :0].cpu(), k,
                               torch.ones(1, k.shape[0], dtype=torch.bool), scale, operand=operand,
                               precision=precision)
            o, z = o[0], z[0]
            if sinks is not None:
                z_all = torch.logaddexp(z, sinks)
                o = (o * torch.exp(z - z_all)[:, None]).to(case.dtype).to(torch.float64)
                z = z_all.to(precision.lse).to(torch.float64)
            out[t], lse[t] = o, z
            continue
        for h in range(H):
            s = k @ q[t, h] * scale
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1]])
            z = torch.logsumexp(s, 0)
            out[t, h] = torch.exp(s[: k.shape[0]] - z) @ k
            lse[t, h] = z
    return out, lse


def v4_standard(cls: type[MLABackend], case: V4Case, x: V4Inputs, scale: float) -> Standard:
    """The case's :class:`~mla_backends.testing.judge.Standard` for ``cls``, as the MLA cases judge
    (:func:`~mla_backends.testing.checks.standard_for`): the float64 reference, the honest rounding under the
    backend's declared precision, or its declared band. Record caches (``fp8_ds_mla``) are judged in the query
    dtype (their values are exact in it)."""
    kv = "auto" if case.records else case.kv_cache_dtype
    kv = dtype_name(case.dtype) if kv == "auto" else kv
    ref, ref_lse = v4_reference(case, x, scale)
    key, band = tolerance_for(cls, case.dtype, kv)
    pkey, precision = precision_for(cls, case.dtype, kv)
    honest, honest_lse = v4_reference(case, x, scale, precision)
    if band is None and pkey != "default":
        key = f"{key}, declared precision {pkey}"
    return Standard(ref, ref_lse, honest, honest_lse, precision, band=band,
                    lse_band=lse_tolerance(band, case.dtype) if band is not None else None, key=key,
                    out_dtype=case.dtype)


def run_v4_case(cls: type[MLABackend], case: V4Case, device: torch.device | str = "cpu") -> V4CaseResult:
    """One case on a fresh instance of ``cls`` (module docstring)."""
    device = require_device("device", device)
    cls = judged_class(cls, device)  # interpreted Triton on a CPU: bf16 withheld (its truncation is not the GPU's)
    reasons = without_kinds(cls.not_supported_reasons(case.spec(device)), ReasonKind.PACKAGE)
    if reasons:
        return V4CaseResult(case.name, "skipped", "; ".join(map(str, reasons)))
    x = v4_case_inputs(case, device)
    scale = case.width ** -0.5
    backend = cls()
    comp = CompressedKeys(x.ccache, x.ctable, x.picks) if x.ccache is not None else None
    try:
        out, lse = backend.forward_mqa(x.q, x.q[..., :0], x.cache, x.meta, scale=scale, sinks=x.sinks,
                                       window=case.window, compressed=comp, plan=plan_step(x.meta, [backend]))
    except Exception as exc:  # a backend that declares the case and then refuses or crashes fails it
        return V4CaseResult(case.name, "failed", f"{type(exc).__name__}: {exc}")
    standard = v4_standard(cls, case, x, scale)
    v_out = standard.judge(out.double().cpu())
    v_lse = standard.judge_lse(lse.double().cpu()) if lse is not None else None
    ok = v_out.ok and (v_lse is None or v_lse.ok)
    lse_text = f"; LSE {v_lse.badness:.3g} of its allowance" if v_lse is not None else ""
    detail = (f"output {v_out.badness:.3g} of its allowance ({standard.key}; worst: {v_out.text}){lse_text}; "
              f"{case.what}")
    return V4CaseResult(case.name, "passed" if ok else "failed", detail)


def run_v4_cases(backend: Any, *, device: torch.device | str = "cpu",
                 cases: tuple[V4Case, ...] = V4_CASES) -> list[V4CaseResult]:
    """Every case on ``backend`` (a registered name or an ``MLABackend`` subclass), in order."""
    if isinstance(backend, type) and issubclass(backend, MLABackend):
        cls = backend
    else:
        from ..plugins.loading import get_backend

        cls = get_backend(backend)
    return [run_v4_case(cls, case, device) for case in cases]
