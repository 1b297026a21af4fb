"""The conformance matrix: which :class:`~mla_backends.testing.cases.Case` values a backend must run, built
from its declared :class:`~mla_backends.backends.contract.Capabilities` (:func:`build_matrix`; full and ``quick``).

Every declared dtype, cache dtype, page size, head count and dims pair gets cases, crossed where it matters;
each case is placed on a (simulated) device whose declaration accepts it, or recorded as *rejected* when no
declared combination is accepted. :mod:`.cases` holds the data types this module fills in.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..backends.contract import MLABackend, QueryLenSupport
from ..backends.reasons import Reason
from ..core.device import CPU_DEVICE, DeviceInfo, simulated_device
from ..core.dtypes import KV_CACHE_DTYPES, MODEL_DTYPES, dtype_name
from .cases import (
    ANY_DIMS,
    FP8_SCALES,
    HEAD_COUNTS,
    Case,
    DeclaredProbe,
    Matrix,
    UnsupportedProbe,
    declaration_devices,
    declared_reasons,
)

__all__ = ["build_matrix", "property_seeds", "PROPERTY_SEED", "PROPERTY_CASES", "PROPERTY_ROW_BUDGET",
           "PROPERTY_TOKEN_BUDGET", "PROPERTY_ATTEMPTS"]

#: the quick matrix's property run: this many cases of random shapes, drawn from the seeds from this one on
#: (``--seeds N --seed S`` draws N cases from S on, in either matrix)
PROPERTY_SEED = 20261202
PROPERTY_CASES = 4
#: ... and to this many (query token, head) pairs: a Triton kernel's interpreted cost grows with its programs
PROPERTY_TOKEN_BUDGET = 16 * 16
#: draws tried per seed before the seed is given up (the backend's own rules may reject a draw)
PROPERTY_ATTEMPTS = 8
#: fp8 per-tensor scales a random fp8 case draws from (never 1)
PROPERTY_FP8_SCALES = (0.37, 0.8125, 1.7, 3.1)
#: ... each bounded to this many (cached row, head) pairs (sum of sequence lengths times heads), so the run
#: stays a few seconds under Triton's interpreter
PROPERTY_ROW_BUDGET = 16 * 700

#: query dtypes in order of preference for the base case
_DTYPE_PREFERENCE = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _accepting_device(cls: type[MLABackend], case: Case) -> tuple[DeviceInfo | None, list[Reason]]:
    first: list[Reason] | None = None
    for dev in declaration_devices(cls):
        reasons = declared_reasons(cls, case.spec(dev))
        if not reasons:
            return dev, []
        if first is None:
            first = reasons
    return None, first or ["no device fits the declared compute capabilities"]


# ---- axis values -------------------------------------------------------------------------------------------
def _dtypes(cls: type[MLABackend]) -> list[torch.dtype]:
    return [d for d in _DTYPE_PREFERENCE if d in cls.capabilities.dtypes and d in MODEL_DTYPES]


def _kv_dtypes(cls: type[MLABackend]) -> list[str]:
    return [k for k in KV_CACHE_DTYPES if k != "auto" and k in cls.capabilities.kv_cache_dtypes]


def _page_sizes(cls: type[MLABackend], quick: bool) -> list[int]:
    caps = cls.capabilities
    pref = caps.preferred_page_size
    if caps.page_sizes is not None:
        pages = sorted(set(caps.page_sizes), key=lambda p: (p != pref, abs(p - 32), p))
        if quick:
            pages = pages[:2]
    elif caps.page_size_multiple is not None:
        m = caps.page_size_multiple
        pages = [pref, m, 2 * m] if not quick else [pref, m if m != pref else 2 * m]
    else:
        pages = [pref, 1, 64, 24] if not quick else [pref, 64 if pref != 64 else 16]
    return list(dict.fromkeys(pages))


def _head_counts(cls: type[MLABackend]) -> list[int]:
    caps = cls.capabilities
    heads = [
        h
        for h in HEAD_COUNTS
        if (caps.num_heads is None or h in caps.num_heads)
        and (caps.max_num_heads is None or h <= caps.max_num_heads)
    ]
    if not heads and caps.num_heads:
        heads = sorted(caps.num_heads)[:3]
    return heads


def _dims(cls: type[MLABackend]) -> list[tuple[int, int]]:
    caps = cls.capabilities
    if caps.dims is None:
        return list(ANY_DIMS)
    return sorted(caps.dims, key=lambda d: (d != (512, 64), d))


# ---- lengths -----------------------------------------------------------------------------------------------
def _long(page: int, quick: bool) -> int:
    return max(4 * page + 3, 131 if quick else 1061)


def _sweep(page: int, quick: bool) -> list[int]:
    """Sequence lengths 1, page-1, page, page+1 and long (deduplicated, >= 1)."""
    return list(dict.fromkeys(n for n in (1, page - 1, page, page + 1, _long(page, quick)) if n >= 1))


def _with_equal_pair(lengths: list[int]) -> list[int]:
    """``lengths`` with its longest-but-one repeated beside it: two requests of equal length in one batch, which
    a kernel batching equal lengths together must still answer each with its own context."""
    j = len(lengths) - 2 if len(lengths) > 1 else 0
    return lengths[: j + 1] + [lengths[j]] + lengths[j + 1:]


def _small(page: int) -> list[int]:
    return [1, page + 1, 2 * page + 5]


LengthsFn = Callable[[int], tuple[Sequence[int], Sequence[int]]]


def _decode(lengths: Callable[[int], Sequence[int]]) -> LengthsFn:
    def fn(page: int) -> tuple[Sequence[int], Sequence[int]]:
        seqs = list(lengths(page))
        return seqs, [1] * len(seqs)

    return fn


# ---- the generator -----------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, cls: type[MLABackend], quick: bool, seeds: Sequence[int] = ()) -> None:
        self.cls, self.quick, self.seeds = cls, quick, tuple(seeds)
        caps = cls.capabilities
        self.dtypes = _dtypes(cls)
        self.kvs = _kv_dtypes(cls)
        self.pages = _page_sizes(cls, quick)
        self.heads = _head_counts(cls)
        self.dims = _dims(cls)
        self.need_lse = caps.returns_lse
        if not self.dtypes:
            raise ValueError(
                f"{cls.name}: capabilities.dtypes: got {sorted(map(str, caps.dtypes))}; "
                "supported at least one of bfloat16, float16, float32, float64"
            )
        if not self.kvs:
            raise ValueError(
                f"{cls.name}: capabilities.kv_cache_dtypes: got {sorted(caps.kv_cache_dtypes)}; "
                f"supported at least one of {', '.join(KV_CACHE_DTYPES[1:])}"
            )

    def kv_for(self, dtype: torch.dtype) -> str:
        """The cache dtype that goes with a query dtype by default (``auto``), else the first declared."""
        name = dtype_name(dtype)
        if name in self.kvs:
            return name
        return next((k for k in self.kvs if not k.startswith("fp8")), self.kvs[0])

    def make(
        self,
        name: str,
        lengths: LengthsFn,
        *,
        dtype: torch.dtype | None = None,
        kv: str | None = None,
        page: int | None = None,
        heads: int | None = None,
        dims: tuple[int, int] | None = None,
        topk: int | None = None,
        fp8_scale: float | None = None,
    ) -> Case:
        """A case with the given axes pinned; free axes take base values, or other declared values when the
        backend's own rules reject the base combination."""
        fixed = {"dtype": dtype, "kv": kv, "page": page, "heads": heads, "dims": dims}
        options = {
            "dtype": [dtype] if dtype is not None else self.dtypes,
            "page": [page] if page is not None else self.pages,
            "heads": [heads] if heads is not None else self.heads or [16],
            "dims": [dims] if dims is not None else self.dims,
        }
        first: Case | None = None
        first_reasons: list[Reason] = []
        for dt, pg, hd, dm in itertools.product(
            options["dtype"], options["page"], options["heads"], options["dims"]
        ):
            kv_opts = (
                [kv]
                if fixed["kv"] is not None
                else [self.kv_for(dt)] + [k for k in self.kvs if k != self.kv_for(dt)]
            )
            for kvn in kv_opts:
                seqs, qlens = lengths(pg)
                scale = (
                    fp8_scale if fp8_scale is not None else (FP8_SCALES[0] if kvn.startswith("fp8") else 1.0)
                )
                case = Case(
                    name=name,
                    dtype=dt,
                    kv_cache_dtype=kvn,
                    block_size=pg,
                    num_heads=hd,
                    kv_lora_rank=dm[0],
                    qk_rope_head_dim=dm[1],
                    seq_lens=tuple(seqs),
                    query_lens=tuple(qlens),
                    topk=topk,
                    fp8_scale=scale,
                    need_lse=self.need_lse,
                    decode_threshold=self.cls.capabilities.decode_threshold,
                )
                dev, reasons = _accepting_device(self.cls, case)
                if dev is not None:
                    return replace(case, device=dev)
                if first is None:
                    first, first_reasons = case, reasons
        assert first is not None
        return replace(first, rejected=tuple(map(str, first_reasons)))

    # ---- the matrices ----------------------------------------------------------------------------------
    def output_cases(self) -> list[Case]:
        caps, quick = self.cls.capabilities, self.quick
        sparse_only = not caps.dense
        k0 = 16
        topk = k0 if sparse_only else None
        cases: list[Case] = []
        base_page = self.pages[0]

        # context lengths 1, page-1, page, page+1, long: one ragged batch per page size, plus (full) one
        # case per length
        for i, pg in enumerate(self.pages):
            if quick and i > 0:
                cases.append(self.make("ragged", _decode(lambda p: _with_equal_pair(_small(p) + [_long(p, True)])),
                                       page=pg, topk=topk))
                continue
            cases.append(self.make("ctx-sweep", _decode(lambda p: _with_equal_pair(_sweep(p, quick))), page=pg,
                                   topk=topk))
            if not quick and i == 0:
                for n in _sweep(pg, quick):
                    cases.append(self.make(f"ctx{n}", _decode(lambda p, n=n: [n, n]), page=pg, topk=topk))
        # every declared query dtype (with its own cache dtype), and every declared cache dtype
        for dt in self.dtypes[1:]:
            cases.append(self.make("dtype", _decode(_small), dtype=dt, topk=topk))
        covered = {(c.dtype, c.kv_cache_dtype) for c in cases}
        for i, kvn in enumerate(self.kvs):
            if kvn.startswith("fp8"):
                scales = FP8_SCALES if not quick else (FP8_SCALES[i % 2],)
            else:
                scales = (None,)
            for scale in scales:
                if not kvn.startswith("fp8") and any(k == kvn for _, k in covered):
                    continue
                cases.append(self.make("kv", _decode(_small), kv=kvn, fp8_scale=scale, topk=topk))
            if not quick and not kvn.startswith("fp8"):
                for dt in self.dtypes:
                    if (dt, kvn) not in covered:
                        cross = self.make("kv-cross", _decode(_small), dtype=dt, kv=kvn, topk=topk)
                        if not cross.rejected:  # a pair may be excluded by a rule the fields cannot express
                            cases.append(cross)
                        covered.add((dt, kvn))
        # head counts and dims pairs
        base_heads = self.heads[0] if self.heads else None
        for h in self.heads[1:]:  # quick: short sequences (128 heads are slow under the Triton interpreter)
            lengths = _decode(lambda p: [2, p + 1]) if quick else _decode(_small)
            cases.append(self.make("heads", lengths, heads=h, topk=topk))
        for dm in self.dims[1:]:
            cases.append(self.make("dims", _decode(_small), dims=dm, topk=topk))
        # several query tokens per request, causal among themselves
        if caps.query_len >= QueryLenSupport.UNIFORM:
            for qn in (3,) if quick else (2, 4):
                cases.append(
                    self.make(
                        f"q{qn}",
                        lambda p, qn=qn: ([qn, p + qn, 2 * p + 7], [qn] * 3),
                        page=base_page,
                        topk=topk,
                    )
                )
        if caps.query_len >= QueryLenSupport.VARLEN:
            cases.append(
                self.make(
                    "varlen", lambda p: ([p + 1, 2 * p + 9, 5, 4], [1, 4, 1, 2]), page=base_page, topk=topk
                )
            )
            if not quick:
                cases.append(
                    self.make(
                        "varlen-long",
                        lambda p: ([_long(p, False), 3, p + 6], [5, 1, 6]),
                        page=base_page,
                        topk=topk,
                    )
                )
        # sparse: top-k lists with -1 padding
        if caps.sparse and caps.dense:
            cases.append(self.make("sparse", _decode(lambda p: [1, p + 1, _long(p, quick)]), topk=k0))
            if caps.query_len >= QueryLenSupport.UNIFORM:
                cases.append(self.make("sparse-q2", lambda p: ([2, p + 2, 3 * p + 4], [2, 2, 2]), topk=k0))
            if not quick:
                cases.append(
                    self.make(
                        "sparse-wide", _decode(lambda p: [3, 2 * p + 1, 300]), topk=64, heads=base_heads
                    )
                )
                for kvn in (k for k in self.kvs if k.startswith("fp8")):
                    sparse_kv = self.make("sparse-kv", _decode(_small), kv=kvn, topk=k0)
                    if not sparse_kv.rejected:
                        cases.append(sparse_kv)
        cases += self.property_cases(self.seeds)
        return list({c.id: c for c in cases}.values())

    def property_cases(self, seeds: Sequence[int]) -> list[Case]:
        """One random case per seed (:meth:`property_case`); seeds whose every draw the backend rejects are left
        out."""
        cases = [self.property_case(seed) for seed in seeds]
        return [c for c in cases if c is not None]

    def property_case(self, seed: int) -> Case | None:
        """The random case ``seed`` draws inside the declarations: a declared page size, head count, query dtype,
        cache dtype (fp8 with a random scale) and dims pair; 1-5 requests whose lengths straddle page boundaries
        or fall anywhere up to 8 pages, two of them often of equal length side by side; query lengths as declared;
        sparse top-k lists when declared; the block table scattered as in every case. It depends on the seed and
        the declarations only (not on the backend's name), is sized within :data:`PROPERTY_ROW_BUDGET`, and is
        named ``prop-s<seed>`` (reproduce it with ``--seeds 1 --seed <seed>``). None when
        :data:`PROPERTY_ATTEMPTS` draws were all rejected by the backend's own rules."""
        caps = self.cls.capabilities
        rng = random.Random(seed)
        for _ in range(PROPERTY_ATTEMPTS):
            if caps.page_sizes is not None:
                page = rng.choice(sorted(caps.page_sizes))
            elif caps.page_size_multiple is not None:
                page = caps.page_size_multiple * rng.choice((1, 2, 3, 4))
            else:
                page = rng.choice((1, 3, 8, 16, 24, 40, 64))
            heads = rng.choice(self.heads or [16])
            dtype = rng.choice(self.dtypes)
            kv = rng.choice(self.kvs)
            fp8_scale = rng.choice(PROPERTY_FP8_SCALES) if kv.startswith("fp8") else None
            dims = rng.choice(self.dims)
            batch = rng.randint(1, 5)
            if caps.query_len >= QueryLenSupport.VARLEN:
                qlens = [rng.choice((1, 1, 2, 3, 5)) for _ in range(batch)]
            elif caps.query_len >= QueryLenSupport.UNIFORM:
                qlens = [rng.choice((1, 2, 3))] * batch
            else:
                qlens = [1] * batch
            while sum(qlens) * heads > PROPERTY_TOKEN_BUDGET and max(qlens) > 1:
                qlens = [max(1, q // 2) for q in qlens]
            while sum(qlens) * heads > PROPERTY_TOKEN_BUDGET and len(qlens) > 1:
                qlens.pop()
            batch = len(qlens)
            seqs = []
            for q in qlens:
                n = rng.choice((page - 1, page, page + 1, rng.randint(1, 8 * page + 7), rng.randint(1, 300)))
                seqs.append(max(n, q))
            while sum(seqs) * heads > PROPERTY_ROW_BUDGET:
                j = seqs.index(max(seqs))
                seqs[j] = max(qlens[j], seqs[j] // 2)
            if batch > 1 and rng.random() < 0.5:  # an equal pair side by side (a batching bug's trigger): the
                j = rng.randrange(batch - 1)  # shorter request copied over its neighbour, within the budgets
                k, other = (j, j + 1) if seqs[j] <= seqs[j + 1] else (j + 1, j)
                seqs[other], qlens[other] = seqs[k], qlens[k]
            sparse = not caps.dense or (caps.sparse and rng.random() < 0.35)
            topk = rng.choice((8, 16, 32)) if sparse else None
            case = self.make(f"prop-s{seed}", lambda p, s=tuple(seqs), q=tuple(qlens): (s, q), page=page,
                             heads=heads, dtype=dtype, kv=kv, dims=dims, topk=topk, fp8_scale=fp8_scale)
            if not case.rejected:
                return replace(case, draw=seed)
        return None

    def guard_cases(self) -> list[Case]:
        caps = self.cls.capabilities
        topk = None if caps.dense else 16
        cases = [self.make("guard", _decode(_small), topk=topk)]
        if not self.quick and caps.query_len >= QueryLenSupport.VARLEN:
            cases.append(self.make("guard-varlen", lambda p: ([p + 1, 9, 4], [1, 3, 2]), topk=topk))
        return cases

    def determinism_cases(self) -> list[Case]:
        caps = self.cls.capabilities
        topk = None if caps.dense else 16
        cases = [self.make("repeat", _decode(lambda p: _small(p) + [_long(p, True)]), topk=topk)]
        if not self.quick:
            if caps.query_len >= QueryLenSupport.VARLEN:
                cases.append(
                    self.make("repeat-varlen", lambda p: ([p + 1, 2 * p + 9, 5], [1, 4, 2]), topk=topk)
                )
            if caps.sparse and caps.dense:
                cases.append(self.make("repeat-sparse", _decode(lambda p: [p + 1, 200]), topk=16))
        return cases

    def declared_probes(self, output: Sequence[Case]) -> list[DeclaredProbe]:
        """One probe per declared value: the first output case using it, or a dedicated attempt."""
        caps = self.cls.capabilities
        probes: list[DeclaredProbe] = []
        axes: list[tuple[str, str, Callable[[Case], bool], dict]] = []
        for dt in self.dtypes:
            axes.append(("dtype", dtype_name(dt), lambda c, dt=dt: c.dtype == dt, {"dtype": dt}))
        for kvn in self.kvs:
            axes.append(("kv_cache_dtype", kvn, lambda c, k=kvn: c.kv_cache_dtype == k, {"kv": kvn}))
        for pg in self.pages:
            axes.append(("page_size", str(pg), lambda c, pg=pg: c.block_size == pg, {"page": pg}))
        for h in self.heads:
            axes.append(("num_heads", str(h), lambda c, h=h: c.num_heads == h, {"heads": h}))
        for dm in self.dims:
            axes.append(
                (
                    "dims",
                    f"{dm[0]}x{dm[1]}",
                    lambda c, dm=dm: (c.kv_lora_rank, c.qk_rope_head_dim) == dm,
                    {"dims": dm},
                )
            )
        for label, ok in (
            ("uniform", caps.query_len >= QueryLenSupport.UNIFORM),
            ("varlen", caps.query_len >= QueryLenSupport.VARLEN),
        ):
            if ok:
                axes.append(
                    (
                        "query_len",
                        label,
                        lambda c, v=label == "varlen": (
                            max(c.query_lens) > 1 and (len(set(c.query_lens)) > 1) == v
                        ),
                        {},
                    )
                )
        if caps.sparse:
            axes.append(("attention", "sparse", lambda c: c.topk is not None, {}))
        if caps.dense:
            axes.append(("attention", "dense", lambda c: c.topk is None, {}))
        for axis, value, match, pins in axes:
            case = next((c for c in output if match(c) and not c.rejected), None)
            if case is None:
                case = next((c for c in output if match(c)), None)
            if case is None:
                topk = None if caps.dense else 16
                case = self.make(f"declared-{axis}", _decode(_small), topk=topk, **pins)
            probes.append(DeclaredProbe(axis, value, case))
        return probes

    def unsupported_probes(self, base: Case) -> list[UnsupportedProbe]:
        """Combinations outside the declarations, each one axis away from an accepted base."""
        caps = self.cls.capabilities
        spec = base.spec()
        probes: list[UnsupportedProbe] = []

        def add(label: str, **changes: object) -> None:
            probes.append(UnsupportedProbe(label, replace(spec, **changes)))

        for dt in MODEL_DTYPES:
            if dt not in caps.dtypes:
                add(f"dtype-{dtype_name(dt)}", dtype=dt, kv_cache_dtype=spec.resolved_kv_cache_dtype)
        for kvn in KV_CACHE_DTYPES:
            if kvn != "auto" and kvn not in caps.kv_cache_dtypes:
                add(f"kv-{kvn}", kv_cache_dtype=kvn)
        if caps.page_sizes is not None:
            bad = next(p for p in (3, 5, 7, 48, 96, 1000) if p not in caps.page_sizes)
            add(f"page{bad}", block_size=bad)
        elif caps.page_size_multiple is not None and caps.page_size_multiple > 1:
            add(f"page{caps.page_size_multiple + 1}", block_size=caps.page_size_multiple + 1)
        if caps.num_heads is not None:
            bad = next(h for h in (3, 7, 20, 100, 129) if h not in caps.num_heads)
            add(f"heads{bad}", num_heads=bad)
        if caps.max_num_heads is not None:
            add(f"heads{caps.max_num_heads + 1}", num_heads=caps.max_num_heads + 1)
        if caps.dims is not None:
            bad = next(d for d in ((320, 48), (384, 64), (96, 16)) if d not in caps.dims)
            add(f"dims{bad[0]}x{bad[1]}", kv_lora_rank=bad[0], qk_rope_head_dim=bad[1])
        if caps.query_len == QueryLenSupport.SINGLE:
            add("query-len-2", max_query_len=2)
        if caps.query_len == QueryLenSupport.UNIFORM:
            add("query-len-varlen", max_query_len=3, uniform_query_len=False)
        if not caps.sparse:
            add("sparse", sparse=True)
        if not caps.dense:
            add("dense", sparse=False)
        if not caps.returns_lse:
            add("need-lse", need_lse=True)
        if not caps.cpu:
            add("device-cpu", device=CPU_DEVICE)
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        cuda = [(6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
        if caps.compute_capabilities is not None:
            outside = [c for c in cuda if c not in caps.compute_capabilities]
        else:
            outside = [c for c in cuda if (lo is not None and c < lo) or (hi is not None and c > hi)]
        for cc in outside[:1] + outside[-1:] if len(outside) > 1 else outside:
            add(f"device-sm{cc[0]}{cc[1]}", device=simulated_device(*cc))
        return list({p.label: p for p in probes}.values())


def property_seeds(quick: bool, seeds: int | None = None, seed: int | None = None) -> tuple[int, ...]:
    """The property run's seeds: ``seeds`` of them from ``seed`` on (default :data:`PROPERTY_SEED`); unset,
    :data:`PROPERTY_CASES` in the quick matrix and none in the full one."""
    count = seeds if seeds is not None else (PROPERTY_CASES if quick else 0)
    first = PROPERTY_SEED if seed is None else seed
    return tuple(range(first, first + count))


@functools.lru_cache(maxsize=64)
def build_matrix(cls: type[MLABackend], quick: bool = False, seeds: int | None = None,
                 seed: int | None = None) -> Matrix:
    """All cases and probes for ``cls`` (cached per backend class and arguments). ``seeds`` / ``seed``: the
    property run (:func:`property_seeds`): one random case per seed, drawn inside the declarations."""
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 0):
        raise ValueError(f"seeds: got {seeds!r}; supported an int >= 0 or None")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed: got {seed!r}; supported an int >= 0 or None")
    b = _Builder(cls, quick, property_seeds(quick, seeds, seed))
    output = b.output_cases()
    base = next((c for c in output if not c.rejected), output[0])
    return Matrix(
        backend=cls,
        quick=quick,
        output=tuple(output),
        guard=tuple(b.guard_cases()),
        determinism=tuple(b.determinism_cases()),
        declared=tuple(b.declared_probes(output)),
        unsupported=tuple(b.unsupported_probes(base)) if not base.rejected else (),
    )
