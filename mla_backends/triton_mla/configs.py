"""``TRITON_MLA``'s launch configurations as data (no triton import): which kernel, which tiles, which grid.

Two attention kernels exist (``docs/triton.md``):

* ``heads`` (:func:`~mla_backends.triton_mla.kernels.mla_decode_stage1`, the portable kernel): one program
  takes ``block_h`` heads of one query token; any SM80+ GPU, dense and sparse, every dtype.
* ``rows`` (:func:`~mla_backends.triton_mla.kernels_rows.mla_decode_rows`, the Hopper kernel): one program
  takes 64 rows, ``heads x query tokens`` of one request, so that ``tl.dot`` has M = 64 (``wgmma`` on SM90)
  and a request's query tokens read each cache tile once; dense, 16-bit queries.

:data:`CONFIG_TABLE` lists, per architecture, head count and dtype, the candidates in order; the first whose
shared-memory estimate fits the device is chosen (:func:`choose_config`). ``mla-backends list`` prints the
table (:func:`table_rows`); ``benchmarks/triton_compile_report.py`` compiles every configuration it can
choose.

Grids put tokens (times head blocks) on axis 0, which CUDA allows up to ``2**31 - 1`` programs; axes 1 and 2
(capped at 65,535) only hold split counts (<= 64). See :func:`stage1_grid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KernelConfig",
    "ConfigRule",
    "CONFIG_TABLE",
    "INTERPRET_BLOCK_N",
    "GRID_AXIS0_MAX",
    "GRID_AXIS12_MAX",
    "ROWS_PER_PROGRAM",
    "KERNELS",
    "choose_config",
    "fitting_configs",
    "operand_bytes",
    "shared_bytes_estimate",
    "rows_layout",
    "stage1_grid",
    "merge_grid",
    "table_rows",
    "V4_CONFIG_TABLE",
    "choose_v4_config",
    "v4_operand_class",
]

#: CUDA's grid limits: axis 0 up to 2**31 - 1 programs, axes 1 and 2 up to 65,535
GRID_AXIS0_MAX = 2**31 - 1
GRID_AXIS12_MAX = 65_535
#: rows (heads x query tokens) one program of the ``rows`` kernel holds: the M of Hopper's warpgroup MMA
ROWS_PER_PROGRAM = 64
#: tile rows under the interpreter (fewer interpreted steps; warps and stages mean nothing there)
INTERPRET_BLOCK_N = 64
#: the kernel names a configuration can name
KERNELS = ("heads", "rows")


@dataclass(frozen=True)
class KernelConfig:
    """One compile-time configuration of an attention kernel.

    Attributes:
        name: the table row's name (``"sm90-rows64"``), shown by ``mla-backends list`` and the compile report.
        kernel: ``"heads"`` (portable) or ``"rows"`` (Hopper, 64 rows of heads x query tokens a program).
        block_h: ``heads``: heads per program; ``rows``: the most heads of one token per program (the rest
            of the 64 rows are the request's next query tokens; :func:`rows_layout`).
        block_n: cache rows per tile (positions).
        num_warps / num_stages: Triton's launch options.
        fp32_dots: dot operands in float32 (``"ieee"``), for float32 queries or caches and 16-bit mixes.
        qk_fp8: ``rows`` only: the score product runs fp8 x fp8 (queries quantised per token and head).
    """

    name: str
    kernel: str
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    fp32_dots: bool = False
    qk_fp8: bool = False


@dataclass(frozen=True)
class ConfigRule:
    """One row of :data:`CONFIG_TABLE`: when it applies, and its candidates (first fitting wins).

    Attributes:
        archs: compute-capability majors it applies to (None: any).
        min_heads / max_heads: inclusive head-count bounds (None: unbounded).
        operands: ``"16bit"`` (bf16/fp16 query with a cache of the same dtype or fp8), ``"fp32"`` (a float32
            query or cache, or a bf16/fp16 mix), or ``"any"``.
        sparse: True/False to apply only to sparse/dense calls, None for both.
        qk_fp8: applies only when the backend's ``fp8_qk`` option is on (and the cache is fp8 e4m3).
        candidates: configurations in order of preference.
    """

    archs: tuple[int, ...] | None
    min_heads: int
    max_heads: int | None
    operands: str
    sparse: bool | None
    qk_fp8: bool
    candidates: tuple[KernelConfig, ...]

    def matches(self, major: int, heads: int, operands: str, sparse: bool, qk_fp8: bool) -> bool:
        """Whether this rule applies to a call."""
        return (
            (self.archs is None or major in self.archs)
            and heads >= self.min_heads
            and (self.max_heads is None or heads <= self.max_heads)
            and self.operands in ("any", operands)
            and (self.sparse is None or self.sparse == sparse)
            and self.qk_fp8 == qk_fp8
        )


def _heads(name: str, block_h: int, block_n: int, fp32: bool = False) -> KernelConfig:
    return KernelConfig(name, "heads", block_h, block_n, 8, 2, fp32_dots=fp32)


def _rows(name: str, block_n: int, stages: int, qk_fp8: bool = False, warps: int = 8) -> KernelConfig:
    return KernelConfig(name, "rows", ROWS_PER_PROGRAM, block_n, warps, stages, qk_fp8=qk_fp8)


_PORTABLE_16 = (
    _heads("heads16-n32", 16, 32),
    _heads("heads16-n16", 16, 16),
)
_PORTABLE_32 = (
    _heads("heads32-n32", 32, 32),
    _heads("heads32-n16", 32, 16),
    _heads("heads16-n16-narrow", 16, 16),
)
# float32 tiles are twice as wide: 16 rows keep the registers unspilled (16 is also the smallest K of a dot).
# 32 heads a program only on SM8x, where the 99 KiB parts (SM86/89) fall back to 16 heads (SM90 spills at 32)
_PORTABLE_FP32_16 = (_heads("fp32-heads16-n16", 16, 16, True),)
_PORTABLE_FP32_32 = (_heads("fp32-heads32-n16", 32, 16, True), _heads("fp32-heads16-n16", 16, 16, True))
# 32-row tiles at 3 stages first: every score instruction reads a [64, 16] slice of the query block from
# shared memory whatever the tile's width, so 32-row tiles read less per FLOP than 16-row ones. The score is
# not split between the two warpgroups: Triton gives the chained score dots warpsPerCTA [8, 1], so each
# warpgroup computes the whole [64, BLOCK_N] score (72 HGMMA.64x16x16 a 32-row tile each); only the output
# product is split, 256 columns a warpgroup (SASS figures and the model: docs/triton.md, "What the compiled
# kernel runs" and "Tile size and the ceiling it gives"). Both compile without spills under Triton 3.6 (the device
# image's) and 3.9 at 16/64/128 heads; the 16-row tiles (4, then 2 stages: less shared memory) follow as the
# fallbacks. fp8 score products: the fp8 tiles take half the bytes, so 4 stages fit in 110,592 bytes.
_ROWS = (_rows("sm90-rows64-n32-s3", 32, 3), _rows("sm90-rows64-n16-s4", 16, 4), _rows("sm90-rows64-n16", 16, 2))
_ROWS_FP8QK = (
    _rows("sm90-rows64-n32-s4-fp8qk", 32, 4, True),
    _rows("sm90-rows64-n16-s4-fp8qk", 16, 4, True),
    _rows("sm90-rows64-n16-fp8qk", 16, 2, True),
)

#: the configuration table: the first matching rule whose first fitting candidate is chosen
CONFIG_TABLE: tuple[ConfigRule, ...] = (
    ConfigRule((9,), 16, 16, "16bit", False, True, _ROWS_FP8QK + _PORTABLE_16),
    ConfigRule((9,), 17, None, "16bit", False, True, _ROWS_FP8QK + _PORTABLE_32),
    ConfigRule((9,), 16, 16, "16bit", False, False, _ROWS + _PORTABLE_16),
    ConfigRule((9,), 17, None, "16bit", False, False, _ROWS + _PORTABLE_32),
    ConfigRule(None, 1, 16, "16bit", None, False, _PORTABLE_16),
    ConfigRule(None, 17, None, "16bit", None, False, _PORTABLE_32),
    ConfigRule((8,), 17, None, "fp32", None, False, _PORTABLE_FP32_32),
    ConfigRule(None, 1, None, "fp32", None, False, _PORTABLE_FP32_16),
)


def _v4(name: str, block_h: int, block_n: int, warps: int = 4, fp32: bool = False) -> KernelConfig:
    return KernelConfig(name, "v4", block_h, block_n, warps, 1, fp32_dots=fp32)


#: the DeepSeek-V4 kernel (:mod:`~mla_backends.triton_mla.kernels_v4`: a window range, gathered compressed
#: entries and a sink; also every call on ``fp8_ds_mla`` record caches): first matching rule, first fitting
#: candidate. Plain rows take the portable kernel's tiles (16 or 32 heads a program); records (operand class
#: ``"records"``) are decoded in registers, a float32 tile of 512 columns and its temporaries per row, so they
#: take 16-row tiles over 8 warps (32-row tiles over 4 warps spilled 5 KB on SM90a: docs/v4.md, "TRITON_MLA").
V4_CONFIG_TABLE: tuple[ConfigRule, ...] = (
    ConfigRule(None, 1, 16, "16bit", None, False, (_v4("v4-heads16-n32", 16, 32), _v4("v4-heads16-n16", 16, 16))),
    ConfigRule(None, 17, None, "16bit", None, False, (_v4("v4-heads32-n32", 32, 32), _v4("v4-heads32-n16", 32, 16),
                                                      _v4("v4-heads16-n16-narrow", 16, 16))),
    ConfigRule(None, 1, 16, "records", None, False, (_v4("v4-records-heads16-n16-w8", 16, 16, 8),)),
    ConfigRule(None, 17, None, "records", None, False, (_v4("v4-records-heads32-n16-w8", 32, 16, 8),
                                                        _v4("v4-records-heads16-n16-w8", 16, 16, 8))),
    ConfigRule(None, 1, None, "fp32", None, False, (_v4("v4-fp32-heads16-n16", 16, 16, fp32=True),)),
)


def v4_operand_class(q_dtype: torch.dtype, cache_dtype: torch.dtype, records: bool) -> str:
    """The V4 kernel's operand class: ``"records"`` for bf16/fp16 queries over fp8 records, ``"16bit"`` over a
    cache of their dtype or an fp8 cache, else ``"fp32"``."""
    if records and q_dtype in (torch.bfloat16, torch.float16):
        return "records"
    return operand_class(q_dtype, cache_dtype)


def choose_v4_config(num_heads: int, operands: str, *, rank_pad: int, rope_pad: int,
                     smem_limit: int) -> KernelConfig:
    """The V4 kernel's configuration: the first candidate of the first matching :data:`V4_CONFIG_TABLE` rule
    whose shared-memory estimate fits ``smem_limit`` (the rule's last candidate when none does)."""
    for rule in V4_CONFIG_TABLE:
        if rule.matches(0, num_heads, operands, False, False):
            elem = operand_bytes("16bit" if operands == "records" else operands)
            fits = [c for c in rule.candidates if shared_bytes_estimate(c, elem, rank_pad, rope_pad) <= smem_limit]
            return (fits or list(rule.candidates[-1:]))[0]
    raise ValueError(f"num_heads: got {num_heads}; no TRITON_MLA V4 configuration covers it")  # pragma: no cover


def operand_class(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """``"16bit"`` when the dots can take the query's 16-bit dtype (cache of that dtype or fp8), else
    ``"fp32"``."""
    if q_dtype in (torch.bfloat16, torch.float16) and (
        cache_dtype == q_dtype or cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    ):
        return "16bit"
    return "fp32"


def operand_bytes(operands: str) -> int:
    """Bytes an element of the dot operands takes in shared memory for an operand class (``"fp32"``: 4,
    ``"16bit"``: 2; fp8 score products count 1 in :func:`shared_bytes_estimate`)."""
    return 4 if operands == "fp32" else 2


def shared_bytes_estimate(cfg: KernelConfig, elem: int, rank_pad: int, rope_pad: int) -> int:
    """Shared memory a configuration needs (bytes; calibrated against ptxas within ~25%).

    ``heads``: the query block and one row tile, +25% for layout conversions. ``rows``: the 64-row query
    block plus ``num_stages`` row-tile buffers (Triton's pipelining, at least 2), +5%; with fp8 score
    products both are fp8 (one byte an element).
    """
    width = rank_pad + rope_pad
    if cfg.kernel in ("heads", "v4"):
        return int(1.25 * elem * (cfg.block_h + cfg.block_n) * width)
    elem = 1 if cfg.qk_fp8 else elem
    buffers = max(2, cfg.num_stages)  # measured: 2 buffers at 2 stages, num_stages at 3-4
    return int(1.05 * (ROWS_PER_PROGRAM + buffers * cfg.block_n) * width * elem)


def fitting_configs(
    compute_capability: tuple[int, int] | None,
    num_heads: int,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    *,
    sparse: bool,
    rank_pad: int,
    rope_pad: int,
    smem_limit: int,
    kernel: str = "auto",
    fp8_qk: bool = False,
) -> tuple[KernelConfig, ...]:
    """Every configuration the table can choose for a call, in order of preference: the candidates of the
    first matching rule whose shared-memory estimate fits ``smem_limit`` (the rule's last candidate alone
    when none fits). :func:`choose_config` takes the first; the compile report compiles them all.

    Args:
        compute_capability: the device's ``(major, minor)``; None under the interpreter (portable unless
            ``kernel`` forces one).
        num_heads: query heads H.
        q_dtype / cache_dtype: the query's and the cache storage's torch dtypes.
        sparse: top-k call (only the ``heads`` kernel takes it).
        rank_pad / rope_pad: ``kv_lora_rank`` / ``qk_rope_head_dim`` padded to powers of two (>= 16).
        smem_limit: shared memory one program may use on the device (bytes).
        kernel: ``"auto"`` (the table), ``"heads"`` or ``"rows"`` (force that kernel; ``rows`` falls back to
            ``heads`` for sparse calls and non-16-bit operands, which it does not take).
        fp8_qk: the backend's option: fp8 x fp8 score products with the ``rows`` kernel for fp8 e4m3 caches.
    """
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"kernel: got {kernel!r}; supported 'auto', 'heads' or 'rows'")
    operands = operand_class(q_dtype, cache_dtype)
    qk_fp8 = bool(fp8_qk) and cache_dtype == torch.float8_e4m3fn and operands == "16bit" and not sparse
    elem = operand_bytes(operands)
    major = compute_capability[0] if compute_capability is not None else 0
    if kernel == "rows" and operands == "16bit" and not sparse:
        major = 9  # forced: take the Hopper rule's candidates whatever the device (testing, other GPUs)
    elif kernel == "heads" or compute_capability is None:
        qk_fp8 = False
        major = 0  # portable rules only
    if major != 9:
        qk_fp8 = False  # fp8 score products exist only in the Hopper rows kernel
    elif kernel == "auto" and cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and not qk_fp8:
        major = 0  # fp8 cache with 16-bit products: the rows kernel's in-register dequant spills (ptxas)
    candidates: tuple[KernelConfig, ...] = ()
    for rule in CONFIG_TABLE:
        if rule.matches(major, num_heads, operands, sparse, qk_fp8):
            candidates = rule.candidates
            break
    if not candidates:  # pragma: no cover - the table covers every (heads, operands) pair
        raise ValueError(f"num_heads: got {num_heads}; no TRITON_MLA configuration covers it")
    fitting = tuple(c for c in candidates if shared_bytes_estimate(c, elem, rank_pad, rope_pad) <= smem_limit)
    return fitting or candidates[-1:]


def choose_config(*args: Any, **kwargs: Any) -> KernelConfig:
    """The configuration for one call: the first of :func:`fitting_configs`, which takes the same arguments
    (``compute_capability, num_heads, q_dtype, cache_dtype, *, sparse, rank_pad, rope_pad, smem_limit,
    kernel="auto", fp8_qk=False``)."""
    return fitting_configs(*args, **kwargs)[0]


def rows_layout(num_heads: int) -> tuple[int, int, int]:
    """How the ``rows`` kernel lays 64 rows over heads and tokens: ``(heads_per_block, tokens_per_block,
    head_blocks)``; ``heads_per_block = min(next_pow2(H), 64)``, ``tokens_per_block = 64 // heads_per_block``.

    128 heads: two programs a token, each 64 heads. 16 heads: one program holds 4 query tokens.
    """
    hb = 1
    while hb < min(num_heads, ROWS_PER_PROGRAM):
        hb *= 2
    return hb, ROWS_PER_PROGRAM // hb, -(-num_heads // hb)


def stage1_grid(num_tokens: int, head_blocks: int, splits: int) -> tuple[int, int]:
    """Stage 1's grid ``(tokens * head_blocks, splits)``: tokens and head blocks share axis 0 (head block
    fastest, so the programs reading the same rows run together), which holds up to ``2**31 - 1``."""
    n = max(1, num_tokens) * head_blocks
    if n > GRID_AXIS0_MAX or splits > GRID_AXIS12_MAX:
        raise ValueError(
            f"num_tokens: got {num_tokens} tokens x {head_blocks} head blocks x {splits} splits; supported up "
            f"to {GRID_AXIS0_MAX} programs on axis 0 and {GRID_AXIS12_MAX} splits"
        )
    return (n, splits)


def merge_grid(num_tokens: int, head_blocks: int) -> tuple[int]:
    """Stage 2's grid ``(tokens * head_blocks,)``."""
    return (stage1_grid(num_tokens, head_blocks, 1)[0],)


def table_rows() -> list[dict[str, object]]:
    """:data:`CONFIG_TABLE` as plain rows (for ``mla-backends list`` and the docs)."""
    rows = []
    for rule in CONFIG_TABLE:
        if rule.max_heads is None:
            heads = f">={rule.min_heads}"
        else:
            heads = str(rule.min_heads) if rule.min_heads == rule.max_heads else f"{rule.min_heads}-{rule.max_heads}"
        rows.append({
            "archs": "any SM80+" if rule.archs is None else "/".join(f"SM{a}x" for a in rule.archs),
            "heads": heads,
            "operands": rule.operands,
            "attention": {None: "dense+sparse", False: "dense", True: "sparse"}[rule.sparse],
            "option": "fp8_qk" if rule.qk_fp8 else "",
            "candidates": [c.name for c in rule.candidates],
        })
    return rows
