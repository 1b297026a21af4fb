"""The SGLang attention backend that runs MLA on mla-backends (imports SGLang).

:class:`MLABackendsAttnBackend` is an SGLang ``AttentionBackend``. At start-up (its constructor, once per rank) it
checks the SGLang internals it touches (:mod:`.internals`), walks the model for its MLA attention modules, calls
``select_backend()`` with the rank's heads, dtype, cache dtype and page size, takes the configured backend
(:func:`~..engine_core.configured_backend`), and fixes everything per layer: the layer's fp8 scale, its cache
wrapper and its up-projection matrix; it fails with the reasons when anything does not fit. Its per-batch hook
(``init_forward_metadata``) builds the batch's one :class:`~mla_backends.step.metadata.BatchMetadata` and, for
absorbed batches, its :class:`~mla_backends.step.plan.StepPlan`, and makes the MHA-or-absorbed decision the
DeepSeek handler returns.

Absorbed calls (decode, and the extend batches mla-backends absorbs) write the new latent rows through the
batch's metadata with ``LatentKVCache.write`` (the layer's fp8 scale) and run ``forward_mqa`` of the selected
class on SGLang's pool buffer wrapped without a copy. Expanded batches go through SGLang's MHA prepare, whose
``prepare_prefill_qkv`` hook is this backend's: it ropes ``q`` and the new key as SGLang does, writes the new rows
the same way and hands ``q`` on; the layer's ``attn_mha`` call then runs the library's ``forward_mha`` (new tokens
causal, the cached prefix read from the pool in chunks through the shared prefill workspace).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ...layer.prefill import forward_mha
from ...layer.workspace import PrefillWorkspace, default_workspace_rows, shared_workspace
from ...step.cache import LatentKVCache
from ...step.metadata import BatchMetadata
from ...step.plan import RunBatch, StepPlan, plan_step
from .. import engine_core as core
from .internals import INTERNALS
from .selection import ENGINE, SGLangSelectionError, request_from_runner, startup_line
from .step import (
    decode_metadata,
    dense_up_projection,
    extend_metadata,
    pool_pages,
    sglang_policy,
)

__all__ = ["MLABackendsAttnBackend", "SGLangBatch", "MLALayer", "mla_modules"]

logger = logging.getLogger("sglang.mla_backends")


@dataclass(frozen=True)
class SGLangBatch:
    """What the metadata hook worked out for one forward batch, read by every layer.

    ``batch``: a weak reference to the SGLang ``ForwardBatch`` it was made for (the handler and the layers check
    that they are handed that very batch). ``absorbed``: the handler's answer (decode batches: True). ``meta``:
    the batch's metadata (None for idle batches); ``plan``: its plan (absorbed batches) and ``runs``, the
    plan's absorbed runs with their planned sub-batches (one for the whole batch, unless the backend takes one
    query length a call); ``workspace``: the shared prefill workspace (expanded batches).
    """

    batch: weakref.ReferenceType
    absorbed: bool
    meta: BatchMetadata | None = None
    plan: StepPlan | None = None
    runs: tuple[RunBatch, ...] = ()
    workspace: PrefillWorkspace | None = None


@dataclass(frozen=True)
class MLALayer:
    """One MLA layer as the backend runs it, fixed at start-up: its pool layer id, fp8 ``scale`` (1.0 for other
    caches), ``kv_b`` (the ``[heads * (nope + v), kv_lora_rank]`` up-projection of the expanded path),
    ``qk_nope_head_dim`` and the module itself (its ``rotary_emb``)."""

    layer_id: int
    scale: float
    kv_b: torch.Tensor
    qk_nope_head_dim: int
    module: Any


def mla_modules(model: Any) -> list[Any]:
    """The MLA attention modules of SGLang's ``model`` (every module with an ``attn_mqa``), in model order."""
    return [m for m in model.modules() if hasattr(m, "attn_mqa")]


