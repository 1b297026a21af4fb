"""``REF_TORCH``: absorbed MLA decode in plain PyTorch, vectorised over requests, heads and pages.

Dense path, two forms, chosen by the size of the batch's rows (:func:`stream_min_rows`). While the padded rows
of all requests (``requests x sequence x 576`` in the compute dtype) stay under ``STREAM_MIN_BYTES``, the
requests are processed in padded groups: the pages named by the block table are gathered once, with one
``index_select``, into ``[requests, positions, 576]``; scores are one batched matmul against it (positions
first, ``[requests, positions, query rows]``, the layout CPU BLAS runs fastest), the causal and length mask is
applied, and the output is the softmax-weighted sum of the leading ``kv_lora_rank``
columns of the same rows (the latent serves as K and V). The index and mask tensors are made once per step
(:mod:`mla_backends.ref_torch.plans`). Longer requests are streamed, split-K: a few pages of every request of
a run are gathered into one cache-sized buffer, scored with one batched matmul, and turned into a partial
result normalised by its own maximum; the partials are folded into the running result every
``STREAM_FOLD_CHUNKS`` chunks, so each cached row leaves memory once and memory stays bounded. Sparse path:
the top-k rows of every token are gathered and attended the same way."""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch

from ..backends.contract import Capabilities, MLABackend, QueryLenSupport
from ..backends.v4_inputs import V4Keys
from ..core.attention_math import GROUP_ELEMENT_BUDGET, softmax_with_lse
from ..core.dtypes import KV_CACHE_DTYPES, RECORD_CACHE_DTYPES, accumulate_dtype, kv_cache_torch_dtype
from ..core.validation import require_int
from ..step.cache import LatentKVCache, position_slots
from ..step.metadata import BatchMetadata
from ..step.records import RecordCache
from .plans import EXP_FLOOR, HIDDEN_SCORE, RefStep, ScratchArena, prepare_step
from .v4 import v4_attention

__all__ = ["RefTorchBackend", "stream_chunk_pages", "stream_min_rows"]

#: a request is streamed (page chunks, each cached row read once, the chunk kept in cache) when the padded
#: rows of the whole batch, ``requests x its sequence x row bytes`` in the compute dtype, reach this many
#: bytes: below it one gather and two batched matmuls over all rows are as fast or faster, above it the
#: gathered rows no longer stay in cache between the two matmuls. Measured (benchmarks/bench_ref_decode_cpu.py
#: --crossover, float32, 576-wide rows; benchmarks/results/ref-decode-cpu.json) on the loaded 2-core machine
#: (32 MiB L3, 1 thread): from 8 to 24 MiB the two forms are within about 20 % (padded ahead at 32 requests,
#: streamed ahead at 8, mixed at 2), and from 32 MiB on the padded form is 2-3x slower. Issue 29's
#: quiet-machine figures at 8 requests x 1,064 rows (19.6 MB): padded 2.8 ms, streamed 3.2 ms. Issue 35
#: (loaded machine, 1 thread, --paths): at 8 requests x 1,024 rows (18.9 MiB) padded 16.1 ms, streamed 11.0 ms;
#: at 512 rows (9.4 MiB) within 3 %; hence 12 MiB (683 rows at 8 requests)
STREAM_MIN_BYTES = 12 << 20
#: ... and never shorter than this many rows: shorter streamed chunks cost more in kernel calls than they save
STREAM_MIN_ROWS = 256
#: bytes of gathered rows per streamed chunk, all requests of a group together, on CPUs with less than
#: ``LARGE_L2_BYTES`` of L2 a core. Small enough that the chunk is still in cache (two 1 MiB L2s, an 8 MiB L3 on
#: the AMD machine) when both matmuls read it. There, at 8 requests x 128 rows x 576 fp32 this is ~20 %
#: faster than 1024-row chunks (benchmarks/bench_layer_cpu.py).
SMALL_L2_CHUNK_BYTES = 5 << 19
#: ... and with at least this much L2 a core ...
LARGE_L2_BYTES = 2 << 20
#: ... this many. On the Intel machine (2 MiB L2s, AVX-512), 8 MiB chunks took 0.78-0.94x the time of 2.5 MiB
#: ones from 2,048 tokens on (8 requests, pages of 16 and 64, 1 and 2 threads; equal at 1,024), and 20-40 MiB
#: were slower again (docs/performance.md)
LARGE_L2_CHUNK_BYTES = 8 << 20


