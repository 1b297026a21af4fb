"""``MLAAttention``: the module a host engine puts in each DeepSeek layer.

It owns the projections, RoPE, the folded weights and both attention paths; the backend supplies only the
absorbed ``forward_mqa``::

    layer = MLAAttention.from_hf_config(config, backend=None, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    layer.load_hf_state_dict(state_dict)                 # transformers' DeepseekV2/V3Attention names
    cache = layer.allocate_cache(num_blocks, block_size)  # LatentKVCache
    meta = BatchMetadata.build(query_lens, context_lens, block_table, block_size)
    plan = plan_step(meta, layers)                        # once per step, before the first layer
    out = layer(hidden_states, positions, cache, plan)   # [tokens, hidden_size], caller's token order

One step, for ``T`` tokens in processing order (decodes first):

- ``q = q_b_proj(rms(q_a_proj(x)))`` (or ``q_proj(x)``) -> ``[T, H, nope + rope]``;
  ``kv_a_proj_with_mqa(x)`` -> latent ``[T, R]`` (RMS-normalised) and ``k_pe [T, rope]``; RoPE on both rope
  slices; the new ``[latent | k_pe]`` rows are written to the cache.
- absorbed requests: ``q_nope @ W_UK_T`` -> ``backend.forward_mqa`` -> ``@ W_UV``;
- expanded requests: :func:`~mla_backends.layer.prefill.forward_mha` (new tokens causal, cached context in
  workspace-sized chunks, LSE merge);
- ``o_proj`` over ``[T, H * v]``; with tensor parallelism this is the rank's partial sum.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import torch

from ..backends.contract import AttentionSpec, Capabilities, MLABackend, configure_backend
from ..backends.dispatch import DispatchPolicy, decode_threshold, layer_policy, runs_key, step_runs
from ..backends.reasons import Reason, ReasonKind, reasons_of, without_kinds
from ..backends.thresholds import ThresholdTable
from ..core.device import cuda_device_index, device_info_for
from ..core.dims import MLADims, read_config_json
from ..core.dtypes import dtype_name, parse_model_dtype, resolve_kv_cache_dtype
from ..core.rope import RotaryEmbedding
from ..core.validation import require_device, require_int, require_tensor
from ..loading import checkpoint
from ..loading.fp8 import DEFAULT_WEIGHT_BLOCK_SIZE, check_weight_block_size, weight_block_size_from_config
from ..loading.hf import hf_attention_bias
from ..plugins.loading import get_backend
from ..step.cache import LatentKVCache
from ..step.checks import check_graph_step
from ..step.metadata import BatchMetadata
from ..step.plan import PlanRequest, Run, StepPlan, require_plan
from . import dcp as parallel
from .dcp import absorbed_attention as dcp_absorbed_attention
from .prefill import forward_mha
from .projections import linear, rms_norm
from .sparse.layer_support import DEFAULT_INDEXER_STORAGE, SparseKVCache, build_indexer, layer_indexer_storage
from .weights import add_attention_weights, load_hf_weights
from .workspace import PrefillWorkspace, default_workspace_rows, shared_workspace

__all__ = ["MLAAttention"]

#: assumed concurrent requests when sizing the default prefill workspace (vLLM's default max_num_seqs)
DEFAULT_MAX_NUM_SEQS = 256


def check_step_inputs(dims: MLADims, dtype: torch.dtype, device: torch.device, hidden_states: torch.Tensor,
                      positions: torch.Tensor | None, cache: LatentKVCache, meta: BatchMetadata,
                      topk_indices: torch.Tensor | None, *, reuses_topk: bool, layer_idx: int) -> None:
    """Types, shapes, dtypes and devices of a layer step: ``hidden_states [T, hidden_size]`` in ``dtype``,
    ``positions [T]`` int, ``topk_indices [T, K]`` on sparse layers only (required where the layer reuses the
    previous layer's top-k), a cache of the layer's row widths and page size, everything on ``device``."""
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache (layer.allocate_cache)")
    T = meta.num_tokens
    require_tensor("hidden_states", hidden_states, shape=(T, dims.hidden_size), dtypes=(dtype,))
    if positions is not None:
        require_tensor("positions", positions, shape=(T,), dtypes=(torch.int32, torch.int64))
    if topk_indices is not None:
        if dims.indexer is None:
            raise ValueError("topk_indices: got a tensor on a dense layer; supported None")
        require_tensor("topk_indices", topk_indices, shape=(T, None), dtypes=(torch.int32, torch.int64))
    elif dims.indexer is not None and reuses_topk:
        raise ValueError(f"topk_indices: got None on layer {layer_idx}, which reuses the previous "
                         "layer's top-k; supported that layer's last_topk_indices")
    if (cache.kv_lora_rank, cache.qk_rope_head_dim) != (dims.kv_lora_rank, dims.qk_rope_head_dim):
        raise ValueError(f"cache: got rows of {cache.kv_lora_rank}+{cache.qk_rope_head_dim}; supported "
                         f"{dims.kv_lora_rank}+{dims.qk_rope_head_dim} (this layer's dims)")
    if meta.block_size != cache.block_size:
        raise ValueError(f"meta.block_size: got {meta.block_size}; supported the cache's {cache.block_size}")
    for name, dev in (("hidden_states", hidden_states.device), ("cache", cache.device), ("meta", meta.device)):
        if dev != device:
            raise ValueError(f"{name}: got device {dev}; supported the layer's device {device}")


def _choose_backend(backend: Any, dims: MLADims, dtype: torch.dtype, device: torch.device,
                    dcp_size: int) -> type[MLABackend]:
    """A named/given backend through the registry; otherwise the selector's choice (under DCP for the
    group's ``dcp_size * H`` heads, with the LSE)."""
    if backend is not None:
        return get_backend(backend)
    from selector import select_backend  # selector.select imports the registry: loaded on first use

    dev = "cpu" if device.type != "cuda" else f"cuda:{cuda_device_index(device)}"
    kernel_dims = replace(dims, num_heads=dims.num_heads * dcp_size, tp_size=dims.tp_size // dcp_size)
    return select_backend(kernel_dims, dtype=dtype, device=dev, sparse=dims.is_sparse,
                          need_lse=dcp_size > 1).backend


def _blocking_reasons(backend_cls: type[MLABackend], spec: AttentionSpec) -> list[Reason]:
    """Why ``backend_cls`` cannot run ``spec``, less missing packages (those fail when the backend runs);
    a refused LSE (the layer asks for one only under DCP) is worded as DCP's need."""
    reasons = without_kinds(reasons_of(backend_cls, spec), ReasonKind.PACKAGE)  # a crashing check: CHECK_FAILED
    return [parallel.LSE_REASON if r.kind is ReasonKind.LSE else r for r in reasons]


class MLAAttention(torch.nn.Module):
    """Multi-head latent attention for one layer (this rank's heads).

    Parameters use transformers' names (``q_a_proj``, ``kv_b_proj`` ...) with this rank's shapes; the folded
    ``W_UK_T [H, nope, R]`` and ``W_UV [H, R, v]`` are buffers rewritten in place on every load.

    Attributes:
        dims: per-rank :class:`MLADims`.
        backend: the ``forward_mqa`` provider (an instance).
        dispatch: the :class:`~mla_backends.layer.dispatch.DispatchPolicy` splitting absorbed/expanded requests.
        workspace_rows: context rows per ``forward_mha`` chunk.
        indexer: DeepSeek-V3.2's :class:`~mla_backends.layer.sparse.Indexer` of this layer; None on dense layers and
            on layers that reuse the previous layer's top-k (they take ``topk_indices`` from the caller).
        last_topk_indices: ``[tokens, topk]`` (caller order) the indexer selected in the last step, for the
            following layers that reuse it.
    """

    def __init__(
        self,
        dims: MLADims,
        *,
        backend: Any = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        tp_rank: int = 0,
        attention_bias: bool = False,
        dispatch: DispatchPolicy | str | None = None,
        workspace_rows: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        layer_idx: int = 0,
        threshold_table: ThresholdTable | str | os.PathLike[str] | None = None,
        weight_block_size: tuple[int, int] = DEFAULT_WEIGHT_BLOCK_SIZE,
        dcp_size: int = 1,
        dcp_group: Any = None,
        workspace: PrefillWorkspace | None = None,
    ) -> None:
        super().__init__()
        if workspace is not None and not isinstance(workspace, PrefillWorkspace):
            raise TypeError(f"workspace: got {type(workspace).__name__}; supported PrefillWorkspace or None "
                            "(None: the shared workspace of the device, mla_backends.layer.workspace)")
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
        require_int("tp_rank", tp_rank, minimum=0)
        if tp_rank >= dims.tp_size:
            raise ValueError(f"tp_rank: got {tp_rank}; supported 0..{dims.tp_size - 1} "
                             f"(tp_size {dims.tp_size})")
        #: this rank's decode-context-parallel place (None: no DCP); see mla_backends.layer.dcp
        self.dcp = parallel.dcp_group_for(tp_rank, dims.tp_size, dcp_size, dcp_group, sparse=dims.is_sparse)
        if workspace_rows is not None:
            require_int("workspace_rows", workspace_rows, minimum=1)
        if max_model_len is not None:
            require_int("max_model_len", max_model_len, minimum=1)
        self.max_model_len = max_model_len if max_model_len is not None else dims.max_position_embeddings
        self.max_num_seqs = require_int("max_num_seqs", max_num_seqs, minimum=1)
        #: block of one scale in block-quantised fp8 checkpoints (``quantization_config.weight_block_size``)
        self.weight_block_size = check_weight_block_size(weight_block_size)
        self.dims = dims
        self.dtype = parse_model_dtype(dtype, default=torch.bfloat16)
        self.device = require_device("device", device) if device is not None else torch.device("cpu")
        self.tp_rank = tp_rank
        self.attention_bias = bool(attention_bias)
        self._workspace_rows = workspace_rows
        self._own_workspace = workspace  # explicit: used for every call; None: the device's shared one
        self._workspace: PrefillWorkspace | None = workspace
        self.layer_idx = require_int("layer_idx", layer_idx, minimum=0)
        self.indexer = build_indexer(dims, layer_idx, dtype=self.dtype, device=self.device)  # V3.2 only
        self.last_topk_indices: torch.Tensor | None = None
        self.rotary = RotaryEmbedding.from_dims(dims)
        self.scale = dims.softmax_scale
        self._loaded = False

        backend_cls = _choose_backend(backend, dims, self.dtype, self.device, dcp_size)
        reasons = _blocking_reasons(backend_cls, self._spec())
        if reasons:
            raise ValueError(f"backend: got {backend_cls.name}, which cannot run this layer: "
                             + "; ".join(map(str, reasons)))
        self.backend_cls = backend_cls
        #: the configured backend (configure_backend: shared by every layer configured alike; a plugin's code
        #: there runs under plugin_call); allocate_cache completes it with the cache's page size and dtype
        self.backend: MLABackend = configure_backend(backend_cls, self._spec(), self.scale)
        self._planned = False  # set once the layer takes part in a plan: its configuration is fixed from then on
        # the policy named by `dispatch`, or a measured threshold table's (argument or the environment)
        self.dispatch: DispatchPolicy = layer_policy(dispatch, threshold_table, backend_cls.name)

        add_attention_weights(self, dims, self.attention_bias, dtype=self.dtype, device=self.device)

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        backend: Any = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dispatch: DispatchPolicy | str | None = None,
        workspace_rows: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        layer_idx: int = 0,
        threshold_table: ThresholdTable | str | os.PathLike[str] | None = None,
        dcp_size: int = 1,
        dcp_group: Any = None,
        workspace: PrefillWorkspace | None = None,
    ) -> MLAAttention:
        """Build the layer for a transformers config, a dict, a ``config.json`` path or an :class:`MLADims`.

        Args:
            backend: backend name or class; None = ``selector.select_backend``'s choice for the device.
            dtype: model dtype (default bfloat16). device: where weights live (default CPU).
            tp_rank / tp_size: this rank and the tensor-parallel degree (heads split evenly).
            dcp_size / dcp_group: decode context parallelism: ``dcp_size`` (dividing ``tp_size``) consecutive
                TP ranks split every sequence's cache, interleaved; ``dcp_group`` is their ProcessGroup
                (docs/layer.md, "Decode context parallelism"). Default 1: no DCP.
            dispatch: ``"per-request"`` (default, vLLM), ``"per-batch"`` (SGLang) or a DispatchPolicy.
            threshold_table: a ``mla-backends tune --output`` file (or a loaded ``ThresholdTable``) whose
                measured thresholds replace the backend's constant; default ``$MLA_BACKENDS_THRESHOLD_TABLE``
                when no ``dispatch`` is given.
            workspace_rows: ``forward_mha`` context chunk; default ``min(max(8 * max_model_len,
                4 * max_num_seqs * block_size), 65536)`` with ``max_model_len`` defaulting to the config's
                ``max_position_embeddings``.
            workspace: an explicit prefill workspace (default: the device's shared one, see :attr:`workspace`).

        The block of fp8 checkpoint scales is the config's ``quantization_config.weight_block_size``
        (``(128, 128)`` when absent); :meth:`load_hf_state_dict` uses it.
        """
        if isinstance(config, (str, os.PathLike)):  # read config.json once for the three lookups below
            config = read_config_json(config)
        dims = MLADims.from_hf_config(config).tensor_parallel(tp_size)  # checks tp_size
        return cls(dims, backend=backend, dtype=dtype, device=device, tp_rank=tp_rank,
                   attention_bias=hf_attention_bias(config), dispatch=dispatch, workspace_rows=workspace_rows,
                   max_model_len=max_model_len, max_num_seqs=max_num_seqs, layer_idx=layer_idx,
                   threshold_table=threshold_table, weight_block_size=weight_block_size_from_config(config),
                   dcp_size=dcp_size, dcp_group=dcp_group, workspace=workspace)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, layer_idx: int, *, dtype: str | torch.dtype | None = None,
                        tp_rank: int = 0, tp_size: int = 1, **options: Any) -> MLAAttention:
        """Layer ``layer_idx`` of checkpoint folder ``path`` (``dtype=None``: the checkpoint's own); ``options``
        go to :meth:`from_hf_config`. Arguments are checked before any read (:func:`checkpoint.load_layer`)."""
        return checkpoint.load_layer(cls, path, layer_idx, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, **options)

    def _spec(self, kv_cache_dtype: str = "auto", block_size: int | None = None) -> AttentionSpec:
        D = 1 if self.dcp is None else self.dcp.size  # under DCP the kernel runs the group's D * H heads
        return AttentionSpec(num_heads=self.dims.num_heads * D, need_lse=D > 1, kv_lora_rank=self.dims.kv_lora_rank,
                             qk_rope_head_dim=self.dims.qk_rope_head_dim, dtype=self.dtype,
                             kv_cache_dtype=kv_cache_dtype, block_size=block_size, sparse=self.dims.is_sparse,
                             device=device_info_for(self.device))

    # ---- weights -----------------------------------------------------------------------------------------
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], *, prefix: str = "",
                           sharded: bool = False) -> None:
        """Load transformers-named attention weights; see :func:`~mla_backends.layer.weights.load_hf_weights`
        (full tensors, this rank's slice taken; ``sharded=True``: already this rank's slices; ``prefix``, such as
        ``"model.layers.3.self_attn."``, selects this layer's keys from a whole checkpoint's dict)."""
        load_hf_weights(self, state_dict, prefix=prefix, sharded=sharded)
        self._loaded = True

    # ---- cache, workspace, dispatch ----------------------------------------------------------------------
    @property
    def preferred_block_size(self) -> int:
        """The page size (tokens) the selection gives this layer's backend when none is asked for: its
        ``capabilities.preferred_page_size``, what ``select_backend(...).block_size`` returns for it."""
        return self.backend_cls.capabilities.preferred_page_size

    def allocate_cache(self, num_blocks: int, block_size: int | None = None,
                       kv_cache_dtype: str | torch.dtype = "auto", *, scale: float = 1.0,
                       indexer_storage: str | torch.dtype = DEFAULT_INDEXER_STORAGE) -> LatentKVCache:
        """A zeroed :class:`LatentKVCache` for this layer (model dtype, device), after checking that the
        backend takes ``block_size`` (None: :attr:`preferred_block_size`) and ``kv_cache_dtype``. Under DCP it
        holds this rank's pages only.

        ``indexer_storage`` (DeepSeek-V3.2 layers, whose cache is a ``SparseKVCache``): how the indexer keys are
        stored. ``"fp8_e4m3"`` (default): 132 bytes a token, as vLLM and SGLang store them; ``"auto"``: the
        layer's dtype, exact keys as transformers' ``DeepseekV32`` keeps them (its top-k then agrees; fp8 keys
        change the top-k of some tokens, docs/sparse.md); or a float dtype. A dense layer takes only the default.
        """
        storage = layer_indexer_storage(self.dims, self.dtype, indexer_storage)  # checked before allocating
        require_int("num_blocks", num_blocks, minimum=1)
        block_size = self.preferred_block_size if block_size is None else block_size
        require_int("block_size", block_size, minimum=1)
        kv_name = kv_cache_dtype if isinstance(kv_cache_dtype, str) else dtype_name(kv_cache_dtype)
        reasons = _blocking_reasons(self.backend_cls, self._spec(kv_name, block_size))
        if reasons:
            raise ValueError(f"allocate_cache: backend {self.backend_cls.name} cannot use this cache: "
                             + "; ".join(map(str, reasons)))
        spec = self._spec(resolve_kv_cache_dtype(kv_name, self.dtype), block_size)
        # threads allocating caches of one model race here: read "planned" first (a layer's backend is swapped in
        # before it plans), then compare with the completed configuration's backend, the same object for every
        # thread asking
        planned = self._planned
        current = self.backend
        target = current if spec == current.layer_spec else configure_backend(current, spec, self.scale)
        if planned and target is not self.backend:
            raise ValueError(
                f"allocate_cache: got page size {block_size} and cache dtype {spec.kv_cache_dtype} for layer "
                f"{self.layer_idx}, whose backend is configured for page size {self.backend.layer_spec.block_size} "
                f"and cache dtype {self.backend.layer_spec.kv_cache_dtype} and has taken part in a step plan; "
                "supported the configuration it planned with (a layer is configured once: build another layer "
                "for another cache)")
        cache_cls = LatentKVCache if self.dims.indexer is None else SparseKVCache  # V3.2: + indexer keys
        extra = {} if self.dims.indexer is None else {"layer_idx": self.layer_idx, "indexer_storage": storage}
        cache = cache_cls.allocate(self.dims, num_blocks, block_size, kv_cache_dtype, model_dtype=self.dtype,
                                   device=self.device, scale=scale, **extra)
        if target is not self.backend:  # the configuration completed: page size and cache dtype
            self.backend = target
        return cache

    def workspace_rows(self, block_size: int) -> int:
        """Context rows per ``forward_mha`` chunk for caches with pages of ``block_size``."""
        if self._workspace_rows is not None:
            return self._workspace_rows
        return default_workspace_rows(self.max_model_len, self.max_num_seqs, block_size)

    @property
    def workspace(self) -> PrefillWorkspace | None:
        """The prefill workspace in use: the one given as ``workspace=``, else the shared workspace of this
        layer's device, dtype and stream (:func:`mla_backends.layer.workspace.shared_workspace`; the same object for
        every layer sharing it) from the last expanded call. None before the first one."""
        return self._workspace

    def workspace_for(self, block_size: int) -> PrefillWorkspace:
        """The workspace an expanded call over pages of ``block_size`` uses now (see :attr:`workspace`)."""
        if self._own_workspace is not None:
            return self._own_workspace
        self._workspace = shared_workspace(self.weight_device, self.dtype, self.workspace_rows(block_size))
        return self._workspace

    @property
    def decode_threshold(self) -> int:
        """Largest query length run absorbed (build the step's metadata with it and the split is one cut):
        :func:`mla_backends.layer.dispatch.decode_threshold` of this layer's policy and backend."""
        return decode_threshold(self.dispatch, parallel.dispatch_capabilities(self.backend_cls.capabilities, self.dcp))

    def runs(self, meta: BatchMetadata, *, sparse: bool | None = None) -> tuple[Run, ...]:
        """This step's runs ``Run(absorbed, start, stop)`` of processing-order requests, as dispatch cuts them
        (:func:`mla_backends.layer.dispatch.step_runs`, a pure function; the step plan keeps the result).
        ``sparse`` defaults to this layer's (DeepSeek-V3.2 layers run every request absorbed)."""
        sparse = self.dims.is_sparse if sparse is None else sparse
        return step_runs(meta, self.dispatch, self._dispatch_capabilities, sparse=sparse)

    @property
    def _dispatch_capabilities(self) -> Capabilities:
        """The backend's declarations as dispatch sees them (under DCP: single-token absorbed requests)."""
        return parallel.dispatch_capabilities(self.backend_cls.capabilities, self.dcp)

    def runs_key(self) -> object:
        """The key this layer's runs are kept under in a step plan (layers that dispatch alike share it)."""
        return runs_key(self.dispatch, self._dispatch_capabilities, sparse=self.dims.is_sparse)

    def plan_key(self) -> Hashable:
        """Layers with equal keys make equal :meth:`plan_request` s, so :func:`plan_step` asks only one of
        them: the same dispatch (``runs_key``), a backend prepared alike (``prepare_key``), the same DCP place."""
        if not self.__dict__["_planned"]:  # plan_step asks every participant this first: the configuration is
            self.__dict__["_planned"] = True  # fixed now (a plain attribute: nn.Module's __setattr__ costs 1 us)
        dcp = None if self.dcp is None else (self.dcp.rank, self.dcp.size)
        return ("MLAAttention", self.runs_key(), self.backend.prepare_key(), dcp, self.dims.is_sparse)

    def plan_request(self, meta: BatchMetadata, *, dispatch: object = None) -> PlanRequest:
        """What this layer runs in the step of ``meta``, for :func:`~mla_backends.step.plan.plan_step`: its
        runs, its backend (prepared for every absorbed batch: the run's sub-batch, or under DCP the rank's
        local decode metadata of it) and its DCP place. A layer dispatches by its own policy: ``dispatch`` is
        refused."""
        self.__dict__["_planned"] = True
        if dispatch is not None:
            raise ValueError(f"dispatch: got {dispatch!r} with layer {self.layer_idx} among the participants; "
                             f"supported None for layers (a layer dispatches by its own policy, here "
                             f"{self.dispatch.name}; dispatch= is for backends an engine calls itself)")
        parallel.check_dcp_metadata(self.dcp, meta)  # once per step (every layer alike has this DCP place)
        dcp = None if self.dcp is None else (self.dcp.rank, self.dcp.size)
        return PlanRequest(runs_key=self.runs_key(), runs=self.runs(meta), backend=self.backend, dcp=dcp,
                           sparse=self.dims.is_sparse)

    # ---- forward -------------------------------------------------------------------------------------------
    def _check_inputs(self, hidden_states: torch.Tensor, positions: torch.Tensor | None, cache: LatentKVCache,
                      plan: StepPlan, topk_indices: torch.Tensor | None) -> tuple[Run, ...]:
        """Every check of a layer call before anything is written; returns this layer's runs from ``plan``.

        What the step shares was checked once, when it was planned (the metadata against this layer's DCP place,
        the backend's declarations, its prepared states): a layer the plan names only checks its own tensors,
        the cache against the step (a host comparison) and finds its runs by identity. A layer alike to one the
        plan names (not named itself) is checked in full."""
        if not self._loaded:
            raise RuntimeError("MLAAttention: weights not loaded; call load_hf_state_dict(state_dict) first")
        meta = plan.meta
        check_step_inputs(self.dims, self.dtype, self.weight_device, hidden_states, positions, cache, meta,
                          topk_indices, reuses_topk=self.indexer is None, layer_idx=self.layer_idx)
        key = plan.members.get(id(self))
        if key is not None:
            runs = plan.runs[key]
        else:
            parallel.check_dcp_metadata(self.dcp, meta)
            runs = plan.runs_for(self.runs_key(), f"layer {self.layer_idx} (its dispatch {self.dispatch.name})")
            for absorbed, b0, b1 in runs:  # the backend this layer runs was planned for its batches
                if absorbed and meta.query_starts_list[b0] < meta.query_starts_list[b1]:
                    if self.dcp is None:
                        plan.state(self.backend, plan.batch(b0, b1))
                    else:
                        plan.local_decode(b0, b1, self.dcp.rank, self.dcp.size)
        if meta.graph_static:  # DecodeGraphMetadata
            check_graph_step(meta, self.backend_cls, lambda: runs,
                             indexer=self.indexer is not None and topk_indices is None)
        plan.check_cache(cache)  # the whole step against this cache, before anything is written (host only)
        return runs

    @property
    def weight_device(self) -> torch.device:
        return self.kv_b_proj.weight.device

    def _project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(q [T, H * (nope + rope)], normalised query latent [T, q_lora_rank] or None)``."""
        if self.dims.q_lora_rank is None:
            return linear(x, self.q_proj.weight), None
        qc = linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
        qc = rms_norm(qc, self.q_a_layernorm.weight, self.dims.rms_norm_eps)
        return linear(qc, self.q_b_proj.weight), qc

    def _check_query(self, q: torch.Tensor, meta: BatchMetadata) -> None:
        d = self.dims
        require_tensor("q", q, shape=(meta.num_tokens, d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim),
                       dtypes=(self.dtype,))

    def absorbed_attention(self, q: torch.Tensor, cache: LatentKVCache, plan: StepPlan, run: tuple[int, int], *,
                           topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The absorbed path of the plan's requests ``run`` (``(start, stop)``): roped ``q [n, H, nope + rope]``
        (processing order, their ``n`` tokens) -> ``[n, H, v_head_dim]`` through ``q_nope @ W_UK_T``,
        ``backend.forward_mqa`` (with the plan's prepared state) and ``@ W_UV``."""
        meta = plan.batch(*run)
        self._check_query(q, meta)
        N = self.dims.qk_nope_head_dim
        q_latent = torch.bmm(q[..., :N].transpose(0, 1), self.W_UK_T).transpose(0, 1).contiguous()  # [n, H, R]
        if self.dcp is not None:  # all-gather queries, local rows, LSE merge + reduce-scatter (mla_backends.layer.dcp)
            o = dcp_absorbed_attention(self.dcp, self.backend, q_latent, q[..., N:].contiguous(), cache, meta,
                                       scale=self.scale, plan=plan, run=run)
        else:
            o, _ = self.backend.forward_mqa(q_latent, q[..., N:].contiguous(), cache, meta, scale=self.scale,
                                            topk_indices=topk_indices, plan=plan)
        return torch.bmm(o.transpose(0, 1), self.W_UV).transpose(0, 1)  # [n, H, V]

    def expanded_attention(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                           cache: LatentKVCache, meta: BatchMetadata, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """The expanded path: :func:`~mla_backends.layer.prefill.forward_mha` of roped ``q [n, H, nope + rope]``
        with the new tokens' ``latent [n, R]`` and roped ``k_pe [n, rope]`` (already in ``cache``) ->
        ``[n, H, v_head_dim]`` (into ``out`` when given), using this layer's ``kv_b_proj`` and workspace."""
        self._check_query(q, meta)
        reader = None if self.dcp is None else parallel.context_rows(self.dcp, cache, meta)  # DCP: rows all-gathered
        return forward_mha(q, latent, k_pe, cache, meta, self.kv_b_proj.weight, scale=self.scale,
                           workspace=self.workspace_for(cache.block_size), out=out, context_rows=reader)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor | None,
        cache: LatentKVCache,
        plan: StepPlan,
        *,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of this layer.

        Args:
            hidden_states: ``[tokens, hidden_size]`` in the layer dtype, requests concatenated in the order of
                the metadata's ``query_lens`` (the caller's order).
            positions: ``[tokens]`` int RoPE positions in the same order (None: ``context_len + j``).
            cache: this layer's cache; the step's new rows are written before attention.
            plan: the step's :class:`~mla_backends.step.plan.StepPlan`, from ``plan_step(meta, layers)`` once
                per step before the first layer, naming this layer (metadata built with
                ``decode_threshold=layer.decode_threshold`` makes the split one cut; other thresholds work too).
                Metadata alone, or a plan made without this layer, is refused (TypeError / StepPlanError).
            topk_indices: sparse (DeepSeek-V3.2) only: ``[tokens, topk]`` positions, caller order, -1 padded;
                every request then runs absorbed.

        Returns:
            ``[tokens, hidden_size]`` in the caller's token order; with ``tp_size > 1`` the rank's partial
            ``o_proj`` output, to be summed across ranks.
        """
        plan = require_plan(plan, "MLAAttention.forward")
        runs = self._check_inputs(hidden_states, positions, cache, plan, topk_indices)
        meta = plan.meta
        d = self.dims
        H, N, P, V, R = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
        x = meta.to_processing_order(hidden_states)
        pos = meta.token_positions if positions is None else meta.to_processing_order(positions)
        if topk_indices is not None:
            topk_indices = meta.to_processing_order(topk_indices)
        T = x.shape[0]

        q, q_resid = self._project_q(x)
        q = q.view(T, H, N + P)
        kv = linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        latent = rms_norm(kv[:, :R], self.kv_a_layernorm.weight, d.rms_norm_eps)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        q = torch.cat([q[..., :N], self.rotary.apply(q[..., N:], cos, sin)], dim=-1)
        k_pe = self.rotary.apply(kv[:, R:], cos, sin)
        cache.write(latent, k_pe, plan)  # trusts build's validation: no device read
        if self.indexer is not None:  # DeepSeek-V3.2: the indexer caches its keys and picks the rows
            if topk_indices is None:
                topk_indices = self.indexer(x, q_resid, cache, meta, positions=pos)
                self.last_topk_indices = meta.to_caller_order(topk_indices)
            else:  # the caller's top-k; this step's indexer keys are still cached
                self.indexer.write_keys(x, cache, meta, positions=pos)

        attn = torch.empty(T, H, V, dtype=x.dtype, device=x.device)
        starts = meta.query_starts_list
        for absorbed, b0, b1 in runs:
            t0, t1 = starts[b0], starts[b1]
            if t0 == t1:
                continue
            if absorbed:
                tk = None if topk_indices is None else topk_indices[t0:t1]
                attn[t0:t1] = self.absorbed_attention(q[t0:t1], cache, plan, (b0, b1), topk_indices=tk)
            else:
                self.expanded_attention(q[t0:t1], latent[t0:t1], k_pe[t0:t1], cache, plan.batch(b0, b1),
                                        out=attn[t0:t1])
        bias = self.o_proj.bias if self.tp_rank == 0 else None
        y = linear(attn.view(T, H * V), self.o_proj.weight, bias)
        return meta.to_caller_order(y)

    def extra_repr(self) -> str:
        d = self.dims
        dcp = "" if self.dcp is None else f", dcp {self.dcp.rank}/{self.dcp.size}"
        return (f"heads={d.num_heads} (tp {self.tp_rank}/{d.tp_size}{dcp}), r={d.kv_lora_rank}, "
                f"nope={d.qk_nope_head_dim}, rope={d.qk_rope_head_dim}, v={d.v_head_dim}, "
                f"q_lora={d.q_lora_rank}, dtype={dtype_name(self.dtype)}, backend={self.backend_cls.name}, "
                f"dispatch={self.dispatch.name}, scale={self.scale:.6g}")

