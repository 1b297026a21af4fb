"""``TRITON_MLA``: the portable GPU backend, a split-KV paged absorbed-MLA decode written in Triton.

The kernels live in :mod:`.kernels` and are imported on the first ``forward_mqa`` call,
so importing this module (and selecting backends) never imports triton. See ``docs/triton.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..backends.contract import Capabilities, MLABackend, QueryLenSupport, Tolerance
from ..backends.v4_inputs import V4Keys
from ..core.device import cuda_device_index
from ..core.dtypes import RECORD_CACHE_DTYPES, kv_cache_torch_dtype
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata
from ..step.records import RecordCache
from .configs import (
    KERNELS,
    KernelConfig,
    choose_config,
    choose_v4_config,
    rows_layout,
    table_rows,
    v4_operand_class,
)
from .interpreter import interpreter_enabled, launch_guard
from .launch import build_launches
from .launch_v4 import build_v4_launches, v4_key_count
from .splits import MAX_KV_SPLITS, MIN_SPLIT_LEN, choose_num_kv_splits, next_pow2, rows_split_sizes, sm_count

__all__ = ["TritonMLABackend", "TritonStep", "interpreter_enabled", "PAGE_SIZES", "DEFAULT_SMEM_BYTES",
           "FP8_QK_TOLERANCES"]

#: page sizes the tests cover (the kernel maps every position through the block table, so any size works)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: shared memory assumed when the device does not say (99 KiB, the smallest SM80+ opt-in limit)
DEFAULT_SMEM_BYTES = 99 * 1024
#: accuracy of the ``fp8_qk`` option (queries quantised to fp8 e4m3 per token and head: each element carries up
#: to 2**-4 relative error into the scores); measured worst case on unit-variance data ~0.16 absolute
FP8_QK_TOLERANCES: dict[str, Tolerance] = {
    "bfloat16/fp8_e4m3": Tolerance(0.3, 0.1),
    "float16/fp8_e4m3": Tolerance(0.3, 0.1),
}
#: the limit configurations are chosen against under the interpreter (SM90's opt-in 227 KiB)
INTERPRET_SMEM_BYTES = 227 * 1024

_CPU_TAIL = "requires a CUDA device — set TRITON_INTERPRET=1 to run interpreted, for testing only"


@functools.cache
def _smem_bytes_cached(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SMEM_BYTES)


def _smem_bytes(device: torch.device) -> int:
    """Shared memory one program may use (opt-in limit; 99 KiB, the smallest SM80+ value, when unknown)."""
    return _smem_bytes_cached(cuda_device_index(device))


@functools.cache
def _compute_capability_cached(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (a host query, read once per device)."""
    return _compute_capability_cached(cuda_device_index(device))


@dataclass(frozen=True)
class TritonStep:
    """What a configured ``TRITON_MLA`` prepared for one step's dense calls: the launch configuration and the KV
    splits, worked out once from the configuration and the step's host lengths (every layer launches with them).

    Attributes:
        call: ``(heads, query dtype, cache dtype, kv_lora_rank, rope, device, interpreted)`` it was made for; a
            call with other inputs (a cache dtype the configuration left open, a sparse call) works its own out.
        cfg: the :class:`~mla_backends.triton_mla.configs.KernelConfig` chosen.
        splits, split_len: the KV splits (``heads``: every token's; ``rows``: the most a request gets) and the
            positions a ``rows`` split covers.
    """

    call: tuple[object, ...]
    cfg: KernelConfig
    splits: int
    split_len: int


