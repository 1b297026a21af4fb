"""Validation of ``forward_mqa`` arguments, shared by every backend (run before any kernel launches)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch

from ..core.device import device_info_for
from ..core.dtypes import MODEL_DTYPES, lse_dtype
from ..core.validation import first_shared, require_on_device, require_scale, require_separate, require_tensor
from ..step.cache import LatentKVCache
from ..step.checks import require_graph_support, require_whole_sequences
from ..step.metadata import BatchMetadata
from ..step.plan import StepPlan, StepPlanError
from .capabilities import AttentionSpec, QueryLenSupport
from .reasons import Reason, ReasonKind, all_of_kinds, reasons_of, without_kinds

__all__ = ["check_mqa_inputs", "check_declared_support", "declaration_key", "declared_reasons",
           "planned_declarations", "check_configured_call", "PlannedCall", "planned_call", "is_vouched_call"]


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
    plan: StepPlan | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the inputs of ``forward_mqa`` disagree.

    Block ids are checked on the host (``plan.check_cache``: the step's largest live block id, computed when the
    step was planned, against ``cache.num_blocks``), so dense calls read no device value. The one
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
    if out is not None or lse_out is not None:
        require_separate({"out": out, "lse_out": lse_out},
                         {"cache": cache.data, "q_latent": q_latent, "q_rope": q_rope, "topk_indices": topk_indices})
    if plan is not None:
        plan.check_cache(cache)  # the step's block-id maximum, from planning (no device read)
    else:
        meta.check_cache(cache)
    if check_values and topk_indices is not None and topk_indices.numel():
        limit = meta.token_positions[:, None]  # on the cache's device, as topk_indices (checked above)
        bad = (topk_indices < -1) | (topk_indices > limit)
        if bool(bad.any()):
            t = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(
                f"topk_indices: token {t} selects position(s) outside [0, {int(limit[t])}] (its causal "
                f"window); supported -1 (padding) or a visible position"
            )


def check_configured_call(name: str, spec: AttentionSpec, layer_scale: float, kv_name: str | None,
                          q_latent: torch.Tensor, cache: LatentKVCache, topk_indices: torch.Tensor | None,
                          scale: float, v4: tuple[bool, bool, bool] = (False, False, False)) -> None:
    """A call of backend ``name``, configured for ``spec`` and ``layer_scale`` (its cache dtype resolving to
    ``kv_name``), carries that configuration: heads, widths, query dtype, softmax scale, sparse or dense, the
    DeepSeek-V4 inputs (``v4``: sinks, window, compressed keys given), and the page size / cache dtype when the
    configuration names them; anything else is a :class:`StepPlanError` (its prepared states and resources
    were made for the configuration)."""
    got = (q_latent.shape[1], q_latent.dtype, cache.kv_lora_rank, cache.qk_rope_head_dim, float(scale),
           topk_indices is not None, tuple(v4))
    want = (spec.num_heads, spec.dtype, spec.kv_lora_rank, spec.qk_rope_head_dim, layer_scale, spec.sparse,
            (spec.sinks, spec.window, spec.compressed))
    cache_ok = ((spec.block_size is None or spec.block_size == cache.block_size)
                and (spec.kv_cache_dtype == "auto" or cache.kv_cache_dtype == kv_name))
    if got != want or not cache_ok:
        names = ("heads", "dtype", "kv_lora_rank", "qk_rope_head_dim", "scale", "sparse",
                 "V4 inputs (sinks, window, compressed)")
        diff = [f"{n} {g!r} (configured {w!r})" for n, g, w in zip(names, got, want, strict=True) if g != w]
        if not cache_ok:
            diff.append(f"a cache of page size {cache.block_size} and dtype {cache.kv_cache_dtype} (configured "
                        f"{spec.block_size}, {spec.kv_cache_dtype})")
        raise StepPlanError(f"{name}: got a call with {', '.join(diff)}; supported the configuration this backend "
                            "was made for (configure_backend(backend, spec, scale) returns the backend of another "
                            "configuration)")


class PlannedCall(NamedTuple):
    """What every call of a configured backend carries, for :func:`is_vouched_call`: made once, when the backend
    is configured, from its :class:`AttentionSpec` and scale (:func:`planned_call`)."""

    token: int  #: the configuration key's token (the step plan records accepted calls under it)
    heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype  #: the queries' and the output's
    lse_dtype: torch.dtype
    scale: float
    kv_cache_dtype: str  #: the cache's, resolved


def planned_call(spec: AttentionSpec, scale: float, kv_cache_dtype: str | None, token: int) -> PlannedCall | None:
    """The :class:`PlannedCall` of a configuration; None where :func:`is_vouched_call` does not apply: sparse and
    DeepSeek-V4 configurations (their calls carry more inputs), an unresolved cache dtype, and what
    :func:`check_mqa_inputs` refuses whatever the declarations say (no heads, a query dtype outside
    ``MODEL_DTYPES``), so that those calls meet it."""
    if (spec.sparse or spec.sinks or spec.window or spec.compressed or kv_cache_dtype is None
            or spec.num_heads < 1 or spec.dtype not in MODEL_DTYPES):
        return None
    return PlannedCall(token, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.dtype,
                       lse_dtype(spec.dtype), scale, kv_cache_dtype)


def is_vouched_call(call: PlannedCall, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache,
                    meta: BatchMetadata, scale: float, out: torch.Tensor | None, lse_out: torch.Tensor | None,
                    plan: StepPlan) -> bool:
    """True when a dense ``forward_mqa`` call of a configured backend is one that ``plan`` recorded as accepted
    (:func:`planned_declarations`) and every input agrees with the configuration ``call`` and the plan: the hot
    path's check, each fact compared once and no message built. It accepts a subset of what
    :func:`check_mqa_inputs`, :func:`check_declared_support` and the configured-call check accept; False never
    means the call is wrong, only that those full checks run (and name what disagrees)."""
    if not (isinstance(cache, LatentKVCache) and isinstance(meta, BatchMetadata)) or type(scale) is not float:
        return False
    vouched = (call.token, id(meta)) if lse_out is None else (call.token, id(meta), "lse")
    if (scale != call.scale or vouched not in plan.accepted or meta.dcp_size != 1
            or cache.kv_cache_dtype != call.kv_cache_dtype or not plan.cache_fits(cache)):
        return False  # (a configured page size: the plan vouches only where it is the step's, which cache_fits checks)
    if not (isinstance(q_latent, torch.Tensor) and isinstance(q_rope, torch.Tensor)
            and (out is None or isinstance(out, torch.Tensor))
            and (lse_out is None or isinstance(lse_out, torch.Tensor))):
        return False
    dtype, T, H, r = call.dtype, meta.num_tokens, call.heads, call.kv_lora_rank
    if (cache.kv_lora_rank != r or cache.qk_rope_head_dim != call.qk_rope_head_dim
            or q_latent.dtype is not dtype or q_rope.dtype is not dtype or q_latent.shape != (T, H, r)
            or q_rope.shape != (T, H, call.qk_rope_head_dim)
            or (out is not None and (out.dtype is not dtype or out.shape != (T, H, r)))
            or (lse_out is not None and (lse_out.dtype is not call.lse_dtype or lse_out.shape != (T, H)))):
        return False
    device = cache.device
    tensors = (meta.block_table, q_latent, q_rope, out, lse_out)
    if device.type == "cpu":
        if not all(t.is_cpu for t in tensors if t is not None):
            return False
    elif any(t.device != device for t in tensors if t is not None):
        return False
    return first_shared({"out": out, "lse_out": lse_out},
                        {"cache": cache.data, "q_latent": q_latent, "q_rope": q_rope}) is None


def declaration_key(backend_cls: type, dtype: torch.dtype, num_heads: int, kv_cache_dtype: str,
                    block_size: int, kv_lora_rank: int, qk_rope_head_dim: int, device: torch.device, *,
                    sparse: bool, need_lse: bool, meta: BatchMetadata,
                    v4: tuple[bool, bool, bool] = (False, False, False)) -> Hashable:
    """What :func:`check_declared_support` asks, as one hashable key: the backend, its inputs' dtypes, heads,
    cache layout and device, sparse or dense, an LSE or not, the step's query-length facts and the DeepSeek-V4
    inputs it passes (``v4``: sinks, window, compressed keys)."""
    caps = backend_cls.capabilities
    lens = meta.query_lens_list
    empty = caps.query_len != QueryLenSupport.VARLEN and meta.num_tokens > 0 and 0 in lens
    return (backend_cls, caps, dtype, num_heads, kv_cache_dtype, block_size, kv_lora_rank, qk_rope_head_dim,
            device, bool(sparse), bool(need_lse), meta.max_query_len, meta.is_uniform_query_len,
            tuple(sorted(set(lens))) if empty else None, tuple(v4))


def declared_reasons(key: Hashable) -> list[Reason]:
    """Every reason the backend of ``key`` (:func:`declaration_key`) refuses those inputs, missing packages
    left out (importing the kernel reports them). Empty: accepted."""
    (backend_cls, caps, dtype, heads, kv_dtype, block_size, rank, rope, device, sparse, need_lse, max_q,
     uniform, empty, (sinks, window, compressed)) = key  # type: ignore[misc]
    spec = AttentionSpec(num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope, dtype=dtype,
                         kv_cache_dtype=kv_dtype, block_size=block_size, sparse=sparse, max_query_len=max_q,
                         uniform_query_len=uniform, need_lse=need_lse, device=device_info_for(device),
                         sinks=sinks, window=window, compressed=compressed)
    reasons = without_kinds(reasons_of(backend_cls, spec), ReasonKind.PACKAGE)
    if empty is not None:
        reasons.append(Reason(ReasonKind.QUERY_LEN, "meta.query_lens", str(list(empty)),
                              f">= 1 token in every request ({caps.query_len.name.lower()} query lengths)"))
    return reasons


def planned_declarations(backend: object, meta: BatchMetadata, *, sparse: bool = False) -> frozenset[Hashable]:
    """What a step plan records as accepted for ``backend`` on ``meta``, asked of the declarations once, when the
    step is planned: the combination its configuration (``backend.layer_spec``: heads, dims, dtypes; the page
    size, ``meta``'s when the configuration leaves it open) describes, when the backend accepts it, as its
    declaration key and as ``(configuration token, id(meta))``, which a configured backend's ``forward_mqa``
    looks up without rebuilding the key; the same with an LSE wanted (a call passing ``lse_out``:
    ``(token, id(meta), "lse")``) when the declarations accept that too. Empty for an unconfigured backend (its
    calls are then checked in full) or a refused combination."""
    spec = getattr(backend, "layer_spec", None)
    if not isinstance(spec, AttentionSpec):
        return frozenset()
    try:
        kv = spec.resolved_kv_cache_dtype
    except (ValueError, TypeError):
        return frozenset()
    block_size = meta.block_size if spec.block_size is None else spec.block_size
    sparse = spec.sparse if getattr(backend, "_configuration", None) is not None else sparse  # calls carry it
    key = declaration_key(type(backend), spec.dtype, spec.num_heads, kv, block_size, spec.kv_lora_rank,
                          spec.qk_rope_head_dim, meta.device, sparse=sparse, need_lse=False, meta=meta,
                          v4=(spec.sinks, spec.window, spec.compressed))
    lse_key = declaration_key(type(backend), spec.dtype, spec.num_heads, kv, block_size, spec.kv_lora_rank,
                              spec.qk_rope_head_dim, meta.device, sparse=sparse, need_lse=True, meta=meta,
                              v4=(spec.sinks, spec.window, spec.compressed))  # calls that pass ``lse_out``
    try:
        if declared_reasons(key):
            return frozenset()
        with_lse = not declared_reasons(lse_key)
    except TypeError:  # a declaration that cannot be hashed (a plugin's own field type): checked per call
        return frozenset()
    token = getattr(getattr(backend, "_configuration", None), "token", None)
    keys = {key, lse_key} if with_lse else {key}
    if token is not None and block_size == meta.block_size:
        keys |= {(token, id(meta))} | ({(token, id(meta), "lse")} if with_lse else set())
    return frozenset(keys)


def check_declared_support(
    backend_cls: type,
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    *,
    topk_indices: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    plan: StepPlan | None = None,
    v4: tuple[bool, bool, bool] = (False, False, False),
) -> None:
    """Raise when the declarations of ``backend_cls`` (an ``MLABackend`` subclass) reject these ``forward_mqa``
    inputs, listing every reason. Run after :func:`check_mqa_inputs`.

    Builds the ``AttentionSpec`` the inputs describe (heads and dtype of ``q_latent [T, H, r]``; the cache's
    dims, dtype, page size and device; the query lengths of ``meta``; sparse when ``topk_indices`` is given; an
    LSE wanted when ``lse_out`` is given) and asks ``backend_cls.not_supported_reasons``, the question the
    selector asks, so no backend re-checks its declarations by hand. A combination the step's ``plan``
    recorded as accepted when it was planned (:func:`planned_declarations`: every layer of a step asks the same
    question) is looked up instead (the hot path). Reasons of kind ``PACKAGE`` are left out (importing the
    kernel reports them). Kernels with fixed query lengths (single-token or uniform) also need at least one
    token in every request.

    Raises:
        TypeError: when every reason is about a dtype.
        ValueError: otherwise. Message: ``"<BACKEND> cannot run these inputs: <reason>; <reason> ..."``.
    """
    require_graph_support(backend_cls, meta)  # DecodeGraphMetadata: only backends declaring cuda_graphs
    key = declaration_key(backend_cls, q_latent.dtype, q_latent.shape[1], cache.kv_cache_dtype, cache.block_size,
                          cache.kv_lora_rank, cache.qk_rope_head_dim, cache.device,
                          sparse=topk_indices is not None, need_lse=lse_out is not None, meta=meta, v4=v4)
    try:
        if plan is not None and key in plan.accepted:
            return
    except TypeError:  # unhashable declarations: asked in full
        pass
    reasons = declared_reasons(key)
    if reasons:
        dtype_only = all_of_kinds(reasons, ReasonKind.DTYPE, ReasonKind.KV_CACHE_DTYPE)
        raise (TypeError if dtype_only else ValueError)(
            f"{backend_cls.name} cannot run these inputs: " + "; ".join(map(str, reasons)))
