"""The launches of one ``TRITON_MLA`` call, as data: kernel name, grid, arguments and compile-time options.

:func:`build_launches` is the one place that turns a call into kernel arguments. The backend runs the list;
``benchmarks/triton_compile_report.py`` and ``tests/test_triton_compile.py`` feed the same arguments to
Triton's own argument binder and compile them for a GPU target without a GPU, so they compile exactly the
signature a real launch specialises (int32 strides, 16-divisibility and ``== 1`` specialisation).

No triton import at module level (``triton.language`` is imported inside :func:`build_launches`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.dtypes import FP8_E4M3_MAX
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from .configs import INTERPRET_BLOCK_N, KernelConfig, merge_grid, rows_layout, stage1_grid
from .splits import BLOCK_H, MIN_SPLIT_LEN, SCRATCH, next_pow2

__all__ = ["Launch", "build_launches", "quantize_queries_fp8", "dot_dtypes", "stage2_launch", "LOG2E"]

#: the natural log of 2 folded out: the kernels work in base 2
LOG2E = 1.4426950408889634


class Launch(NamedTuple):
    """One kernel launch: ``module.kernel[grid](*args, **options)``.

    ``module`` is ``"kernels"`` or ``"kernels_rows"`` (a module of this package); ``options`` holds the
    constexprs plus ``num_warps`` / ``num_stages``.
    """

    module: str
    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]


def quantize_queries_fp8(
    q_latent: torch.Tensor, q_rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries quantised to fp8 e4m3 per (token, head), in torch (the interpreter's fp8 downcasts are wrong).

    Returns ``(q_latent [T, H, R], q_rope [T, H, P])`` as ``float8_e4m3fn`` and the float32 scale ``[T, H]``
    with ``q ~= q8 * scale``; each (token, head) row's largest magnitude maps to 448.
    """
    amax = q_latent.abs().amax(-1).float()
    if q_rope.shape[-1]:
        amax = torch.maximum(amax, q_rope.abs().amax(-1).float())
    qscale = (amax / FP8_E4M3_MAX).clamp_min(1e-30).contiguous()
    ql8 = (q_latent.float() / qscale[..., None]).to(torch.float8_e4m3fn)
    qr8 = (q_rope.float() / qscale[..., None]).to(torch.float8_e4m3fn)
    return ql8, qr8, qscale


def dot_dtypes(cfg: KernelConfig, q_dtype: torch.dtype, interpret: bool) -> tuple[Any, Any, str]:
    """``(dot dtype, score dot dtype, precision)`` as ``tl`` dtypes for this configuration."""
    import triton.language as tl

    if interpret or cfg.fp32_dots:  # the interpreter's bf16 dot is wrong: float32 operands there
        return tl.float32, tl.float32, "ieee"
    dot = tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16
    return dot, (tl.float8e4nv if cfg.qk_fp8 else dot), "tf32"


def build_launches(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    scale: float,
    topk_indices: torch.Tensor | None,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    cfg: KernelConfig,
    splits: int,
    interpret: bool,
    split_len: int = MIN_SPLIT_LEN,
) -> list[Launch]:
    """The launches of one ``forward_mqa`` call (inputs already validated; shapes as in the contract).

    Args:
        q_latent / q_rope: ``[T, H, R]`` / ``[T, H, P]`` queries.
        cache / meta: the paged cache and the step's metadata.
        scale: softmax scale (natural base).
        topk_indices: ``[T, K]`` int positions (sparse) or None (dense).
        out / lse_out: ``[T, H, R]`` output (query dtype) and ``[T, H]`` float32 natural-log LSE.
        cfg: the chosen :class:`~mla_backends.triton_mla.configs.KernelConfig`.
        splits: KV splits (``heads``: every token; ``rows``: the most a request gets).
        interpret: the kernels were imported under ``TRITON_INTERPRET`` (tile sizes, dot dtypes).
        split_len: ``rows``: positions a split covers before a request gets another
            (``TritonMLABackend.rows_splits_for``).
    """
    T, H, R = q_latent.shape
    P = cache.qk_rope_head_dim
    rank_pad, rope_pad = max(16, next_pow2(R)), max(16, next_pow2(P))
    dot, qk_dot, precision = dot_dtypes(cfg, q_latent.dtype, interpret)
    block_n = INTERPRET_BLOCK_N if interpret else cfg.block_n
    launch_opts = {"num_warps": cfg.num_warps, "num_stages": 1 if interpret else cfg.num_stages}
    kv = cache.data
    part_o, part_lse = SCRATCH.get(cache.device, T, H, splits, R)
    if cfg.kernel == "rows":
        return _rows_launches(
            q_latent, q_rope, cache, meta, scale, out, lse_out, cfg, splits, split_len,
            (rank_pad, rope_pad, block_n, dot, qk_dot, precision), launch_opts, part_o, part_lse,
        )
    sparse = topk_indices is not None
    K = int(topk_indices.shape[1]) if topk_indices is not None else 0
    topk = topk_indices if topk_indices is not None else meta.token_positions  # unused when dense
    head_blocks = -(-H // cfg.block_h)
    stage1 = Launch("kernels", "mla_decode_stage1", stage1_grid(T, head_blocks, splits), (
        q_latent, q_rope, kv, cache.scale, meta.block_table, meta.token_request, meta.token_positions, topk,
        part_o, part_lse, float(scale) * LOG2E, H, K, splits, head_blocks,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), kv.stride(1),
        meta.block_table.stride(0), topk.stride(0), topk.stride(-1), part_o.stride(0), part_o.stride(1),
        part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
    ), dict(
        PAGE_SIZE=cache.block_size, RANK=R, RANK_PAD=rank_pad, ROPE=P, ROPE_PAD=rope_pad, BLOCK_H=cfg.block_h,
        BLOCK_N=block_n, SPARSE=sparse, IS_FP8=cache.is_fp8, DOT_DTYPE=dot, DOT_PRECISION=precision,
        **launch_opts,
    ))
    return [stage1, stage2_launch(part_o, part_lse, out, lse_out, splits, rank_pad)]