def _layer_scale(radix: Any, fp8: bool, where: str) -> float:
    """The fp8 scale the layer's rows are written and read with (1.0 for a cache that is not fp8).

    SGLang's layer carries ``k_scale`` (the loaded tensor) and ``k_scale_float`` (its host copy) when the
    checkpoint's quantisation config gives the attention a KV-cache method; without one both are None and SGLang
    stores a plain cast, which is scale 1.0. A loaded tensor without its host copy, or a scale of more than one
    value (per token or per channel), is refused: the library reads one per-tensor scale."""
    if not fp8:
        return 1.0
    tensor, host = radix.k_scale, radix.k_scale_float
    if tensor is None and host is None:
        return 1.0
    if isinstance(tensor, torch.Tensor) and tensor.numel() != 1:
        raise SGLangSelectionError(f"mla-backends: {where} has k_scale of shape {list(tensor.shape)}; supported one "
                                   "per-tensor fp8 scale (per-token or per-channel cache scales are not read)")
    if host is None:
        raise SGLangSelectionError(f"mla-backends: {where} has k_scale {tensor!r} but k_scale_float None; supported "
                                   "a loaded scale with its host copy (SGLang's KV-cache quantisation method sets "
                                   "both)")
    return core.fp8_scale(ENGINE, host, attr="k_scale_float", where=where)