def cpu_l2_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Bytes of level-2 data (or unified) cache of the first CPU core, from Linux's sysfs under ``root``;
    None where it cannot be read (another OS, a container hiding it)."""
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for entry in entries:
        path = os.path.join(root, entry)
        try:
            with open(os.path.join(path, "level")) as fh:
                level = fh.read().strip()
            with open(os.path.join(path, "type")) as fh:
                kind = fh.read().strip()
            with open(os.path.join(path, "size")) as fh:
                size = fh.read().strip()
        except OSError:
            continue
        if level != "2" or kind not in ("Data", "Unified"):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            return None
    return None


def default_chunk_bytes(l2_bytes: int | None) -> int:
    """Streamed chunk bytes for a CPU with ``l2_bytes`` of L2 a core (None: unknown, the small-L2 value)."""
    return LARGE_L2_CHUNK_BYTES if l2_bytes is not None and l2_bytes >= LARGE_L2_BYTES else SMALL_L2_CHUNK_BYTES


#: bytes of gathered rows per streamed chunk; None: this machine's :func:`default_chunk_bytes`, its L2 read once,
#: on the first streamed call (:func:`stream_chunk_bytes`)
STREAM_CHUNK_BYTES: int | None = None


@functools.cache
def _machine_chunk_bytes() -> int:
    return default_chunk_bytes(cpu_l2_bytes())


def stream_chunk_bytes() -> int:
    """Bytes of gathered rows per streamed chunk: ``STREAM_CHUNK_BYTES`` when set, else this machine's."""
    return STREAM_CHUNK_BYTES if STREAM_CHUNK_BYTES is not None else _machine_chunk_bytes()
#: most rows per request in one streamed chunk
STREAM_MAX_CHUNK_ROWS = 1024
#: chunk partials kept before they are folded into the running result (bounds memory for any length)
STREAM_FOLD_CHUNKS = 16
#: most elements of kept partials (``slots x requests x q_len * heads x 512``); long queries fold more often
STREAM_PARTIAL_ELEMENTS = 1 << 22
#: most requests streamed together (bounds the chunk buffer and the partials)
STREAM_MAX_REQUESTS = 32
#: longest / shortest sequence within one streamed group. Every chunk is scored for every request of the group
#: (finished ones re-read their last page, hidden), so the group's work is requests x its longest length
STREAM_LENGTH_RATIO = 2.0
#: score given to hidden positions in the streamed path: finite, so that a chunk with nothing visible for a
#: row gives finite partials (weighted by exp(-1e30 - max) = 0 when merged) instead of NaN
_HIDDEN_SCORE = HIDDEN_SCORE