def stage2_launch(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse_out: torch.Tensor,
                  splits: int, rank_pad: int) -> Launch:
    """The merge of ``splits`` partials ``part_o [T, H, splits, R]`` / ``part_lse [T, H, splits]`` (base 2) into
    ``out`` and ``lse_out`` (:func:`~mla_backends.triton_mla.kernels.mla_decode_stage2`)."""
    T, H, R = out.shape
    merge_blocks = -(-H // BLOCK_H)
    return Launch("kernels", "mla_decode_stage2", merge_grid(T, merge_blocks), (
        part_o, part_lse, out, lse_out, H, splits, merge_blocks,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse_out.stride(0), lse_out.stride(1),
    ), dict(RANK=R, RANK_PAD=rank_pad, BLOCK_H=BLOCK_H, num_warps=4))


def _rows_launches(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    scale: float,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    cfg: KernelConfig,
    splits: int,
    split_len: int,
    tiles: tuple[int, int, int, Any, Any, str],
    launch_opts: dict[str, int],
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
) -> list[Launch]:
    """The ``rows`` kernel and its merge; partials in the output's dtype (a view of the float32 scratch)."""
    T, H, R = q_latent.shape
    P = cache.qk_rope_head_dim
    rank_pad, rope_pad, block_n, dot, qk_dot, precision = tiles
    kv = cache.data
    heads_pb, toks_pb, head_blocks = rows_layout(H)
    qscale = cache.scale
    if cfg.qk_fp8:
        q_latent, q_rope, qscale = quantize_queries_fp8(q_latent, q_rope)
    n_o = T * H * splits * R
    narrow = part_o.reshape(-1).view(out.dtype)[:n_o].view(T, H, splits, R)
    rows = Launch("kernels_rows", "mla_decode_rows", stage1_grid(T, head_blocks, splits), (
        q_latent, q_rope, qscale, kv, cache.scale, meta.block_table, meta.token_request, meta.token_positions,
        meta.query_start_loc, meta.seq_lens, narrow, part_lse, out, lse_out,
        float(scale) * LOG2E, H, head_blocks, splits, split_len,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), kv.stride(1),
        meta.block_table.stride(0), narrow.stride(0), narrow.stride(1), narrow.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse_out.stride(0),
        lse_out.stride(1),
    ), dict(
        PAGE_SIZE=cache.block_size, RANK=R, RANK_PAD=rank_pad, ROPE=P, ROPE_PAD=rope_pad, HEADS_PB=heads_pb,
        TOKS_PB=toks_pb, BLOCK_N=block_n, IS_FP8=cache.is_fp8, QK_FP8=cfg.qk_fp8, QK_DTYPE=qk_dot,
        DOT_DTYPE=dot, DOT_PRECISION=precision, **launch_opts,
    ))
    merge_blocks = -(-H // BLOCK_H)
    merge = Launch("kernels_rows", "mla_decode_merge", merge_grid(T, merge_blocks), (
        narrow, part_lse, out, lse_out, meta.token_request, meta.seq_lens, H, merge_blocks, splits,
        split_len, narrow.stride(0), narrow.stride(1), narrow.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1), lse_out.stride(0), lse_out.stride(1),
    ), dict(RANK=R, RANK_PAD=rank_pad, BLOCK_H=BLOCK_H, num_warps=4))
    return [rows, merge]