class TritonMLABackend(MLABackend):
    """Split-KV paged MLA decode in Triton: dense and sparse (top-k), any query length, LSE returned.

    Args:
        num_kv_splits: pin the number of KV splits (1..64) instead of the heuristic
            (:func:`~mla_backends.triton_mla.splits.choose_num_kv_splits`). Pin it for CUDA-graph capture so the
            eager and captured paths launch the same grid. With the ``rows`` kernel it is the most a request
            gets: each request takes ``ceil(seq_len / min_split_len)`` of them, read from the device.
        kernel: ``"auto"`` (the configuration table, :data:`~mla_backends.triton_mla.configs.CONFIG_TABLE`:
            the ``rows`` kernel on SM90 for dense 16-bit calls with >= 16 heads, else the portable ``heads``
            kernel), ``"heads"`` or ``"rows"`` (force one, whatever the device: for testing the Hopper
            configuration under the interpreter; ``rows`` still falls back to ``heads`` for sparse calls and
            float32 or mixed operands).
        fp8_qk: with the ``rows`` kernel and an fp8 e4m3 cache, quantise the queries to fp8 per (token, head)
            and run the score product fp8 x fp8 (the output product stays bf16/fp16). Off by default; its
            accuracy is declared in :meth:`variant`'s capabilities (:data:`FP8_QK_TOLERANCES`).
        min_split_len: ``rows`` kernel: the fewest positions a split covers before a request gets another
            (default 512). Unpinned, the split length grows with the step's work
            (:meth:`rows_splits_for`); with ``num_kv_splits`` pinned it is this value.
    """

    name: ClassVar[str] = "TRITON_MLA"
    description: ClassVar[str] = (
        "Triton split-KV paged MLA decode (CUDA SM80+, fp8 caches SM89+); on a CPU only under "
        "TRITON_INTERPRET=1, for testing"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"}),
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
        sinks=True,  # DeepSeek-V4: window, compressed keys and sinks (kernels_v4.py)
        window=True,
        compressed=True,
        returns_lse=True,
        deterministic=True,
        requires=("triton",),
        extra="triton",
        cpu_env_switch="TRITON_INTERPRET",  # the CPU only interpreted, for testing
        cpu_hint=_CPU_TAIL,
        host_sync_free=True,
        cuda_graphs=True,  # lengths and block ids read on the device; pin num_kv_splits for a fixed grid
    )

    def __init__(
        self,
        num_kv_splits: int | None = None,
        *,
        kernel: str = "auto",
        fp8_qk: bool = False,
        min_split_len: int = MIN_SPLIT_LEN,
    ) -> None:
        if num_kv_splits is not None:
            if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
                raise TypeError(f"num_kv_splits: got {type(num_kv_splits).__name__}; supported int or None")
            if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
                raise ValueError(f"num_kv_splits: got {num_kv_splits}; supported 1..{MAX_KV_SPLITS} or None")
        if not isinstance(kernel, str) or kernel not in ("auto", *KERNELS):
            raise ValueError(f"kernel: got {kernel!r}; supported 'auto', 'heads' or 'rows'")
        if not isinstance(fp8_qk, bool):
            raise TypeError(f"fp8_qk: got {type(fp8_qk).__name__}; supported bool")
        if isinstance(min_split_len, bool) or not isinstance(min_split_len, int) or min_split_len < 1:
            raise ValueError(f"min_split_len: got {min_split_len!r}; supported an int >= 1")
        self.num_kv_splits = num_kv_splits
        self.kernel = kernel
        self.fp8_qk = fp8_qk
        self.min_split_len = min_split_len

    @classmethod
    def variant(cls, **options: object) -> type[TritonMLABackend]:
        """A subclass whose constructor defaults to ``options`` (``kernel``, ``fp8_qk``, ``min_split_len``,
        ``num_kv_splits``) and whose capabilities declare that configuration's accuracy: with
        ``fp8_qk=True`` the fp8 e4m3 cache tolerances are :data:`FP8_QK_TOLERANCES`. For the conformance
        suite (which builds backends with no arguments) and for engines that construct by class."""
        cls(**options)  # type: ignore[arg-type]  # validates the options now
        tolerances = dict(cls.capabilities.tolerances)
        if options.get("fp8_qk"):
            tolerances.update(FP8_QK_TOLERANCES)
        caps = dataclasses.replace(cls.capabilities, tolerances=tolerances)
        base = cls

        def __init__(self: TritonMLABackend, **kw: object) -> None:
            base.__init__(self, **{**options, **kw})  # type: ignore[arg-type]

        label = "_".join(f"{k}_{v}" for k, v in sorted(options.items()))
        return type(f"{cls.__name__}_{label}", (cls,), {"__init__": __init__, "capabilities": caps,
                                                        "__module__": cls.__module__})

    @classmethod
    def interpreted(cls) -> type[TritonMLABackend]:
        """This class as the conformance suite judges it under Triton's interpreter (a CPU): bf16 withheld.
        The interpreter converts float32 to bf16 by truncation (round toward zero, a -0.27 % bias on the
        suite's data that its bias criterion rightly catches) and multiplies bf16 ``tl.dot`` operands wrongly;
        compiled kernels round to nearest, so bf16 is judged on a GPU (``docs/conformance.md``)."""
        cached = cls.__dict__.get("_interpreted_variant")
        if cached is not None:
            return cached
        caps = dataclasses.replace(cls.capabilities, dtypes=cls.capabilities.dtypes - {torch.bfloat16})
        variant = type(cls.__name__ + "Interpreted", (cls,), {"capabilities": caps, "__module__": cls.__module__,
                                                             "__doc__": cls.interpreted.__doc__})
        cls._interpreted_variant = variant  # type: ignore[attr-defined]
        variant._interpreted_variant = variant  # type: ignore[attr-defined]
        return variant

    @classmethod
    def configurations(cls) -> list[dict[str, object]]:
        """The configuration table as rows (architecture, heads, operands, candidates), for
        ``mla-backends list``."""
        return table_rows()

    # ---- KV splits ----------------------------------------------------------------------------------------
    def kv_splits_for(
        self, meta: BatchMetadata, num_heads: int, device: torch.device, topk_width: int | None = None
    ) -> int:
        """Splits this call would use (host values only: ``meta.max_seq_len`` or the top-k width)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        max_len = topk_width if topk_width is not None else meta.max_seq_len
        return choose_num_kv_splits(max_len, meta.num_tokens, num_heads, sm_count(device))

    def rows_splits_for(
        self, meta: BatchMetadata, num_heads: int, device: torch.device, cfg: KernelConfig
    ) -> tuple[int, int]:
        """``(max_splits, split_len)`` of a ``rows``-kernel call (host values only). Pinned
        ``num_kv_splits`` (CUDA graphs): that count and ``min_split_len``, fixed whatever the lengths.
        Otherwise :func:`~mla_backends.triton_mla.splits.rows_split_sizes` sizes the splits from the step's
        total work."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits, self.min_split_len
        _, toks, head_blocks = rows_layout(num_heads)
        return rows_split_sizes(meta.seq_lens_list, meta.query_lens_list, toks, head_blocks, sm_count(device),
                               self.min_split_len, cfg.block_n)

    # ---- the kernel --------------------------------------------------------------------------------------
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
        """Stage 1 (split-KV partials) and stage 2 (merge) into ``out [T, H, R]`` (q's dtype) and
        ``lse_out [T, H]`` (float32, natural log); inputs validated by :meth:`MLABackend.forward_mqa`. Calls with
        DeepSeek-V4 inputs (``v4``) and calls on ``fp8_ds_mla`` record caches take the V4 kernel
        (:mod:`.kernels_v4`)."""
        assert lse_out is not None  # returns_lse: forward_mqa always provides it
        self._check_layout(q_latent, q_rope, cache, out)
        H, R = q_latent.shape[1], q_latent.shape[2]
        from . import kernels  # first call only: imports triton

        if cache.device.type != "cuda" and not kernels.INTERPRET:
            raise ValueError(
                f"device: got CPU tensors, but the Triton kernels were imported without "
                f"TRITON_INTERPRET=1; supported a CUDA device ({_CPU_TAIL}, set before first use)"
            )
        if v4 is not None or isinstance(cache, RecordCache):
            launches = self._v4_launches(q_latent, q_rope, cache, meta, scale, v4, topk_indices, out, lse_out,
                                         kernels.INTERPRET)
            self._run(launches, cache.device.type != "cuda")
            return
        sparse = topk_indices is not None
        call = (H, q_latent.dtype, cache.data.dtype, R, cache.qk_rope_head_dim, cache.device, kernels.INTERPRET)
        if isinstance(state, TritonStep) and not sparse and state.call == call:  # prepared when planned
            cfg, splits, split_len = state.cfg, state.splits, state.split_len
        else:  # sparse (the split count follows the top-k width) or unprepared: host arithmetic, this call only
            cfg, splits, split_len = self._launch_plan(meta, call, sparse=sparse,
                                                       topk_width=int(topk_indices.shape[1]) if sparse else None)
        launches = build_launches(
            q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices, out=out, lse_out=lse_out,
            cfg=cfg, splits=splits, interpret=kernels.INTERPRET, split_len=split_len,
        )
        self._run(launches, cache.device.type != "cuda")

    @staticmethod
    def _run(launches: list, interpreted: bool) -> None:
        """Launch each kernel of ``launches`` (interpreted launches: one at a time per process)."""
        for launch in launches:
            module = importlib.import_module(f".{launch.module}", __package__)
            with launch_guard(interpreted):
                getattr(module, launch.kernel)[launch.grid](*launch.args, **launch.options)

    def prepare(self, meta: BatchMetadata) -> TritonStep | None:
        """A configured backend's :class:`TritonStep` for ``meta``'s dense calls (launch configuration and KV
        splits from host values, once per step); None when unconfigured, sparse (the split count follows each
        call's top-k width) or holding no token."""
        spec = self.layer_spec
        if (spec is None or spec.sparse or not meta.num_tokens or spec.window or spec.compressed
                or spec.kv_cache_dtype in RECORD_CACHE_DTYPES):  # V4 and fp8 records: their own launches per call
            return None
        cache_dtype = kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
        call = (spec.num_heads, spec.dtype, cache_dtype, spec.kv_lora_rank, spec.qk_rope_head_dim, meta.device,
                interpreter_enabled())
        return TritonStep(call, *self._launch_plan(meta, call, sparse=False, topk_width=None))

    def _launch_plan(self, meta: BatchMetadata, call: tuple[object, ...], *, sparse: bool,
                     topk_width: int | None) -> tuple[KernelConfig, int, int]:
        """``(configuration, splits, split length)`` of a call described by ``call`` (``TritonStep.call``)."""
        H, q_dtype, cache_dtype, R, P, device, interpret = call
        cfg = self.launch_config(q_dtype, cache_dtype, R, P, H, device, sparse=sparse,  # type: ignore[arg-type]
                                 interpret=bool(interpret))
        if cfg.kernel == "rows":
            return (cfg, *self.rows_splits_for(meta, H, device, cfg))  # type: ignore[arg-type]
        return cfg, self.kv_splits_for(meta, H, device, topk_width), self.min_split_len  # type: ignore[arg-type]

    def _v4_launches(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                     meta: BatchMetadata, scale: float, v4: V4Keys | None, topk_indices: torch.Tensor | None,
                     out: torch.Tensor, lse_out: torch.Tensor, interpret: bool) -> list:
        """The V4 kernel's launches (:func:`~mla_backends.triton_mla.launch_v4.build_v4_launches`) with the
        configuration table's choice (:func:`~mla_backends.triton_mla.configs.choose_v4_config`) and the split
        heuristic over the most keys a token attends (host values only)."""
        H, R = q_latent.shape[1], q_latent.shape[2]
        records = isinstance(cache, RecordCache)
        smem = _smem_bytes(cache.device) if cache.device.type == "cuda" and not interpret else INTERPRET_SMEM_BYTES
        cfg = choose_v4_config(H, v4_operand_class(q_latent.dtype, cache.data.dtype, records),
                               rank_pad=max(16, next_pow2(R)), rope_pad=max(16, next_pow2(cache.qk_rope_head_dim)),
                               smem_limit=smem)
        width = 0 if topk_indices is None else int(topk_indices.shape[1])
        splits = self.kv_splits_for(meta, H, cache.device, v4_key_count(meta, v4, width))
        return build_v4_launches(q_latent, q_rope, cache, meta, scale=scale, keys=v4, topk_indices=topk_indices,
                                 out=out, lse_out=lse_out, cfg=cfg, splits=splits, interpret=interpret)

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

    def launch_config(
        self,
        q_dtype: torch.dtype,
        cache_dtype: torch.dtype,
        rank: int,
        rope: int,
        num_heads: int,
        device: torch.device,
        *,
        sparse: bool = False,
        interpret: bool = False,
    ) -> KernelConfig:
        """The :class:`~mla_backends.triton_mla.configs.KernelConfig` a call with these dtypes and dims
        launches on ``device`` (:func:`~mla_backends.triton_mla.configs.choose_config` over the table, with
        this instance's ``kernel`` and ``fp8_qk`` options; under the interpreter the device has no
        architecture, so ``kernel="auto"`` gives the portable kernel)."""
        cc = None if interpret or device.type != "cuda" else _compute_capability(device)
        # the interpreter has no shared memory: a forced configuration runs as the table lists it
        smem = _smem_bytes(device) if cc is not None else INTERPRET_SMEM_BYTES
        return choose_config(
            cc, num_heads, q_dtype, cache_dtype, sparse=sparse, rank_pad=max(16, next_pow2(rank)),
            rope_pad=max(16, next_pow2(rope)), smem_limit=smem, kernel=self.kernel, fp8_qk=self.fp8_qk,
        )