def stream_chunk_pages(num_requests: int, row_bytes: int, block_size: int) -> int:
    """Pages per request in one streamed chunk: :func:`stream_chunk_bytes` split over the requests, at least one
    page, at most ``STREAM_MAX_CHUNK_ROWS`` rows."""
    require_int("num_requests", num_requests, minimum=1)
    require_int("row_bytes", row_bytes, minimum=1)
    require_int("block_size", block_size, minimum=1)
    rows = min(STREAM_MAX_CHUNK_ROWS, stream_chunk_bytes() // (num_requests * row_bytes))
    return max(1, rows // block_size)


def stream_min_rows(num_requests: int, row_bytes: int) -> int:
    """Shortest sequence streamed in a batch of ``num_requests`` requests whose rows take ``row_bytes`` each
    in the compute dtype: ``STREAM_MIN_BYTES`` split over the requests, at least ``STREAM_MIN_ROWS``."""
    require_int("num_requests", num_requests, minimum=1)
    require_int("row_bytes", row_bytes, minimum=1)
    return max(STREAM_MIN_ROWS, -(-STREAM_MIN_BYTES // (num_requests * row_bytes)))


def _rows_past(seq_lens: tuple[int, ...], pos0: int, rows: int) -> torch.Tensor | None:
    """Indices into a streamed chunk's ``[len(seq_lens) * rows]`` rows (positions ``pos0 ..`` of every request) of
    the positions at or past each request's length, from the host lengths; None when there are none."""
    parts = [torch.arange(i * rows + max(s - pos0, 0), (i + 1) * rows) for i, s in enumerate(seq_lens)
             if s < pos0 + rows]
    return torch.cat(parts) if parts else None


def scaled_transposed_queries(q: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``out [b, 576, N] = scale * q [b, N, 576]`` transposed (N: query tokens x heads of a request), one
    kernel. The scores are then ``kv [b, L, 576] @ out``, ``[b, L, N]``: with the cached rows as the left
    operand, CPU BLAS runs this 1.24-1.75x faster than ``q @ kv^T`` at ``N`` = 16
    (``benchmarks/bench_decode_layouts_cpu.py``; benchmarks/results/ref-decode-cpu-layout.json)."""
    return torch.mul(q.transpose(1, 2), scale, out=out)


def exp_shifted(s_t: torch.Tensor, m: torch.Tensor, hidden: torch.Tensor | None) -> None:
    """``s_t [b, L, N] = exp(s_t - m)`` in place (``m`` broadcast over the positions), exactly 0 where
    ``hidden`` (broadcast to ``[b, L, Q, H]``; None: nothing hidden). Shifted scores are clamped at
    ``EXP_FLOOR`` first: a weight below ``exp(EXP_FLOOR)`` changes no sum, and exp's denormal and
    far-out-of-range inputs (hidden positions hold ``HIDDEN_SCORE``) make it 8-14x slower on the CPU when half
    the positions are hidden (same benchmark)."""
    s_t.sub_(m).clamp_min_(EXP_FLOOR).exp_()
    if hidden is not None:
        b, L, N = s_t.shape
        s_t.view(b, L, hidden.shape[2], -1).masked_fill_(hidden, 0.0)


def position_max(s_t: torch.Tensor) -> torch.Tensor:
    """``[b, N]`` largest score over the positions of ``s_t [b, L, N]`` (scores, positions before query
    rows). A max pool over the transposed view: ``amax(dim=1)`` is a strided reduction that PyTorch's CPU kernel
    runs 2.4-7x slower at ``N`` = 16 (same benchmark)."""
    return torch.nn.functional.adaptive_max_pool1d(s_t.transpose(1, 2), 1).squeeze(-1)


class RefTorchBackend(MLABackend):
    """Reference backend: any device torch runs on, every dtype, every page size, dense and sparse."""

    name: ClassVar[str] = "REF_TORCH"
    description: ClassVar[str] = "plain PyTorch absorbed decode (reference semantics; production path on CPU)"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64}),
        kv_cache_dtypes=frozenset(k for k in KV_CACHE_DTYPES if k != "auto") | RECORD_CACHE_DTYPES,
        cpu=True,
        min_compute_capability=(7, 0),
        max_compute_capability=None,
        preferred_page_size=16,
        query_len=QueryLenSupport.VARLEN,
        decode_threshold=1,
        dense=True,
        sparse=True,
        sinks=True,  # DeepSeek-V4: sinks, sliding window, compressed keys (mla_backends/ref_torch/v4.py)
        window=True,
        compressed=True,
        returns_lse=True,
        host_sync_free=True,  # dense calls; shapes come from the metadata's host lists
        cuda_graphs=False,  # those host lists size the work: a captured graph would not follow new lengths
    )
    #: prepare needs the heads and widths (its padded groups are cut by them): unconfigured, a call prepares
    #: for itself on the configured backend its inputs describe
    prepare_needs_configuration: ClassVar[bool] = True

    def make_resources(self) -> ScratchArena:
        """The configuration's :class:`~mla_backends.ref_torch.plans.ScratchArena`: working buffers, one set
        per thread, reused by every layer and step."""
        return ScratchArena()

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
        v4: V4Keys | None = None,
    ) -> None:
        """Dense (streamed or padded groups), sparse or DeepSeek-V4 attention into ``out`` / ``lse_out`` (see
        :meth:`MLABackend.forward_mqa`, which validated the inputs); ``state`` is this step's
        :class:`~mla_backends.ref_torch.plans.RefStep` (:meth:`prepare`); ``v4`` the V4 inputs
        (:func:`~mla_backends.ref_torch.v4.v4_attention`)."""
        assert lse_out is not None  # returns_lse: forward_mqa always provides it
        cdt = accumulate_dtype(q_latent.dtype)
        T, H, r = q_latent.shape
        if not isinstance(state, RefStep):  # a subclass's own state (or none): prepared for this call only
            state = self._prepare_for(meta, r + q_rope.shape[-1], H, cdt, None,
                                      dense=v4 is None and not isinstance(cache, RecordCache))
        step = state
        q = step.buffer("q", (T, H, r + q_rope.shape[-1]), cdt, q_latent.device)  # [T, H, 576]
        q[..., :r], q[..., r:] = q_latent, q_rope  # one copy each (and conversion), into the step's buffer
        if v4 is not None or (topk_indices is None and isinstance(cache, RecordCache)):
            # fp8 records are read row by row (a dense call: the whole causal context, no sink)
            v4_attention(q, cache, meta, scale, v4 or V4Keys(), out, lse_out)
        elif topk_indices is not None:
            self._sparse(q, cache, meta, topk_indices, scale, out, lse_out)
        else:
            self._dense_dispatch(q, cache, meta, scale, out, lse_out, step)

    # ---- dense -----------------------------------------------------------------------------------------
    @staticmethod
    def dense_parts(meta: BatchMetadata, row_bytes: int) -> list[tuple[bool, int, int]]:
        """How a dense call over ``meta`` splits: ``(streamed, start, stop)`` runs of processing-order requests
        holding tokens. Long sequences (at least :func:`stream_min_rows` for this batch, ``row_bytes`` bytes a
        row in the compute dtype) stream through page chunks, several consecutive requests of one query length
        and similar lengths (within ``STREAM_LENGTH_RATIO``) at a time; runs of short ones take padded groups."""
        seqs, qlens = meta.seq_lens_list, meta.query_lens_list
        min_rows = stream_min_rows(meta.num_requests, row_bytes)
        if all(s < min_rows for s in seqs):
            return [(False, 0, meta.num_requests)]
        starts = meta.query_starts_list
        parts = []
        b = 0
        while b < meta.num_requests:
            long_run = seqs[b] >= min_rows
            e, lo, hi = b + 1, seqs[b], seqs[b]
            while e < meta.num_requests and (seqs[e] >= min_rows) == long_run:
                if long_run:  # one query length, bounded size, and lengths close enough that padding is cheap
                    lo, hi = min(lo, seqs[e]), max(hi, seqs[e])
                    if qlens[e] != qlens[b] or e - b >= STREAM_MAX_REQUESTS or hi > STREAM_LENGTH_RATIO * lo:
                        break
                e += 1
            if starts[e] > starts[b]:
                parts.append((long_run, b, e))
            b = e
        return parts

    def _dense_dispatch(self, q: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata, scale: float,
                        out: torch.Tensor, lse_out: torch.Tensor, step: RefStep) -> None:
        """The runs of :meth:`dense_parts`: streamed ones through :meth:`_stream`, the others through
        :meth:`_dense` (padded groups from ``step``)."""
        seqs = meta.seq_lens_list
        parts = step.parts if step.parts is not None else self.dense_parts(meta, q.shape[-1] * q.element_size())
        if len(parts) == 1 and tuple(parts[0]) == (False, 0, meta.num_requests):
            self._dense(q, cache, meta, scale, out, lse_out, step, None)
            return
        starts = meta.query_starts_list
        for streamed, b, e in parts:
            t0, t1 = starts[b], starts[e]
            if streamed:
                self._stream(q[t0:t1], cache, meta.block_table[b:e], meta.context_lens_list[b:e], seqs[b:e],
                             scale, out[t0:t1], lse_out[t0:t1], step)
            else:
                self._dense(q[t0:t1], cache, meta, scale, out[t0:t1], lse_out[t0:t1], step, (b, e))

    @staticmethod
    def _stream(q: torch.Tensor, cache: LatentKVCache, block_rows: torch.Tensor,
                context_lens: tuple[int, ...], seq_lens: tuple[int, ...], scale: float, out: torch.Tensor,
                lse_out: torch.Tensor, step: RefStep | None = None) -> None:
        """Requests with one query length ``n`` (``q [b * n, H, 576]``, compute dtype), split-K over pages.

        The pages are gathered a few per request at a time (:func:`stream_chunk_pages`) into one buffer that
        is still in cache when both batched matmuls read it (scores ``[b, rows, n*H]``, positions first, as in
        :meth:`_dense`). Each chunk yields a partial result normalised by its own maximum: ``max [b, n*H]``,
        ``sum [b, n*H]`` and ``P @ latent [b, n*H, 512]``. Every
        ``STREAM_FOLD_CHUNKS`` chunks the partials are folded into the running result with one batched
        matmul, so the per-chunk work is a handful of kernels and memory stays bounded for any length.
        Requests with fewer pages re-read their last page, hidden. Each cached row leaves memory once. The
        buffers come from ``step`` (made by the step's first layer, reused by the others).
        """
        step = RefStep() if step is None else step
        b = len(seq_lens)
        n = q.shape[0] // b
        _, H, W = q.shape
        nH = n * H
        r, bs, dev, cdt = cache.kv_lora_rank, cache.block_size, q.device, q.dtype
        q_t = scaled_transposed_queries(q.reshape(b, nH, W), scale, step.buffer("stream_qt", (b, W, nH), cdt, dev))
        per = stream_chunk_pages(b, cache.row_width * q.element_size(), bs)
        pages = [-(-s // bs) for s in seq_lens]
        n_chunks = -(-max(pages) // per)
        # page ids per chunk, [chunks, b, per], short requests padded with their last page (one gather; the
        # column of every entry comes from the host page counts)
        col = torch.minimum(torch.arange(n_chunks * per)[None, :], torch.tensor(pages)[:, None] - 1)
        padded = block_rows[:, : max(pages)].long().gather(1, col.to(dev))
        chunk_ids = padded.view(b, n_chunks, per).transpose(0, 1).contiguous()
        rows = per * bs
        direct = cache.data.dtype == cdt and not cache.is_fp8
        exact_fp8 = cache.is_fp8 and cdt != torch.float32
        raw = step.buffer("stream_raw", (b * per, bs, W), cache.data.dtype, dev)
        kv = (raw if direct else step.buffer("stream_kv", (b * per, bs, W), cdt, dev)).view(b, rows, W)
        kv_latent = kv[..., :r]
        s_t = step.buffer("stream_s", (b, rows, nH), cdt, dev)  # scores, positions before query rows
        p = s_t.transpose(1, 2)  # [b, nH, rows] view: the weights as the second matmul reads them
        G = max(1, min(STREAM_FOLD_CHUNKS, n_chunks, STREAM_PARTIAL_ELEMENTS // (b * nH * r)))
        part = step.buffer("stream_part", (G, b, nH, r), cdt, dev)
        c_max = step.buffer("stream_max", (G, b, nH), cdt, dev)
        c_sum = step.buffer("stream_sum", (G, b, nH), cdt, dev)
        m = step.buffer("stream_m", (b, nH), cdt, dev).fill_(_HIDDEN_SCORE)
        l_sum = step.buffer("stream_l", (b, nH), cdt, dev).zero_()
        acc = step.buffer("stream_acc", (b, nH, r), cdt, dev).zero_()
        # last visible position of every (request, token): context + token index
        ctx = torch.tensor(context_lens, device=dev)
        limit = ctx[:, None, None] + torch.arange(n, device=dev)[None, None, :]  # [b, 1, n]
        edge = min(context_lens)  # chunks reaching past this hold someone's causal / length edge
        # per-slot views made once: the loop below is a handful of kernel calls per chunk, nothing else
        slot_max, slot_sum, slot_part = c_max.unbind(0), c_sum.unbind(0), part.unbind(0)
        slot_max_row = [t.unsqueeze(1) for t in slot_max]
        for c, page_ids in enumerate(chunk_ids.view(n_chunks, b * per).unbind(0)):
            g = c % G
            torch.index_select(cache.data, 0, page_ids, out=raw)
            if exact_fp8:  # the scale applied as LatentKVCache.dequantize applies it (float64 for float64)
                kv.view_as(raw).copy_(cache.dequantize(raw, cdt))
            elif not direct:  # one conversion kernel into the compute-dtype buffer, then the fp8 scale
                kv.view_as(raw).copy_(raw)
                if cache.is_fp8:
                    kv.mul_(cache.scale)
            pos0 = c * rows
            masked = pos0 + rows - 1 > edge
            if masked:  # the chunk holds someone's causal / length edge: positions past it are hidden ...
                hidden = torch.arange(pos0, pos0 + rows, device=dev)[None, :, None] > limit  # [b, rows, n]
                past = _rows_past(seq_lens, pos0, rows)  # ... and rows past a sequence zeroed: unowned slots
                if past is not None:  # may hold NaN (0 x NaN = NaN); the indices come from host lengths
                    kv.view(b * rows, W).index_fill_(0, past.to(dev), 0.0)
            torch.bmm(kv, q_t, out=s_t)
            if masked:
                s_t.view(b, rows, n, H).masked_fill_(hidden[..., None], _HIDDEN_SCORE)
            slot_max[g].copy_(position_max(s_t))
            exp_shifted(s_t, slot_max_row[g], hidden[..., None] if masked else None)
            torch.sum(s_t, dim=1, out=slot_sum[g])
            torch.bmm(p, kv_latent, out=slot_part[g])
            if g == G - 1 or c == n_chunks - 1:  # fold the partials: weights exp(chunk max - new max)
                k = g + 1
                m_new = torch.maximum(m, c_max[:k].amax(dim=0))
                w = torch.exp(c_max[:k] - m_new)  # [k, b, nH]
                alpha = torch.exp(m - m_new)
                l_sum = l_sum * alpha + (w * c_sum[:k]).sum(dim=0)
                acc.mul_(alpha[..., None])
                acc.view(b * nH, 1, r).baddbmm_(w.view(k, b * nH, 1).permute(1, 2, 0),
                                                 part[:k].view(k, b * nH, r).transpose(0, 1))
                m = m_new
        # every row sees position 0, so l_sum > 0 and m is a real score
        out.copy_((acc / l_sum[..., None]).view(b * n, H, r).to(out.dtype))
        lse_out.copy_((m + torch.log(l_sum)).view(b * n, H).to(lse_out.dtype))

    def prepare(self, meta: BatchMetadata) -> RefStep | None:
        """This step's complete :class:`~mla_backends.ref_torch.plans.RefStep` for ``meta`` (once per step, from
        host data): the dense split, every padded group's page ids and masks, and the planning thread's
        buffers reserved in this configuration's arena. None on an unconfigured instance (its calls prepare
        for themselves)."""
        spec = self.layer_spec
        if spec is None:
            return None
        cdt = accumulate_dtype(spec.dtype)
        try:
            direct = kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype) == cdt
        except (ValueError, TypeError):
            direct = False
        arena = self.resources if isinstance(self.resources, ScratchArena) else ScratchArena()
        return self._prepare_for(meta, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.num_heads, cdt, arena,
                                 gather_direct=direct,
                                 dense=not (spec.window or spec.compressed  # V4 calls use no groups
                                            or spec.kv_cache_dtype in RECORD_CACHE_DTYPES))  # nor fp8 records

    def _prepare_for(self, meta: BatchMetadata, W: int, H: int, cdt: torch.dtype, arena: ScratchArena | None, *,
                     gather_direct: bool = False, dense: bool = True) -> RefStep:
        """The :class:`~mla_backends.ref_torch.plans.RefStep` of ``meta`` for rows ``W`` wide, ``H`` heads and
        the compute dtype ``cdt``; buffers from ``arena`` (None: this configuration's, else a fresh one).
        ``dense=False``: no dense split or groups (DeepSeek-V4 calls read none)."""
        if arena is None:
            arena = self.resources if isinstance(self.resources, ScratchArena) else ScratchArena()
        row_bytes = W * torch.empty((), dtype=cdt).element_size()
        parts = self.dense_parts(meta, row_bytes) if meta.num_tokens and dense else []
        return prepare_step(meta, parts, W, H, GROUP_ELEMENT_BUDGET, arena, compute_dtype=cdt,
                            gather_direct=gather_direct)

    def _dense(self, q: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata, scale: float,
               out: torch.Tensor, lse_out: torch.Tensor, step: RefStep, part: tuple[int, int] | None) -> None:
        """Padded groups (``q [T, H, 576]``, compute dtype): per group one ``index_select`` of its pages into
        ``kv [b, L, 576]`` (a buffer of the step), scores ``scale * kv @ q^T`` in one batched matmul
        ``[b, L, Q*H]`` (positions first; the queries a transposed view, the scale the matmul's ``alpha``),
        hidden positions set to a large negative finite score, the max over the positions
        (:func:`position_max`), ``exp(s - max)`` in place with hidden positions exactly 0
        (:func:`exp_shifted`), and the output ``exp^T @ kv[..., :512]`` divided by the sums, written straight
        into ``out`` when its layout allows.
        Index and mask tensors come from ``step`` (requests ``part`` of ``meta``, or all of them)."""
        T, H, W = q.shape
        r, dev, cdt = cache.kv_lora_rank, q.device, q.dtype
        groups = step.groups_for(meta, part, W, H, GROUP_ELEMENT_BUDGET)
        direct = cache.data.dtype == cdt and not cache.is_fp8
        for grp in groups:
            b, Q, L = grp.stop - grp.start, grp.q_len, grp.rows
            if direct:  # gathered straight into the step's buffer, no conversion
                kv = step.buffer("dense_kv", (grp.page_ids.numel(), *cache.data.shape[1:]), cdt, dev)
                torch.index_select(cache.data, 0, grp.page_ids, out=kv)
                kv = kv.view(b, L, W)
            else:
                kv = cache.dequantize(torch.index_select(cache.data, 0, grp.page_ids), cdt).view(b, L, W)
            if grp.tails is not None:  # rows past a sequence: unowned slots may hold NaN (0 x NaN = NaN)
                kv.view(b * L, W).index_fill_(0, grp.tails, 0.0)
            tok0, QH = grp.first_token, Q * H
            if grp.token_rows is None:  # uniform query length: a plain view, no padding
                qg = q[tok0: tok0 + b * Q].reshape(b, QH, W)
            else:
                qg = q.index_select(0, grp.token_rows).reshape(b, QH, W)
            s_t = step.buffer("dense_s", (b, L, QH), cdt, dev)  # scores, positions before query rows
            # the queries as a transposed view: at padded-group sizes BLAS takes it as fast as a copy
            torch.baddbmm(s_t, kv, qg.transpose(1, 2), beta=0, alpha=scale, out=s_t)
            hidden = grp.hidden.permute(0, 3, 1, 2)  # [b, L, Q, 1]
            s_t.view(b, L, Q, H).masked_fill_(hidden, _HIDDEN_SCORE)
            m = position_max(s_t).unsqueeze(1)  # [b, 1, QH], a real score: every row sees position 0
            exp_shifted(s_t, m, hidden)
            l_sum = s_t.sum(dim=1, keepdim=True)
            p, norm = s_t.transpose(1, 2), l_sum.transpose(1, 2)  # [b, QH, L], [b, QH, 1]
            uniform = grp.token_rows is None
            rows_out = out[tok0: tok0 + b * Q] if uniform else None
            in_place = rows_out is not None and rows_out.dtype == cdt and rows_out.is_contiguous()
            if in_place:  # the output rows themselves
                o = torch.bmm(p, kv[..., :r], out=rows_out.view(b, QH, r)).div_(norm)
            else:
                o = torch.bmm(p, kv[..., :r]).div_(norm)
            lse = l_sum.log_().add_(m).view(b * Q, H)
            if uniform:
                if not in_place:
                    out[tok0: tok0 + b * Q] = o.view(b * Q, H, r)
                lse_out[tok0: tok0 + b * Q] = lse
            else:
                o = o.view(b * Q, H, r)
                out.index_copy_(0, grp.dest, o.index_select(0, grp.keep).to(out.dtype))
                lse_out.index_copy_(0, grp.dest, lse.index_select(0, grp.keep).to(lse_out.dtype))

    # ---- sparse ----------------------------------------------------------------------------------------
    def _sparse(self, q: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata, topk: torch.Tensor,
                scale: float, out: torch.Tensor, lse_out: torch.Tensor) -> None:
        T, H, W = q.shape
        r, bs = cache.kv_lora_rank, cache.block_size
        K = topk.shape[1]
        step = max(1, GROUP_ELEMENT_BUDGET // max(1, K * (W + H)))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            idx = topk[t0:t1].long()
            valid = idx >= 0
            pos = idx.clamp_min(0)
            req = meta.token_request[t0:t1, None].expand_as(pos)
            slots = position_slots(meta.block_table, req, pos, bs)
            kv = cache.dequantize(cache.stored_rows(slots), q.dtype)  # [t, K, W]
            scores = torch.matmul(q[t0:t1], kv.transpose(1, 2)).mul_(scale)  # [t, H, K]
            scores.masked_fill_(~valid[:, None, :], float("-inf"))
            o, lse = softmax_with_lse(scores, kv[..., :r])
            out[t0:t1] = o.to(out.dtype)
            lse_out[t0:t1] = lse.to(lse_out.dtype)
