"""``TRITON_MLA``: the portable GPU backend, a split-KV paged absorbed-MLA decode written in Triton.

The kernels live in :mod:`.kernels` and are imported on the first ``forward_mqa`` call,
so importing this module (and selecting backends) never imports triton. See ``docs/triton.md``.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, NamedTuple

import torch

from ..backend import Capabilities, MLABackend, QueryLenSupport
from ..cache import LatentKVCache
from ..device import cuda_device_index
from ..metadata import BatchMetadata
from .interpreter import interpreter_enabled, launch_guard
from .plan import BLOCK_H, MAX_KV_SPLITS, SCRATCH, block_h_for, choose_num_kv_splits, next_pow2, sm_count

__all__ = ["TritonMLABackend", "interpreter_enabled", "PAGE_SIZES"]

#: page sizes the tests cover (the kernel maps every position through the block table, so any size works)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: positions per stage-1 tile on a GPU / under the interpreter (bigger tiles mean fewer interpreted steps)
BLOCK_N_GPU = 32
BLOCK_N_INTERPRET = 64


class LaunchConfig(NamedTuple):
    """Stage 1 compile-time choices: dot operand dtype (a ``tl`` dtype), dot precision, tile rows, pipeline
    stages, warps, heads per program."""

    dot_dtype: Any
    precision: str
    block_n: int
    num_stages: int
    num_warps: int
    block_h: int


_CPU_TAIL = "requires a CUDA device — set TRITON_INTERPRET=1 to run interpreted, for testing only"


@functools.cache
def _smem_bytes_cached(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def _smem_bytes(device: torch.device) -> int:
    """Shared memory one program may use (opt-in limit; 99 KiB, the smallest SM80+ value, when unknown)."""
    return _smem_bytes_cached(cuda_device_index(device))


class TritonMLABackend(MLABackend):
    """Split-KV paged MLA decode in Triton: dense and sparse (top-k), any query length, LSE returned.

    Args:
        num_kv_splits: pin the number of KV splits (1..64) instead of the heuristic
            (:func:`~mla_backends.triton_mla.plan.choose_num_kv_splits`). Pin it for CUDA-graph capture so the
            eager and captured paths launch the same grid.
    """

    name: ClassVar[str] = "TRITON_MLA"
    description: ClassVar[str] = (
        "Triton split-KV paged MLA decode (CUDA SM80+, fp8 caches SM89+); on a CPU only under "
        "TRITON_INTERPRET=1, for testing"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
        cpu=False,
        min_compute_capability=(8, 0),
        fp8_min_compute_capability=(8, 9),
        page_sizes=PAGE_SIZES,
        preferred_page_size=64,
        dims=None,
        query_len=QueryLenSupport.VARLEN,
        decode_threshold=1,
        dense=True,
        sparse=True,
        returns_lse=True,
        deterministic=True,
        requires=("triton",),
        extra="triton",
        cpu_env_switch="TRITON_INTERPRET",  # the CPU only interpreted, for testing
        cpu_hint=_CPU_TAIL,
        host_sync_free=True,
        cuda_graphs=True,  # lengths and block ids read on the device; pin num_kv_splits for a fixed grid
    )

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if num_kv_splits is not None:
            if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
                raise TypeError(f"num_kv_splits: got {type(num_kv_splits).__name__}; supported int or None")
            if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
                raise ValueError(f"num_kv_splits: got {num_kv_splits}; supported 1..{MAX_KV_SPLITS} or None")
        self.num_kv_splits = num_kv_splits

    # ---- planning -----------------------------------------------------------------------------------------
    def plan_num_kv_splits(
        self, meta: BatchMetadata, num_heads: int, device: torch.device, topk_width: int | None = None
    ) -> int:
        """Splits this call would use (host values only: ``meta.max_seq_len`` or the top-k width)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        max_len = topk_width if topk_width is not None else meta.max_seq_len
        return choose_num_kv_splits(max_len, meta.num_tokens, num_heads, sm_count(device))

    # ---- the kernel --------------------------------------------------------------------------------------
    def _forward_mqa_impl(
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
    ) -> None:
        """Stage 1 (split-KV partials) and stage 2 (merge) into ``out [T, H, R]`` (q's dtype) and
        ``lse_out [T, H]`` (float32, natural log); inputs validated by :meth:`MLABackend.forward_mqa`."""
        assert lse_out is not None  # returns_lse: forward_mqa always provides it
        self._check_layout(q_latent, q_rope, cache, out)
        T, H, R = q_latent.shape
        from . import kernels  # first call only: imports triton

        if cache.device.type != "cuda" and not kernels.INTERPRET:
            raise ValueError(
                f"device: got CPU tensors, but the Triton kernels were imported without "
                f"TRITON_INTERPRET=1; supported a CUDA device ({_CPU_TAIL}, set before first use)"
            )
        sparse = topk_indices is not None
        K = int(topk_indices.shape[1]) if sparse else 0
        splits = self.plan_num_kv_splits(meta, H, cache.device, K if sparse else None)
        part_o, part_lse = SCRATCH.get(cache.device, T, H, splits, R)  # per call: safe across threads/streams
        P = cache.qk_rope_head_dim
        rank_pad, rope_pad = max(16, next_pow2(R)), max(16, next_pow2(P))
        cfg = self._launch_config(
            q_latent.dtype, cache.data.dtype, rank_pad, rope_pad, H, cache.device, kernels
        )
        topk = topk_indices if sparse else meta.token_positions  # any int tensor; unused when dense
        interpreted = cache.device.type != "cuda"
        with launch_guard(interpreted):
            self._stage1(kernels, cfg, q_latent, q_rope, cache, meta, topk, part_o, part_lse, scale, H, K, splits,
                         sparse, rank_pad, rope_pad)
        with launch_guard(interpreted):
            self._stage2(kernels, part_o, part_lse, out, lse_out, H, splits, R, rank_pad)

    @staticmethod
    def _stage1(kernels: Any, cfg: LaunchConfig, q_latent: torch.Tensor, q_rope: torch.Tensor,
                cache: LatentKVCache, meta: BatchMetadata, topk: torch.Tensor, part_o: torch.Tensor,
                part_lse: torch.Tensor, scale: float, H: int, K: int, splits: int, sparse: bool, rank_pad: int,
                rope_pad: int) -> None:
        """Launch stage 1 over the grid ``(head blocks, tokens, splits)``."""
        T, _, R = q_latent.shape
        P = cache.qk_rope_head_dim
        kv = cache.data
        kernels.mla_decode_stage1[(-(-H // cfg.block_h), T, splits)](
            q_latent,
            q_rope,
            kv,
            cache.scale,
            meta.block_table,
            meta.token_request,
            meta.token_positions,
            topk,
            part_o,
            part_lse,
            float(scale) * 1.4426950408889634,
            H,
            K,
            splits,
            q_latent.stride(0),
            q_latent.stride(1),
            q_rope.stride(0),
            q_rope.stride(1),
            kv.stride(0),
            kv.stride(1),
            meta.block_table.stride(0),
            topk.stride(0),
            topk.stride(-1),
            part_o.stride(0),
            part_o.stride(1),
            part_o.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            PAGE_SIZE=cache.block_size,
            RANK=R,
            RANK_PAD=rank_pad,
            ROPE=P,
            ROPE_PAD=rope_pad,
            BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n,
            SPARSE=sparse,
            IS_FP8=cache.is_fp8,
            DOT_DTYPE=cfg.dot_dtype,
            DOT_PRECISION=cfg.precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    @staticmethod
    def _stage2(kernels: Any, part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                lse_out: torch.Tensor, H: int, splits: int, R: int, rank_pad: int) -> None:
        """Launch stage 2 (the merge of the splits) over the grid ``(head blocks, tokens)``."""
        T = out.shape[0]
        kernels.mla_decode_stage2[(-(-H // BLOCK_H), T)](
            part_o,
            part_lse,
            out,
            lse_out,
            H,
            splits,
            part_o.stride(0),
            part_o.stride(1),
            part_o.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse_out.stride(0),
            lse_out.stride(1),
            RANK=R,
            RANK_PAD=rank_pad,
            BLOCK_H=BLOCK_H,
            num_warps=4,
        )

    # ---- helpers -----------------------------------------------------------------------------------------
    @staticmethod
    def _check_layout(
        q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, out: torch.Tensor | None
    ) -> None:
        """Reject strides the kernel does not take (rows must be contiguous), naming the argument."""
        if cache.data.stride(-1) != 1:
            raise ValueError(
                f"cache.data: got last-dim stride {cache.data.stride(-1)}; supported 1 (contiguous rows)"
            )
        for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("out", out)):
            if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name}: got last-dim stride {t.stride(-1)}; supported 1 (rows contiguous)")

    @staticmethod
    def _launch_config(
        q_dtype: torch.dtype,
        cache_dtype: torch.dtype,
        rank_pad: int,
        rope_pad: int,
        num_heads: int,
        device: torch.device,
        kernels,
    ) -> LaunchConfig:
        """Stage 1's launch configuration for these dtypes on ``device``.

        On a GPU the dot operands are the query's 16-bit dtype (fp8 rows convert to it exactly), or float32
        ("ieee", not TF32) for float32 queries or caches and for a bf16/fp16 mix (no lossy conversion).
        ``BLOCK_N`` is 32 (16 for float32) when the tiles fit the device's shared memory, else 16. Heads per
        program: :func:`~mla_backends.triton_mla.plan.block_h_for`. 8 warps: with 4, the ``[16, 512]`` fp32
        accumulator plus the tiles need 255 registers and spill (ptxas, SM80/SM90); with 8, 160-255 and none.
        Under the interpreter the operands are always float32 (its bf16 dot is wrong) and the tile is 64 rows
        (fewer interpreted steps).
        """
        import triton.language as tl

        if kernels.INTERPRET:
            return LaunchConfig(tl.float32, "ieee", BLOCK_N_INTERPRET, 1, 4, block_h_for(num_heads))
        mixed_16bit = cache_dtype in (torch.bfloat16, torch.float16) and cache_dtype != q_dtype
        if q_dtype == torch.float32 or cache_dtype == torch.float32 or mixed_16bit:
            # float32 tiles are twice as wide: 16 rows keep the registers unspilled (SM80 spills at 32)
            dot_dtype, precision, elem, sizes = tl.float32, "ieee", 4, (16,)
        else:
            dot_dtype, precision, elem = (tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16), "tf32", 2
            sizes = (BLOCK_N_GPU, 16)
        limit = _smem_bytes(device)
        block_h = block_h_for(num_heads)
        for block_n in sizes:
            # query block + one row tile, +25% for layout conversions (matches ptxas within that margin)
            need = 1.25 * elem * (block_h + block_n) * (rank_pad + rope_pad)
            if need <= limit:
                break
        return LaunchConfig(dot_dtype, precision, block_n, 2, 8, block_h)
