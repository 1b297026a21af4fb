"""The FlashInfer calls this package makes, in one place: lazy loaders and keyword builders.

Every keyword passed to FlashInfer is produced by one of the ``*_kwargs`` builders below, and
:data:`KWARG_TARGETS` names the FlashInfer callable each builder feeds. The CPU test suite calls every
builder and checks each produced keyword against ``inspect.signature`` of the installed callable, so API
drift fails CI rather than a serving process.

Verified against flashinfer-python 0.7.4 (see docs/flashinfer.md for the source locations):

* ``flashinfer.mla.BatchMLAPagedAttentionWrapper(float_workspace_buffer, backend=...)``; ``plan()`` takes
  keywords and ``metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr)`` (fa2/fa3)
  or ``MLAPlanMetadata.dense(cum_seq_lens_q, block_tables, seq_lens, max_q_len)`` (cutlass), plus
  ``query_layout`` / ``kv_cache_layout`` / ``lse_mode``; ``run(query=, kv_cache=, out=, lse=,
  return_lse=, return_lse_base_on_e=, ckv_scale=, kpe_scale=)``. A ``(latent, rope)`` tuple of adjacent
  views of one 576-wide cache is accepted as a zero-copy packed cache.
* ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(query [B, q, H, 576], kv_cache [pages, page,
  576], workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
  max_seq_len, out=, bmm1_scale=, bmm2_scale=, backend=, lse=, return_lse=, return_lse_base=)``.
* ``flashinfer.decode.xqa_batch_decode_with_kv_cache_mla(query [B, 1, 128, 576], kv_cache, workspace_buffer,
  qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=,
  bmm1_scale=, bmm2_scale=)``.

Import only the submodules used here: importing every flashinfer submodule in one process fails.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "WORKSPACE_BYTES",
    "QK_NOPE_HEAD_DIM_PLACEHOLDER",
    "KWARG_TARGETS",
    "load_wrapper_class",
    "load_plan_metadata_class",
    "load_trtllm_decode",
    "load_xqa_decode",
    "csr_metadata_kwargs",
    "dense_metadata_kwargs",
    "wrapper_init_kwargs",
    "fa_plan_kwargs",
    "fa_run_kwargs",
    "cutlass_plan_kwargs",
    "cutlass_run_kwargs",
    "trtllm_kwargs",
    "xqa_kwargs",
]

#: workspace per (device, path): FlashInfer recommends 128 MiB; XQA requires at least that much
WORKSPACE_BYTES = 128 * 1024 * 1024
#: ``qk_nope_head_dim`` of the trtllm/xqa functions is deprecated ("remove in 1.0") and unused by the dense
#: kernels in 0.7.4 (only part of an autotuner cache key); DeepSeek's value is passed.
QK_NOPE_HEAD_DIM_PLACEHOLDER = 128


# ---- lazy loaders (the only places flashinfer is imported) ----------------------------------------------
def _lazy_loader(module: str, name: str, note: str = "") -> Callable[[], Any]:
    """A cached no-argument function returning ``module.name``; the import runs on its first call only."""

    @functools.cache
    def load() -> Any:
        return getattr(importlib.import_module(module), name)

    load.__doc__ = f"``{module}.{name}`` (imported on the first call{note})."
    return load


load_wrapper_class = _lazy_loader("flashinfer.mla", "BatchMLAPagedAttentionWrapper", ", ~5 s")
load_plan_metadata_class = _lazy_loader("flashinfer.mla", "MLAPlanMetadata")
load_trtllm_decode = _lazy_loader("flashinfer.decode", "trtllm_batch_decode_with_kv_cache_mla")
load_xqa_decode = _lazy_loader("flashinfer.decode", "xqa_batch_decode_with_kv_cache_mla")


# ---- keyword builders ---------------------------------------------------------------------------------
def csr_metadata_kwargs(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        kv_len_arr: torch.Tensor) -> dict[str, Any]:
    """``MLAPlanMetadata.csr`` keywords (int32, contiguous; CPU or the wrapper's device)."""
    return {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
            "kv_len_arr": kv_len_arr}


def dense_metadata_kwargs(cum_seq_lens_q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          max_q_len: int) -> dict[str, Any]:
    """``MLAPlanMetadata.dense`` keywords (int32, contiguous)."""
    return {"cum_seq_lens_q": cum_seq_lens_q, "block_tables": block_tables, "seq_lens": seq_lens,
            "max_q_len": int(max_q_len)}


def wrapper_init_kwargs(workspace: torch.Tensor, fi_backend: str) -> dict[str, Any]:
    """``BatchMLAPagedAttentionWrapper.__init__`` keywords (``fi_backend``: fa2, fa3 or cutlass)."""
    return {"float_workspace_buffer": workspace, "backend": fi_backend}


def _plan_kwargs(metadata: Any, *, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                 sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, layout: str,
                 lse_mode: str) -> dict[str, Any]:
    """``BatchMLAPagedAttentionWrapper.plan()`` keywords shared by fa2/fa3 and cutlass (causal attention;
    ``layout`` is the query and cache layout, ``split`` or ``packed``)."""
    return {
        "metadata": metadata,
        "num_heads": num_heads,
        "head_dim_ckv": kv_lora_rank,
        "head_dim_kpe": rope_dim,
        "page_size": page_size,
        "causal": True,  # bottom-right aligned: new token j sees positions 0 .. context_len + j
        "sm_scale": float(sm_scale),
        "q_data_type": q_dtype,
        "kv_data_type": kv_dtype,
        "query_layout": layout,
        "kv_cache_layout": layout,
        "lse_mode": lse_mode,
    }


def fa_plan_kwargs(metadata: Any, *, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                   sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, Any]:
    """``plan()`` keywords for fa2/fa3: CSR metadata, split query and cache views, natural-log LSE."""
    return _plan_kwargs(metadata, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                        page_size=page_size, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype,
                        layout="split", lse_mode="basee")


def fa_run_kwargs(q_latent: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, *,
                  out: torch.Tensor, lse: torch.Tensor, fp8_scale: float | None) -> dict[str, Any]:
    """``run()`` keywords for fa2/fa3. ``fp8_scale`` (dequantisation multiplier) only for fp8 caches."""
    kwargs: dict[str, Any] = {
        "query": (q_latent, q_rope),
        "kv_cache": (ckv, kpe),
        "out": out,
        "lse": lse,
        "return_lse": True,
        "return_lse_base_on_e": True,
    }
    if fp8_scale is not None:
        kwargs["ckv_scale"] = float(fp8_scale)
        kwargs["kpe_scale"] = float(fp8_scale)
    return kwargs


def cutlass_plan_kwargs(metadata: Any, *, kv_lora_rank: int, rope_dim: int, page_size: int, sm_scale: float,
                        dtype: torch.dtype) -> dict[str, Any]:
    """``plan()`` keywords for cutlass: dense metadata, 128 heads, packed layouts, no LSE."""
    return _plan_kwargs(metadata, num_heads=128, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                        page_size=page_size, sm_scale=sm_scale, q_dtype=dtype, kv_dtype=dtype, layout="packed",
                        lse_mode="none")


def cutlass_run_kwargs(query: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, *,
                       out: torch.Tensor) -> dict[str, Any]:
    """``run()`` keywords for cutlass: packed query ``[B, 128, 576]``, the cache as adjacent views."""
    return {"query": query, "kv_cache": (ckv, kpe), "out": out}


def _decode_kwargs(query: torch.Tensor, kv_cache: torch.Tensor, workspace: torch.Tensor, *, kv_lora_rank: int,
                   rope_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                   out: torch.Tensor) -> dict[str, Any]:
    """Keywords shared by FlashInfer's trtllm-gen and XQA MLA decode functions (one packed 576-wide cache)."""
    return {
        "query": query,
        "kv_cache": kv_cache,
        "workspace_buffer": workspace,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM_PLACEHOLDER,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": rope_dim,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "max_seq_len": int(max_seq_len),
        "out": out,
    }


def trtllm_kwargs(query: torch.Tensor, kv_cache: torch.Tensor, workspace: torch.Tensor, *,
                  kv_lora_rank: int, rope_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  max_seq_len: int, out: torch.Tensor, lse: torch.Tensor,
                  bmm1_scale: float | torch.Tensor, bmm2_scale: float | torch.Tensor) -> dict[str, Any]:
    """``trtllm_batch_decode_with_kv_cache_mla`` keywords (explicit trtllm-gen, natural-log LSE)."""
    return {
        **_decode_kwargs(query, kv_cache, workspace, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                         block_tables=block_tables, seq_lens=seq_lens, max_seq_len=max_seq_len, out=out),
        "bmm1_scale": bmm1_scale,
        "bmm2_scale": bmm2_scale,
        "backend": "trtllm-gen",
        "lse": lse,
        "return_lse": True,
        "return_lse_base": "basee",
    }


def xqa_kwargs(query: torch.Tensor, kv_cache: torch.Tensor, workspace: torch.Tensor, *, kv_lora_rank: int,
               rope_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
               out: torch.Tensor, bmm1_scale: float | torch.Tensor,
               bmm2_scale: float | torch.Tensor) -> dict[str, Any]:
    """``xqa_batch_decode_with_kv_cache_mla`` keywords. Scales are Python floats, or both float32 ``[1]``
    device tensors (the fp8 path: XQA then reads them on the device, no host sync); never mixed."""
    tensors = [isinstance(x, torch.Tensor) for x in (bmm1_scale, bmm2_scale)]
    if any(tensors) and not all(tensors):
        raise TypeError("bmm1_scale/bmm2_scale: got one tensor and one float; supported both floats or both "
                        "float32 tensors")

    def as_scale(x: float | torch.Tensor) -> float | torch.Tensor:
        return x.to(torch.float32).reshape(1) if isinstance(x, torch.Tensor) else float(x)

    return {
        **_decode_kwargs(query, kv_cache, workspace, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                         block_tables=block_tables, seq_lens=seq_lens, max_seq_len=max_seq_len, out=out),
        "bmm1_scale": as_scale(bmm1_scale),
        "bmm2_scale": as_scale(bmm2_scale),
    }


#: builder name -> (loader of the FlashInfer object, attribute whose signature the keywords must match)
KWARG_TARGETS: dict[str, tuple[Any, str | None]] = {
    "csr_metadata_kwargs": (load_plan_metadata_class, "csr"),
    "dense_metadata_kwargs": (load_plan_metadata_class, "dense"),
    "wrapper_init_kwargs": (load_wrapper_class, "__init__"),
    "fa_plan_kwargs": (load_wrapper_class, "plan"),
    "fa_run_kwargs": (load_wrapper_class, "run"),
    "cutlass_plan_kwargs": (load_wrapper_class, "plan"),
    "cutlass_run_kwargs": (load_wrapper_class, "run"),
    "trtllm_kwargs": (load_trtllm_decode, None),
    "xqa_kwargs": (load_xqa_decode, None),
}
