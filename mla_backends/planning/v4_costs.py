"""Sizing a DeepSeek-V4 deployment: every cache pool, per page, per token and per request (vLLM's rules).

A V4 layer keeps up to five pools (the library's stores, ``mla_backends/layer/v4/cache.py``, hold the same rows):

==================  ==========================  =================================  ================  =============
pool                layers                      row                                page (tokens)     kept
==================  ==========================  =================================  ================  =============
``window``          every layer                 one token: 512 values (1,024 B      64                the window
                                                bf16; 584 B ``fp8_ds_mla``)
``compressed``      CSA, HCA                    one entry (``ratio`` tokens), as    256 (256/ratio    the sequence
                                                a window row                        rows)
``state``           CSA, HCA                    one token: ``kv | gate`` float32,   4 (ratio 4),      ``c*ratio``
                                                ``2 c 512`` values (c = 2 CSA)      8 (ratio 128)     tokens
``indexer_keys``    CSA                         one entry: 128 fp8 + one float32   256 (64 rows)     the sequence
                                                scale (132 B)
``indexer_state``   CSA                         one token: ``2 * 2 * 128`` float32  4                 8 tokens
==================  ==========================  =================================  ================  =============

Pages are rounded up to the layout's alignment (512 bytes, 576 for ``fp8_ds_mla``). A pool that keeps the whole
sequence costs ``ceil(max_model_len / page tokens)`` pages a request and grows by ``page bytes / page tokens``
per token; a pool that keeps a window costs ``ceil(min(window - 1 + in-flight tokens, max_model_len) / page
tokens) + 1`` pages a request (a window need not start on a page) and does not grow. These are vLLM 0.32's spec
classes' ``page_size_bytes`` and ``max_memory_usage_bytes`` (the figures its admission check adds up), as built
by its V4 modules (``tests/vllm_engine/test_v4_vllm_sizing.py`` compares them live; the recorded figures are
``benchmarks/results/v4-vllm-sizing.json``). How vLLM then packs pools of different page sizes into shared
tensors is not modelled here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.v4dims import CSA, HCA, LAYER_KINDS, SLIDING, V4Dims
from ..core.validation import require_int

__all__ = ["V4Pool", "v4_pools", "v4_request_bytes", "v4_report", "V4_LAYOUTS", "WINDOW_PAGE_TOKENS",
           "CACHE_PAGE_TOKENS", "STATE_PAGE_TOKENS"]

#: tokens per page of vLLM's V4 pools: the window cache, the compressed / indexer caches, the compressor states
WINDOW_PAGE_TOKENS = 64
CACHE_PAGE_TOKENS = 256
STATE_PAGE_TOKENS = {4: 4, 128: 8}
#: the two row layouts: bytes per 512-wide row, page alignment in bytes
V4_LAYOUTS = {"bfloat16": (1024, 512), "fp8_ds_mla": (584, 576)}
#: the indexer key: 128 fp8 values + one float32 scale per 128
_INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class V4Pool:
    """One pool of one layer kind.

    Attributes:
        name / kind / layers: the pool, the layer kind holding it and how many layers do.
        page_tokens: tokens a page covers. rows_per_page / row_bytes: rows a page holds and their bytes.
        page_bytes: a page, rounded up to the alignment. window: tokens kept (None: the whole sequence).
    """

    name: str
    kind: str
    layers: int
    page_tokens: int
    rows_per_page: int
    row_bytes: int
    page_bytes: int
    window: int | None

    def pages_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """vLLM's admission bound of one request, in pages of one layer."""
        if self.window is None:
            return -(-max_model_len // self.page_tokens)
        return -(-min(self.window - 1 + in_flight_tokens, max_model_len) // self.page_tokens) + 1

    def bytes_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """One request's bytes in one layer of this pool (:meth:`pages_per_request` pages)."""
        return self.pages_per_request(max_model_len, in_flight_tokens) * self.page_bytes

    @property
    def bytes_per_token(self) -> float:
        """Growth per token of one layer (0 for a windowed pool, which does not grow)."""
        return 0.0 if self.window is not None else self.page_bytes / self.page_tokens


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def v4_pools(dims: V4Dims, *, kv_cache_dtype: str = "bfloat16",
             page_tokens: int = CACHE_PAGE_TOKENS) -> list[V4Pool]:
    """Every pool of ``dims``' layers (one entry per pool and layer kind present), in vLLM's layout.

    ``kv_cache_dtype``: ``bfloat16`` (plain rows) or ``fp8_ds_mla`` (584-byte records). ``page_tokens``: the
    compressed and indexer pools' page (vLLM's ``--block-size``; its V4 kernels take 256).
    """
    if not isinstance(dims, V4Dims):
        raise TypeError(f"dims: got {type(dims).__name__}; supported V4Dims")
    if kv_cache_dtype not in V4_LAYOUTS:
        raise ValueError(f"kv_cache_dtype: got {kv_cache_dtype!r}; supported {', '.join(V4_LAYOUTS)}")
    require_int("page_tokens", page_tokens, minimum=1)
    row, align = V4_LAYOUTS[kv_cache_dtype]
    row = row * dims.head_dim // 512 if kv_cache_dtype == "bfloat16" else row
    counts = dims.kinds_count()
    pools: list[V4Pool] = []

    def add(name: str, kind: str, tokens: int, rows: int, row_bytes: int, window: int | None) -> None:
        pools.append(V4Pool(name, kind, counts[kind], tokens, rows, row_bytes, _round_up(rows * row_bytes, align),
                            window))

    for kind in LAYER_KINDS:
        if not counts[kind]:
            continue
        add("window", kind, WINDOW_PAGE_TOKENS, WINDOW_PAGE_TOKENS, row, dims.sliding_window)
        if kind == SLIDING:
            continue
        r = dims.ratio_of(kind)
        if page_tokens % r:
            raise ValueError(f"page_tokens: got {page_tokens}; supported a multiple of the {kind} ratio {r}")
        if r not in STATE_PAGE_TOKENS:
            raise ValueError(f"dims.{'csa' if kind == CSA else 'hca'}_ratio: got {r}; supported "
                             f"{', '.join(map(str, STATE_PAGE_TOKENS))} (vLLM's compressor state pages)")
        c = 2 if kind == CSA else 1
        add("compressed", kind, page_tokens, page_tokens // r, row, None)
        st = STATE_PAGE_TOKENS[r]
        add("state", kind, st, st, 2 * c * dims.head_dim * 4, c * r)
        if kind == CSA:
            Di = dims.index_head_dim
            add("indexer_keys", kind, page_tokens, page_tokens // r, Di + Di // _INDEXER_QUANT_BLOCK * 4, None)
            add("indexer_state", kind, st, st, 2 * 2 * Di * 4, 2 * r)
    return pools


def v4_request_bytes(pools: list[V4Pool], max_model_len: int, in_flight_tokens: int) -> int:
    """One request's bytes over every layer of every pool (vLLM's admission sum)."""
    require_int("max_model_len", max_model_len, minimum=1)
    require_int("in_flight_tokens", in_flight_tokens, minimum=1)
    return sum(p.layers * p.bytes_per_request(max_model_len, in_flight_tokens) for p in pools)


def v4_report(dims: V4Dims, *, kv_cache_dtype: str = "bfloat16", max_model_len: int = 65536,
              in_flight_tokens: int = 8192, page_tokens: int = CACHE_PAGE_TOKENS,
              cache_memory_bytes: int | None = None) -> dict[str, Any]:
    """The ``mla-backends kv-cache`` report of a V4 model: every pool (page, per token, per request, per layer
    and over its layers), the totals, and with ``cache_memory_bytes`` the requests of ``max_model_len`` that fit."""
    pools = v4_pools(dims, kv_cache_dtype=kv_cache_dtype, page_tokens=page_tokens)
    rows = []
    for p in pools:
        per_req = p.bytes_per_request(max_model_len, in_flight_tokens)
        rows.append({**asdict(p), "bytes_per_token_per_layer": p.bytes_per_token,
                     "pages_per_request_per_layer": p.pages_per_request(max_model_len, in_flight_tokens),
                     "bytes_per_request_per_layer": per_req, "bytes_per_request": per_req * p.layers})
    total = sum(r["bytes_per_request"] for r in rows)
    rep: dict[str, Any] = {
        "model": dims.name, "kv_cache_dtype": kv_cache_dtype, "num_layers": dims.num_layers,
        "layers": dims.kinds_count(), "ratios": {CSA: dims.csa_ratio, HCA: dims.hca_ratio},
        "sliding_window": dims.sliding_window, "max_model_len": max_model_len, "in_flight_tokens": in_flight_tokens,
        "pools": rows, "bytes_per_token": sum(r["bytes_per_token_per_layer"] * r["layers"] for r in rows),
        "bytes_per_request_fixed": sum(r["bytes_per_request"] for r in rows if r["window"] is not None),
        "bytes_per_request": total,
    }
    if cache_memory_bytes is not None:
        rep["requests_that_fit"] = cache_memory_bytes // total
    return rep