class MLABackendsAttnBackend(AttentionBackend):
    """SGLang's ``--attention-backend mla_backends`` (see the module docstring)."""

    needs_cpu_seq_lens = True  # the host lengths of every batch come from SGLang's seq_lens_cpu

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        core.check_internals(ENGINE, INTERNALS)
        core.check_internals(ENGINE, INTERNALS, role="runner", obj=model_runner, where="SGLang's model runner")
        core.check_internals(ENGINE, INTERNALS, role="pool", obj=model_runner.token_to_kv_pool,
                        where="SGLang's token-to-KV pool")
        if not model_runner.spec_algorithm.is_none():
            raise SGLangSelectionError(
                f"mla-backends: speculative_algorithm: got {model_runner.spec_algorithm.name}; supported none (SGLang "
                "0.5.23's speculative workers build their draft attention from a fixed list of SGLang's own "
                "backends and, on the CPU, call sgl_kernel's CPU kernels: docs/integrations.md, 'Speculative "
                "decoding'). Start SGLang without --speculative-algorithm")
        modules = mla_modules(model_runner.model)
        if not modules:
            raise SGLangSelectionError(f"mla-backends: {type(model_runner.model).__name__} has no MLA attention "
                                       "module (attn_mqa); supported DeepSeek-style MLA models")
        for m in modules:
            where = f"MLA layer {type(m).__name__} {m.attn_mqa.layer_id}"
            core.check_internals(ENGINE, INTERNALS, role="mla", obj=m, where=where)
            core.check_internals(ENGINE, INTERNALS, role="radix", obj=m.attn_mqa, where=f"{where} (attn_mqa)")
            core.check_internals(ENGINE, INTERNALS, role="radix", obj=m.attn_mha, where=f"{where} (attn_mha)")
        self.device = model_runner.device
        self.page_size = int(model_runner.page_size)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        cfg = model_runner.model_config
        heads = modules[0].attn_mqa.tp_q_head_num  # this rank's query heads, as the layers run them
        total = int(cfg.hf_text_config.num_attention_heads)
        if heads < 1 or total % heads:
            raise SGLangSelectionError(f"mla-backends: attn_mqa.tp_q_head_num: got {heads} of the model's {total} "
                                       "heads; supported an even split")
        kv_name = str(model_runner.kv_cache_dtype_str)
        request = request_from_runner(cfg.hf_text_config, tp_size=total // heads, dtype=model_runner.dtype,
                                      kv_cache_dtype=kv_name, page_size=self.page_size,
                                      device=core.device_name(self.device))
        sel = request.select()  # SGLangSelectionError with the reasons: start-up fails
        self.mla_request = request
        self.mla_selection = sel
        self.mla_scale = request.dims.softmax_scale
        self.mla_backend = core.configured_backend(sel, self.mla_scale)  # the one configured instance
        self.mla_policy = sglang_policy(sel.name)
        self.kv_lora_rank = request.dims.kv_lora_rank
        self.num_heads = heads
        self.mla_caches = core.LayerCaches(self.kv_lora_rank, model_runner.dtype)
        self.workspace_rows = default_workspace_rows(int(cfg.context_len), 1, self.page_size)
        fp8 = request.kv_cache_dtype in core.FP8_STORAGE
        self.num_pages = pool_pages(self.pool.get_key_buffer(modules[0].attn_mqa.layer_id), self.page_size).shape[0]
        self.mla_layers: dict[int, MLALayer] = {}
        for m in modules:
            self.mla_layers[m.attn_mqa.layer_id] = self._layer(m, fp8, model_runner.dtype)
        self._batch: SGLangBatch | None = None
        self._expanded_inputs: tuple[int, torch.Tensor, torch.Tensor] | None = None
        scales = sorted({lay.scale for lay in self.mla_layers.values()})
        extra = f" fp8 cache {request.kv_cache_dtype}, k_scale {', '.join(map(str, scales))}." if fp8 else ""
        core.log_once(logger, startup_line(sel, model=str(cfg.model_path), num_heads=heads, extra=extra))

    def _layer(self, m: Any, fp8: bool, dtype: torch.dtype) -> MLALayer:
        """Everything per layer, fixed at start-up: the scale checks, the fp8 scale, the up-projection, and the
        pool buffer wrapped once (its wrapper is re-made only if SGLang hands another buffer)."""
        mqa, mha = m.attn_mqa, m.attn_mha
        where = f"MLA layer {mqa.layer_id}"
        if mqa.tp_q_head_num != self.num_heads or m.num_local_heads != self.num_heads:
            raise SGLangSelectionError(f"mla-backends: {where} runs {mqa.tp_q_head_num} heads; supported the "
                                       f"{self.num_heads} every layer of this rank runs")
        core.check_softmax_scale(ENGINE, mqa.scaling, self.mla_scale)
        core.check_softmax_scale(ENGINE, mha.scaling, self.mla_scale)
        scale = _layer_scale(mqa, fp8, where)
        nope, v = int(m.qk_nope_head_dim), int(mha.v_head_dim)
        kv_b = dense_up_projection(m.kv_b_proj.weight, lambda x: m.kv_b_proj(x)[0], rows=self.num_heads * (nope + v),
                                   kv_lora_rank=self.kv_lora_rank, dtype=dtype)
        self.mla_caches.get(mqa.layer_id, pool_pages(self.pool.get_key_buffer(mqa.layer_id), self.page_size), scale)
        return MLALayer(mqa.layer_id, scale, kv_b, nope, m)

    # ---- per batch -------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Once per forward batch, before any layer: the decision, the metadata and the plan (host data from
        SGLang's host lists; see :mod:`.step` for where a device read remains)."""
        mode = forward_batch.forward_mode
        ref = weakref.ref(forward_batch)
        if mode.is_idle():
            self._batch = SGLangBatch(ref, True)
            return
        if mode.is_decode():
            lens = forward_batch.seq_lens_cpu.tolist()
            meta = decode_metadata(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, lens,
                                   self.page_size, slot_mapping=forward_batch.out_cache_loc)
            plan = plan_step(meta, [self.mla_backend])
            self._batch = SGLangBatch(ref, True, meta, plan, plan.runs_of(self.mla_backend))
            return
        if not mode.is_extend_without_speculative():
            raise RuntimeError(f"mla-backends: forward mode {mode!r}; supported decode, extend (mixed included) and "
                               "idle batches (no speculative decoding)")
        prefix = list(forward_batch.extend_prefix_lens_cpu)
        ext = list(forward_batch.extend_seq_lens_cpu)
        meta = extend_metadata(self.req_to_token, forward_batch.req_pool_indices, prefix, ext, self.page_size,
                               self.num_pages)
        # the plan splits the step (plan_step with the handler's dispatch policy, as a layer's runs); SGLang runs
        # one forward method per batch, so one expanded run makes the whole batch expanded
        plan = plan_step(meta, [self.mla_backend], dispatch=self.mla_policy)
        runs = plan.runs_of(self.mla_backend)
        if all(rb.run.absorbed for rb in runs):
            self._batch = SGLangBatch(ref, True, meta, plan, runs)
        else:
            ws = shared_workspace(self.req_to_token.device, self.mla_caches.model_dtype, self.workspace_rows)
            self._batch = SGLangBatch(ref, False, meta, workspace=ws)

    def _current(self, forward_batch: Any) -> SGLangBatch:
        """The state :meth:`init_forward_metadata` made for this very ``forward_batch``."""
        fm = self._batch
        if fm is None or fm.batch() is not forward_batch:
            raise RuntimeError("mla-backends: a layer ran before init_forward_metadata for its batch; supported "
                               "SGLang's order (metadata first, for the same ForwardBatch)")
        return fm

    def batch_absorbed(self, forward_batch: Any) -> bool:
        """The decision :meth:`init_forward_metadata` made for ``forward_batch`` (the handler's answer)."""
        return self._current(forward_batch).absorbed

    # ---- absorbed ---------------------------------------------------------------------------------------------
    def _cache(self, layer_id: int) -> tuple[LatentKVCache, MLALayer]:
        lay = self.mla_layers[layer_id]
        buf = self.pool.get_key_buffer(layer_id)  # SGLang's contract per layer (it waits for a layer's transfer)
        return self.mla_caches.get(layer_id, pool_pages(buf, self.page_size), lay.scale), lay

    def _absorbed(self, q: torch.Tensor, k: torch.Tensor | None, layer: Any, fm: SGLangBatch, save_kv_cache: bool,
                  q_rope: torch.Tensor | None, k_rope: torch.Tensor | None) -> torch.Tensor:
        if fm.meta is None or fm.plan is None:
            raise RuntimeError("mla-backends: an absorbed call without the batch's metadata; supported batches "
                               "init_forward_metadata prepared (absorbed)")
        r = self.kv_lora_rank
        cache, _ = self._cache(layer.layer_id)
        if save_kv_cache and k is not None:
            n = k.shape[0]
            if k_rope is None:
                rows = k.reshape(n, -1)
                cache.write(rows[:, :r], rows[:, r:], fm.plan)
            else:
                cache.write(k.reshape(n, r), k_rope.reshape(n, -1), fm.plan)
        heads = self.num_heads
        if q_rope is None:
            q3 = q.reshape(q.shape[0], heads, -1)
            q_latent, q_pe = q3[..., :r], q3[..., r:]
        else:
            q_latent, q_pe = q.reshape(q.shape[0], heads, r), q_rope.reshape(q_rope.shape[0], heads, -1)
        if len(fm.runs) == 1:  # the whole batch in one call (SGLang's order is the processing order)
            out, _ = self.mla_backend.forward_mqa(q_latent, q_pe, cache, fm.runs[0].batch, scale=self.mla_scale,
                                                  plan=fm.plan)
            return out.reshape(out.shape[0], heads * r)
        out = q_latent.new_empty(q_latent.shape)
        starts = fm.meta.query_starts_list
        for rb in fm.runs:  # one call per planned run (a uniform-length backend: one query length a call)
            t0, t1 = starts[rb.run.start], starts[rb.run.stop]
            self.mla_backend.forward_mqa(q_latent[t0:t1], q_pe[t0:t1], cache, rb.batch, scale=self.mla_scale,
                                         plan=fm.plan, out=out[t0:t1])
        return out.reshape(out.shape[0], heads * r)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, q_rope: torch.Tensor | None = None,
                       k_rope: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """SGLang's decode call on the MLA layer's ``attn_mqa``: ``q [B, H, 576]``, ``k [B, 1, 576]`` (the new
        latent rows, written here), ``v`` its first 512; returns ``[B, H * 512]``."""
        if kwargs.get("topk_indices") is not None:
            raise RuntimeError("mla-backends: topk_indices given; supported dense MLA on SGLang (no DSA yet)")
        return self._absorbed(q, k, layer, self._current(forward_batch), save_kv_cache, q_rope, k_rope)

    # ---- extend -----------------------------------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, q_rope: torch.Tensor | None = None,
                       k_rope: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """An extend batch: absorbed (``attn_mqa``, as :meth:`forward_decode`) when the handler chose MLA; else
        the expanded call on ``attn_mha`` (``q [T, H, 192]`` from :meth:`prepare_prefill_qkv`, ``k``/``v`` None):
        the library's ``forward_mha``; returns ``[T, H * v_head_dim]``."""
        if kwargs.get("topk_indices") is not None:
            raise RuntimeError("mla-backends: topk_indices given; supported dense MLA on SGLang (no DSA yet)")
        fm = self._current(forward_batch)
        if fm.absorbed:
            return self._absorbed(q, k, layer, fm, save_kv_cache, q_rope, k_rope)
        pending, self._expanded_inputs = self._expanded_inputs, None
        if pending is None or pending[0] != layer.layer_id or k is not None:
            raise RuntimeError("mla-backends: an expanded call without its prepare_prefill_qkv; supported SGLang's "
                               "MHA prepare followed by the layer's attn_mha call")
        _, kv_c, k_pe = pending
        cache, lay = self._cache(layer.layer_id)
        assert fm.meta is not None
        out = forward_mha(q, kv_c, k_pe, cache, fm.meta, lay.kv_b, scale=self.mla_scale, workspace=fm.workspace)
        return out.reshape(out.shape[0], -1)

    def prepare_prefill_qkv(self, *, q: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor, k_pe: torch.Tensor,
                            positions: torch.Tensor, layer: Any, forward_batch: Any
                            ) -> tuple[torch.Tensor, None, None]:
        """SGLang's MHA prepare hook (its ``forward_normal_prepare`` calls it on expanded batches): ropes ``q``'s
        rope part (``q_pe``, a view of ``q [T, H, nope + rope]``) and the new key ``k_pe [T, 1, rope]`` with the
        layer's ``rotary_emb`` as SGLang's own prepare does, writes the new latent rows ``kv_a [T, R]`` (already
        normalised) with the layer's scale, and returns ``(q, None, None)``: the layer's ``attn_mha`` call then
        finds the latent and the rope key here (:meth:`forward_extend`), with nothing expanded by SGLang."""
        fm = self._current(forward_batch)
        lay = self.mla_layers[layer.attn_mqa.layer_id]
        if lay.module is not layer or fm.absorbed or fm.meta is None:
            raise RuntimeError("mla-backends: prepare_prefill_qkv for a batch the handler did not send expanded; "
                               "supported SGLang's MHA prepare on expanded batches")
        if layer.rotary_emb is not None:
            q_pe, k_pe = layer.rotary_emb(positions, q_pe, k_pe)
            q[..., lay.qk_nope_head_dim:] = q_pe
        n = kv_a.shape[0]
        k_pe = k_pe.reshape(n, -1)
        cache, _ = self._cache(lay.layer_id)
        cache.write(kv_a, k_pe, fm.meta)
        self._expanded_inputs = (lay.layer_id, kv_a, k_pe)
        return q, None, None

    # ---- what SGLang asks of every backend ----------------------------------------------------------------------
    def support_triton(self) -> bool:
        return False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError("mla-backends: CUDA graphs are not supported by the SGLang integration yet; "
                                  "run SGLang with --disable-cuda-graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
