"""``V4Attention``: one DeepSeek-V4 attention layer (window-only, CSA or HCA) on mla-backends.

::

    layer = V4Attention.from_hf_config(config, layer_idx=i, backend=None, dtype=torch.bfloat16)
    layer.load_hf_state_dict(state_dict)                  # transformers' DeepseekV4Attention names
    cache = layer.allocate_cache(num_blocks, block_size)  # V4LayerCache: window, compressed, state, indexer
    meta = BatchMetadata.build(query_lens, context_lens, block_table, block_size)
    plan = plan_step(meta, layers)                        # once per step: V4's tables and the backend's state
    out = layer(hidden_states, positions, cache, plan)   # [tokens, hidden_size], caller's token order

One step, ``T`` tokens in processing order (every request, prefill or decode, takes the same path):

- ``q = rope(rms_h(q_b_proj(rms(q_a_proj(x)))))`` ``[T, H, D]`` (an unweighted RMSNorm per head; the rotary on
  the last ``rope_head_dim`` channels); the row ``kv = rope(rms(kv_proj(x)))`` ``[T, D]`` goes to the window
  store at the token's slot;
- CSA/HCA: the compressor writes the tokens' state and the entries the step completes
  (:mod:`mla_backends.layer.v4.compressor`); CSA's indexer picks each token's top-k visible entries, HCA takes
  every visible one (planned);
- ``backend.forward_mqa(q, cache.window, sinks=..., window=sliding_window, compressed=...)`` -> ``[T, H, D]``;
- the output's rotated tail is rotated back by the token's position, then the grouped output projection:
  ``o_a_proj`` per group of ``H / o_groups`` heads to ``o_lora_rank``, ``o_b_proj`` to ``hidden_size`` (with
  tensor parallelism the rank's partial sum).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ...backends.contract import AttentionSpec, MLABackend, configure_backend
from ...backends.reasons import ReasonKind, reasons_of, without_kinds
from ...backends.v4_inputs import CompressedKeys
from ...core.device import cuda_device_index, device_info_for
from ...core.dtypes import accumulate_dtype, dtype_name, parse_model_dtype
from ...core.v4dims import CSA, HCA, SLIDING, V4Dims
from ...core.v4rope import V4Rotary
from ...core.validation import require_device, require_int, require_tensor
from ...loading.fp8 import DEFAULT_WEIGHT_BLOCK_SIZE, check_weight_block_size, weight_block_size_from_config
from ...plugins.loading import get_backend
from ...step.metadata import BatchMetadata
from ...step.plan import PlanRequest, Run, StepPlan, require_plan
from ...step.v4 import V4Planner, V4StepState, check_page_ratio
from ..projections import linear, rms_norm
from .cache import PLAIN_ROWS, RowFormat, V4LayerCache
from .compressor import V4Compressor, V4Indexer, weight_holder, weight_param
from .weights import load_v4_weights

__all__ = ["V4Attention"]

#: the runs key every V4 layer plans under: one absorbed run of the whole step
_RUNS_KEY = ("V4Attention", "absorbed")


def _choose_backend(backend: Any, dims: V4Dims, dtype: torch.dtype, device: torch.device) -> type[MLABackend]:
    if backend is not None:
        return get_backend(backend)
    from selector import select_backend  # the registry is loaded on first use

    dev = "cpu" if device.type != "cuda" else f"cuda:{cuda_device_index(device)}"
    return select_backend(dims, dtype=dtype, device=dev).backend


class V4Attention(torch.nn.Module):
    """DeepSeek-V4 attention of one layer (this rank's heads; module docstring).

    Parameters carry transformers' ``DeepseekV4Attention`` names (``q_a_proj.weight``, ``sinks``,
    ``compressor.indexer.q_b_proj.weight`` ...) with this rank's shapes; ``sinks`` and the compressors'
    ``position_bias`` are kept in float32 (float64 for float64 layers).

    Attributes:
        dims: per-rank :class:`V4Dims`. kind / ratio: this layer's kind and compress ratio (0: window only).
        backend: the ``forward_mqa`` provider (an instance); it must declare sinks, window and (CSA/HCA)
            compressed keys. planner: the step planner every layer of the model shares (one state a step).
        last_topk_indices: CSA: the entries each token attended in the last step ``[T, K]`` (caller order).
    """

    def __init__(self, dims: V4Dims, *, layer_idx: int, backend: Any = None, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, tp_rank: int = 0, max_model_len: int | None = None,
                 weight_block_size: tuple[int, int] = DEFAULT_WEIGHT_BLOCK_SIZE) -> None:
        super().__init__()
        if not isinstance(dims, V4Dims):
            raise TypeError(f"dims: got {type(dims).__name__}; supported V4Dims (V4Dims.from_hf_config)")
        require_int("tp_rank", tp_rank, minimum=0)
        if tp_rank >= dims.tp_size:
            raise ValueError(f"tp_rank: got {tp_rank}; supported 0..{dims.tp_size - 1} (tp_size {dims.tp_size})")
        self.dims, self.tp_rank = dims, tp_rank
        self.layer_idx = require_int("layer_idx", layer_idx, minimum=0)
        self.kind, self.ratio = dims.kind(layer_idx), dims.ratio(layer_idx)
        self.dtype = parse_model_dtype(dtype, default=torch.bfloat16)
        self.device = require_device("device", device) if device is not None else torch.device("cpu")
        if max_model_len is not None:
            require_int("max_model_len", max_model_len, minimum=1)
        self.max_model_len = max_model_len if max_model_len is not None else dims.max_position_embeddings
        self.weight_block_size = check_weight_block_size(weight_block_size)
        self.scale = dims.softmax_scale
        self.rotary = V4Rotary.for_kind(dims, self.kind)
        self.planner = V4Planner(dims.sliding_window, {k: dims.ratio_of(k) for k in (CSA, HCA)
                                                       if k in dims.layer_types})
        self.last_topk_indices: torch.Tensor | None = None
        self._loaded = False

        backend_cls = _choose_backend(backend, dims, self.dtype, self.device)
        reasons = without_kinds(reasons_of(backend_cls, self._spec()), ReasonKind.PACKAGE)
        if reasons:
            raise ValueError(f"backend: got {backend_cls.name}, which cannot run this DeepSeek-V4 layer: "
                             + "; ".join(map(str, reasons)))
        self.backend_cls = backend_cls
        #: the configured backend (configure_backend: one per configuration, shared by the layers alike);
        #: allocate_cache completes it with the cache's page size and dtype, never after a plan
        self.backend: MLABackend = configure_backend(backend_cls, self._spec(), self.scale)
        self._planned = False
        self._add_weights()

    def _add_weights(self) -> None:
        d, kw = self.dims, {"dtype": self.dtype, "device": self.device}
        H, D, hid, ql, g, og = d.num_heads, d.head_dim, d.hidden_size, d.q_lora_rank, d.local_o_groups, d.o_lora_rank
        self.q_a_proj = weight_holder(ql, hid, **kw)
        self.q_a_norm = torch.nn.Module()
        self.q_a_norm.weight = weight_param(ql, **kw)
        self.q_b_proj = weight_holder(H * D, ql, **kw)
        self.kv_proj = weight_holder(D, hid, **kw)
        self.kv_norm = torch.nn.Module()
        self.kv_norm.weight = weight_param(D, **kw)
        self.o_a_proj = weight_holder(g * og, H * D // g, **kw)
        self.o_b_proj = weight_holder(hid, g * og, **kw)
        self.sinks = weight_param(H, dtype=accumulate_dtype(self.dtype), device=self.device)
        self.compressor: V4Compressor | None = None
        if self.kind != SLIDING:
            rot = V4Rotary.compress(d)
            self.compressor = V4Compressor(hid, D, self.ratio, self.kind == CSA, eps=d.rms_norm_eps, rotary=rot, **kw)
            if self.kind == CSA:
                self.compressor.indexer = V4Indexer(hid, ql, d.index_n_heads, d.index_head_dim, self.ratio,
                                                    d.index_topk, eps=d.rms_norm_eps, rotary=rot, **kw)

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any, *, layer_idx: int, backend: Any = None, dtype: str | torch.dtype | None = None,
                       device: str | torch.device | None = None, tp_rank: int = 0, tp_size: int = 1,
                       max_model_len: int | None = None) -> V4Attention:
        """Layer ``layer_idx`` for a transformers ``DeepseekV4Config``, a dict, a ``config.json`` path or
        :class:`V4Dims` (``V4Dims.from_hf_config`` refuses what it cannot run, naming the field)."""
        if isinstance(config, (str, os.PathLike)):
            from ...core.config_fields import read_config_json

            config = read_config_json(config)
        dims = V4Dims.from_hf_config(config).tensor_parallel(tp_size)
        block = DEFAULT_WEIGHT_BLOCK_SIZE if isinstance(config, V4Dims) else weight_block_size_from_config(config)
        return cls(dims, layer_idx=layer_idx, backend=backend, dtype=dtype, device=device, tp_rank=tp_rank,
                   max_model_len=max_model_len, weight_block_size=block)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, layer_idx: int, *, dtype: str | torch.dtype | None = None,
                        tp_rank: int = 0, tp_size: int = 1, **options: Any) -> V4Attention:
        """Layer ``layer_idx`` of checkpoint folder ``path`` (arguments checked before any read)."""
        from ...loading import checkpoint

        return checkpoint.load_layer(cls, path, layer_idx, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, **options)

    def _spec(self, kv_cache_dtype: str = "auto", block_size: int | None = None) -> AttentionSpec:
        """What this layer asks of its backend: whole rows of ``head_dim`` (no separate rope slice), any query
        lengths, sinks and a window; compressed keys on CSA/HCA layers."""
        return AttentionSpec(num_heads=self.dims.num_heads, kv_lora_rank=self.dims.head_dim, qk_rope_head_dim=0,
                             dtype=self.dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                             max_query_len=2, uniform_query_len=False, device=device_info_for(self.device),
                             sinks=True, window=True, compressed=self.kind != SLIDING)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], *, prefix: str = "",
                           sharded: bool = False) -> None:
        """Load transformers-named weights (all or nothing; fp8 pairs dequantised; full tensors sliced to this
        rank, or ``sharded=True``: already this rank's); see :func:`~mla_backends.layer.v4.weights.load_v4_weights`."""
        load_v4_weights(self, state_dict, prefix=prefix, sharded=sharded)
        self._loaded = True

    # ---- cache and planning ------------------------------------------------------------------------------
    @property
    def preferred_block_size(self) -> int:
        """The page size (tokens) the selection gives this layer's backend when none is asked for (its
        ``capabilities.preferred_page_size``); it must divide or be divided by each compress ratio."""
        return self.backend_cls.capabilities.preferred_page_size

    @property
    def weight_device(self) -> torch.device:
        return self.q_b_proj.weight.device

    @property
    def decode_threshold(self) -> int:
        """Every request runs the one absorbed path, so metadata needs no reordering beyond single tokens."""
        return 1

    def allocate_cache(self, num_blocks: int, block_size: int | None = None, kv_cache_dtype: str | torch.dtype = "auto",
                       *, row_format: RowFormat | None = None, indexer_storage: str | torch.dtype = "auto",
                       indexer_scale_fmt: str | None = "ue8m0",
                       pool_pages: Mapping[str, tuple[int, int]] | None = None) -> V4LayerCache:
        """This layer's zeroed :class:`V4LayerCache` (model dtype, device) after checking that the backend takes
        ``block_size`` (None: :attr:`preferred_block_size`) and ``kv_cache_dtype``, and that ``block_size``
        divides or is divided by every compress ratio of the model. ``indexer_storage``: ``"auto"`` keeps the
        CSA indexer keys in the model dtype (exact); ``"fp8_e4m3"`` is vLLM's 132-byte layout (with
        ``indexer_scale_fmt="ue8m0"``, power-of-two scales). ``kv_cache_dtype="fp8_ds_mla"``: the window and
        compressed rows as DeepSeek's 584-byte fp8 records. ``pool_pages``: ``{store: (pages, rows a page)}`` for
        stores with their own block tables (:meth:`V4LayerCache.allocate`; plan such steps with
        :func:`~mla_backends.step.v4.plan_v4_step`)."""
        require_int("num_blocks", num_blocks, minimum=1)
        block_size = self.preferred_block_size if block_size is None else block_size
        require_int("block_size", block_size, minimum=1)
        kv = kv_cache_dtype if isinstance(kv_cache_dtype, str) else dtype_name(kv_cache_dtype)
        if row_format is None:
            row_format = RowFormat(kv) if kv != "auto" else PLAIN_ROWS
        reasons = without_kinds(reasons_of(self.backend_cls, self._spec(kv, block_size)), ReasonKind.PACKAGE)
        if reasons:
            raise ValueError(f"allocate_cache: backend {self.backend_cls.name} cannot use this cache: "
                             + "; ".join(map(str, reasons)))
        if not pool_pages:
            for r in self.planner.ratios.values():
                check_page_ratio(block_size, r)
        if indexer_storage == "auto":
            indexer_storage = dtype_name(self.dtype)
        cache = V4LayerCache.allocate(self.dims, self.layer_idx, num_blocks, block_size, model_dtype=self.dtype,
                                      device=self.device, row_format=row_format, indexer_storage=indexer_storage,
                                      indexer_scale_fmt=indexer_scale_fmt, pool_pages=pool_pages)
        spec = self._spec(cache.kv_cache_dtype, block_size)
        planned = self.__dict__["_planned"]  # read first: threads allocating for one model race (see MLAAttention)
        current = self.backend
        target = current if spec == current.layer_spec else configure_backend(current, spec, self.scale)
        if target is not self.backend:  # the configuration completed: page size and cache dtype
            if planned:
                raise ValueError(
                    f"allocate_cache: got page size {block_size} and cache dtype {spec.kv_cache_dtype} for layer "
                    f"{self.layer_idx}, whose backend is configured for page size "
                    f"{self.backend.layer_spec.block_size} and cache dtype {self.backend.layer_spec.kv_cache_dtype} "
                    "and has taken part in a step plan; supported the configuration it planned with (a layer is "
                    "configured once: build another layer for another cache)")
            self.backend = target
        return cache

    def runs(self, meta: BatchMetadata) -> tuple[Run, ...]:
        """One absorbed run of every request (V4 has no expanded path)."""
        return (Run(True, 0, meta.num_requests),)

    def runs_key(self) -> Hashable:
        return _RUNS_KEY

    def plan_key(self) -> Hashable:
        """Layers with equal keys make equal requests (the same backend preparation and planner). Asked first by
        :func:`plan_step`: the layer's configuration is fixed from then on."""
        self.__dict__["_planned"] = True
        return ("V4Attention", self.backend.prepare_key(), self.planner.prepare_key())

    def plan_request(self, meta: BatchMetadata) -> PlanRequest:
        """What this layer runs in the step: the whole step absorbed on its backend, and the V4 planner's
        tables (``preparers``)."""
        self.__dict__["_planned"] = True
        return PlanRequest(runs_key=_RUNS_KEY, runs=self.runs(meta), backend=self.backend, preparers=(self.planner,))

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_inputs(self, hidden_states: torch.Tensor, positions: torch.Tensor | None, cache: V4LayerCache,
                      plan: StepPlan) -> V4StepState:
        if not self._loaded:
            raise RuntimeError("V4Attention: weights not loaded; call load_hf_state_dict(state_dict) first")
        meta = plan.meta
        if not isinstance(cache, V4LayerCache):
            raise TypeError(f"cache: got {type(cache).__name__}; supported V4LayerCache (layer.allocate_cache)")
        if (cache.kind, cache.ratio) != (self.kind, self.ratio) or cache.window.kv_lora_rank != self.dims.head_dim:
            raise ValueError(f"cache: got a {cache.kind} cache (ratio {cache.ratio}); supported this layer's "
                             f"{self.kind} (ratio {self.ratio}, rows of {self.dims.head_dim})")
        T = meta.num_tokens
        require_tensor("hidden_states", hidden_states, shape=(T, self.dims.hidden_size), dtypes=(self.dtype,))
        if positions is not None:
            require_tensor("positions", positions, shape=(T,), dtypes=(torch.int32, torch.int64))
        for name, dev in (("hidden_states", hidden_states.device), ("cache", cache.device), ("meta", meta.device)):
            if dev != self.weight_device:
                raise ValueError(f"{name}: got device {dev}; supported the layer's device {self.weight_device}")
        if meta.dcp_size != 1:
            raise ValueError(f"meta.dcp_size: got {meta.dcp_size}; supported 1 (DeepSeek-V4 layers run without "
                             "decode context parallelism)")
        plan.runs_for(_RUNS_KEY, f"V4 layer {self.layer_idx}")
        state = plan.state(self.planner, meta)
        plan.state(self.backend, meta)
        plan.check_cache(cache.window)  # the step's pages against this cache, before anything is written
        if self.compressor is not None:  # every pool's pages and page size against its store, before any write
            entries = state.for_kind(self.kind)  # type: ignore[union-attr]
            entries.main.state.slots_for(cache.state)
            entries.main.out.slots_for(cache.compressed)
            if entries.indexer is not None:
                entries.indexer.state.slots_for(cache.indexer_state)
                entries.indexer.out.slots_for(cache.indexer_keys)
        return state  # type: ignore[return-value]

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor | None, cache: V4LayerCache,
                plan: StepPlan) -> torch.Tensor:
        """One step of this layer: ``hidden_states [T, hidden_size]`` (caller order), ``positions [T]`` (None:
        ``context_len + j``), this layer's ``cache`` and the step's ``plan`` -> ``[T, hidden_size]`` in the
        caller's order (with ``tp_size > 1`` the rank's partial sum)."""
        plan = require_plan(plan, "V4Attention.forward")
        state = self._check_inputs(hidden_states, positions, cache, plan)
        meta, d = plan.meta, self.dims
        H, D = d.num_heads, d.head_dim
        x = meta.to_processing_order(hidden_states)
        pos = meta.token_positions if positions is None else meta.to_processing_order(positions).long()
        T = x.shape[0]
        q_resid = rms_norm(linear(x, self.q_a_proj.weight), self.q_a_norm.weight, d.rms_norm_eps)
        q = linear(q_resid, self.q_b_proj.weight).view(T, H, D)
        qf = q.to(accumulate_dtype(q.dtype))
        q = (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + d.rms_norm_eps)).to(q.dtype)  # per head
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        q = self.rotary.apply(q, cos, sin)
        kv = self.rotary.apply(rms_norm(linear(x, self.kv_proj.weight), self.kv_norm.weight, d.rms_norm_eps), cos, sin)
        cache.window.write(kv, kv[:, :0], plan)
        compressed = None
        if self.compressor is not None:
            entries = state.for_kind(self.kind)
            self.compressor(x, pos, cache.state, entries.main, entries, cache.compressed)
            if self.kind == CSA:
                picks = self.compressor.indexer.select(x, q_resid, pos, meta, cache.indexer_keys, cache.indexer_state,
                                                       entries)
                self.last_topk_indices = meta.to_caller_order(picks)
            else:
                picks = entries.seen
            compressed = CompressedKeys(cache.compressed, entries.table, picks, trusted=True)
        o, _ = self.backend.forward_mqa(q, q[..., :0], cache.window, meta, scale=self.scale, plan=plan,
                                        sinks=self.sinks, window=d.sliding_window, compressed=compressed)
        o = self.rotary.apply(o, cos, sin, inverse=True)
        g = d.local_o_groups
        w = self.o_a_proj.weight.view(g, d.o_lora_rank, -1)  # [g, o_lora, H / g * D]
        grouped = torch.bmm(o.reshape(T, g, -1).transpose(0, 1), w.transpose(1, 2))  # [g, T, o_lora]
        y = linear(grouped.transpose(0, 1).reshape(T, -1), self.o_b_proj.weight)
        return meta.to_caller_order(y)

    def extra_repr(self) -> str:
        d = self.dims
        return (f"layer={self.layer_idx} ({self.kind}, ratio {self.ratio}), heads={d.num_heads} "
                f"(tp {self.tp_rank}/{d.tp_size}), head_dim={d.head_dim}, rope={d.rope_head_dim}, "
                f"window={d.sliding_window}, dtype={dtype_name(self.dtype)}, backend={self.backend_cls.name}")
