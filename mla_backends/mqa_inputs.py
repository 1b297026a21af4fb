"""Validation of ``forward_mqa`` arguments, shared by every backend (run before any kernel launches)."""

from __future__ import annotations

import torch

from .cache import LatentKVCache
from .capabilities import AttentionSpec, QueryLenSupport
from .device import device_info_for
from .dtypes import MODEL_DTYPES, lse_dtype
from .meta_checks import require_graph_support, require_whole_sequences
from .metadata import BatchMetadata
from .reasons import Reason, ReasonKind, all_of_kinds, without_kinds
from .validation import require_no_alias, require_on_device, require_scale, require_tensor

__all__ = ["check_mqa_inputs", "check_declared_support"]


def check_mqa_inputs(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    scale: float,
    topk_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    check_values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the inputs of ``forward_mqa`` disagree.

    Block ids are checked on the host (:meth:`BatchMetadata.check_cache`: ``build``'s per-request maxima
    against ``cache.num_blocks``, once per step and cache size), so dense calls read no device value. The one
    check that reads device tensors is the sparse top-k window (a sync, sparse calls only);
    ``check_values=False`` skips it, as ``forward_mqa`` does while a CUDA graph is being captured.
    """
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache")
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    require_whole_sequences(meta, "forward_mqa")  # DCP metadata: the layer hands over the rank's local one
    T = meta.num_tokens
    require_tensor("q_latent", q_latent, shape=(T, None, cache.kv_lora_rank), dtypes=MODEL_DTYPES)
    H = q_latent.shape[1]
    require_tensor("q_rope", q_rope, shape=(T, H, cache.qk_rope_head_dim), dtypes=(q_latent.dtype,))
    if H < 1:
        raise ValueError(f"q_latent: got {H} heads; supported >= 1")
    require_scale("scale", scale, what="a positive finite float (the unabsorbed softmax scale)")
    if topk_indices is not None:
        require_tensor("topk_indices", topk_indices, shape=(T, None), dtypes=(torch.int32, torch.int64))
        if topk_indices.shape[1] < 1:
            raise ValueError("topk_indices: got width 0; supported >= 1 (pad with -1)")
    if out is not None:
        require_tensor("out", out, shape=(T, H, cache.kv_lora_rank), dtypes=(q_latent.dtype,))
    if lse_out is not None:
        require_tensor("lse_out", lse_out, shape=(T, H), dtypes=(lse_dtype(q_latent.dtype),))
    optional = {"topk_indices": topk_indices, "out": out, "lse_out": lse_out}
    require_on_device(cache.device, q_latent=q_latent, q_rope=q_rope, **{"meta.block_table": meta.block_table},
                      **{k: v for k, v in optional.items() if v is not None})
    inputs = {"cache": cache.data, "q_latent": q_latent, "q_rope": q_rope, "topk_indices": topk_indices}
    if out is not None:
        require_no_alias("out", out, **inputs)
    if lse_out is not None:
        require_no_alias("lse_out", lse_out, out=out, **inputs)
    meta.check_cache(cache)  # host-side verdict from build, once per step (no device read)
    if check_values and topk_indices is not None and topk_indices.numel():
        limit = meta.token_positions[:, None]  # on the cache's device, as topk_indices (checked above)
        bad = (topk_indices < -1) | (topk_indices > limit)
        if bool(bad.any()):
            t = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(
                f"topk_indices: token {t} selects position(s) outside [0, {int(limit[t])}] (its causal "
                f"window); supported -1 (padding) or a visible position"
            )


def check_declared_support(
    backend_cls: type,
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    topk_indices: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> None:
    """Raise when the declarations of ``backend_cls`` (an ``MLABackend`` subclass) reject these ``forward_mqa``
    inputs, listing every reason. Run after :func:`check_mqa_inputs`.

    Builds the ``AttentionSpec`` the inputs describe (heads and dtype of ``q_latent [T, H, r]``; the cache's
    dims, dtype, page size and device; the query lengths of ``meta``; sparse when ``topk_indices`` is given; an
    LSE wanted when ``lse_out`` is given) and asks ``backend_cls.not_supported_reasons``, the question the
    selector asks, so no backend re-checks its declarations by hand. Reasons of kind ``PACKAGE`` are left
    out (importing the kernel reports them). Kernels with fixed query lengths (single-token or uniform) also
    need at least one token in every request.

    Raises:
        TypeError: when every reason is about a dtype.
        ValueError: otherwise. Message: ``"<BACKEND> cannot run these inputs: <reason>; <reason> ..."``.
    """
    require_graph_support(backend_cls, meta)  # DecodeGraphMetadata: only backends declaring cuda_graphs
    # every layer of a step shares ``meta``: an accepted combination is looked up, not re-derived (hot path)
    key = ("declared", backend_cls, q_latent.dtype, q_latent.shape[1], cache.kv_cache_dtype, cache.block_size,
           cache.kv_lora_rank, cache.qk_rope_head_dim, cache.device, topk_indices is None, lse_out is None)
    if key in meta.step_plan.accepted:
        return
    caps = backend_cls.capabilities
    lens = meta.query_lens_list
    spec = AttentionSpec(num_heads=q_latent.shape[1], kv_lora_rank=cache.kv_lora_rank,
                         qk_rope_head_dim=cache.qk_rope_head_dim, dtype=q_latent.dtype,
                         kv_cache_dtype=cache.kv_cache_dtype, block_size=cache.block_size,
                         sparse=topk_indices is not None, max_query_len=meta.max_query_len,
                         uniform_query_len=meta.is_uniform_query_len, need_lse=lse_out is not None,
                         device=device_info_for(cache.device))
    reasons = without_kinds(backend_cls.not_supported_reasons(spec), ReasonKind.PACKAGE)
    if caps.query_len != QueryLenSupport.VARLEN and meta.num_tokens and 0 in lens:
        reasons.append(Reason(ReasonKind.QUERY_LEN, "meta.query_lens", str(sorted(set(lens))),
                              f">= 1 token in every request ({caps.query_len.name.lower()} query lengths)"))
    if reasons:
        dtype_only = all_of_kinds(reasons, ReasonKind.DTYPE, ReasonKind.KV_CACHE_DTYPE)
        raise (TypeError if dtype_only else ValueError)(
            f"{backend_cls.name} cannot run these inputs: " + "; ".join(map(str, reasons)))
    meta.step_plan.accepted.add(key)
