"""The SGLang attention backend that runs absorbed MLA on mla-backends (imports SGLang).

:class:`MLABackendsAttnBackend` is an SGLang ``AttentionBackend``. At start-up (its constructor, once per rank) it
calls ``select_backend()`` with the rank's dims (heads / tensor-parallel size), dtype, cache dtype and page size
and fails with the selection's reasons when nothing fits. Its per-batch hook (``init_forward_metadata``) builds
the batch's one :class:`~mla_backends.step.metadata.BatchMetadata` and :class:`~mla_backends.step.plan.StepPlan`
for every layer, and makes the MHA-or-absorbed decision the DeepSeek handler returns. Every absorbed call (decode,
and extend batches mla-backends absorbs) writes the new latent rows with SGLang's own pool write and runs
``forward_mqa`` of the selected class on SGLang's pool buffer wrapped without a copy. Extend batches the handler
sends to SGLang's one-shot MHA arrive with expanded ``q``/``k``/``v``; the backend attends over them with
PyTorch's SDPA (causal, offset by each request's cached prefix).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ...backends.contract import configure_backend
from ...core.validation import require_device
from ...step.metadata import BatchMetadata
from ...step.plan import StepPlan, plan_step
from .selection import SGLangSelectionError, request_from_runner, startup_line
from .step import (
    batch_absorbed,
    decode_metadata,
    expanded_attention,
    extend_metadata,
    sglang_policy,
    wrap_pool_buffer,
)

__all__ = ["MLABackendsAttnBackend", "SGLangBatch"]

logger = logging.getLogger("sglang.mla_backends")
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class SGLangBatch:
    """What the metadata hook worked out for one forward batch, read by every layer.

    ``absorbed``: the handler's answer (decode batches: True). ``meta``/``plan``: the batch's metadata and plan
    (absorbed batches only). ``q_starts``/``k_starts``/``prefix``: host offsets of each request's query rows,
    key rows (SGLang's one-shot MHA passes every cached and new token) and cached prefix (expanded batches).
    """

    forward_batch_id: int
    absorbed: bool
    meta: BatchMetadata | None = None
    plan: StepPlan | None = None
    q_starts: tuple[int, ...] = ()
    k_starts: tuple[int, ...] = ()
    k_starts_new_only: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()


def _device_name(device: Any) -> str:
    dev = require_device("model_runner.device", device)
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return dev.type


def _starts(lens: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return tuple(out)


class MLABackendsAttnBackend(AttentionBackend):
    """SGLang's ``--attention-backend mla_backends`` (see the module docstring)."""

    needs_cpu_seq_lens = True  # the host lengths of every batch come from SGLang's seq_lens_cpu

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        cfg = model_runner.model_config
        hf = getattr(cfg, "hf_text_config", None) or cfg.hf_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        kv_name = str(getattr(model_runner.server_args, "kv_cache_dtype", "auto"))
        request = request_from_runner(hf, tp_size=tp, dtype=model_runner.dtype, kv_cache_dtype=kv_name,
                                      page_size=self.page_size, device=_device_name(self.device))
        sel = request.select()  # SGLangSelectionError with the reasons: start-up fails
        self.mla_request = request
        self.mla_selection = sel
        self.mla_scale = request.dims.softmax_scale
        self.mla_backend = configure_backend(sel.backend, sel.spec, self.mla_scale)
        self.mla_policy = sglang_policy(sel.name)
        self.kv_lora_rank = request.dims.kv_lora_rank
        self.num_heads = request.dims.num_heads
        self._caches: dict[int, Any] = {}
        self.forward_metadata: SGLangBatch | None = None
        model = str(getattr(model_runner.server_args, "model_path", "?"))
        line = startup_line(sel, model=model, num_heads=self.num_heads)
        if line not in _LOGGED:
            _LOGGED.add(line)
            logger.info(line)

    # ---- per batch -------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Once per forward batch, before any layer: the decision, the metadata and the plan (host data from
        SGLang's host lists; see :mod:`.step` for where a device read remains)."""
        mode = forward_batch.forward_mode
        fid = id(forward_batch)
        if mode.is_idle():
            self.forward_metadata = SGLangBatch(fid, True)
            return
        req_to_token = self.req_to_token_pool.req_to_token
        if mode.is_decode():
            lens = [int(v) for v in forward_batch.seq_lens_cpu.tolist()]
            meta = decode_metadata(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, lens,
                                   self.page_size)
            self.forward_metadata = SGLangBatch(fid, True, meta, plan_step(meta, [self.mla_backend]))
            return
        if not mode.is_extend_without_speculative():
            raise RuntimeError(f"mla-backends: forward mode {mode!r}; supported decode, extend (mixed included) and "
                               "idle batches (no speculative decoding yet)")
        prefix = [int(v) for v in forward_batch.extend_prefix_lens_cpu]
        ext = [int(v) for v in forward_batch.extend_seq_lens_cpu]
        absorbed = batch_absorbed(self.mla_policy, self.mla_backend.capabilities, ext, prefix)
        if absorbed:
            num_pages = self.token_to_kv_pool.get_key_buffer(0).shape[0] // self.page_size
            meta = extend_metadata(req_to_token, forward_batch.req_pool_indices, prefix, ext, self.page_size,
                                   num_pages)
            self.forward_metadata = SGLangBatch(fid, True, meta, plan_step(meta, [self.mla_backend]))
            return
        seqs = [p + e for p, e in zip(prefix, ext, strict=True)]
        if any(prefix):  # SGLang's one-shot MHA gathers the prefix rows by these slots (its own kernel is Triton)
            rows = req_to_token.index_select(0, forward_batch.req_pool_indices.to(torch.long))
            forward_batch.mha_one_shot_kv_indices = torch.cat(
                [rows[b, :s] for b, s in enumerate(seqs)]).to(torch.int32)
        self.forward_metadata = SGLangBatch(fid, False, q_starts=_starts(ext), k_starts=_starts(seqs),
                                            k_starts_new_only=_starts(ext), prefix=tuple(prefix))

    def batch_absorbed(self, forward_batch: Any) -> bool:
        """The decision :meth:`init_forward_metadata` made for ``forward_batch`` (the handler's answer)."""
        fm = self.forward_metadata
        if fm is None or fm.forward_batch_id != id(forward_batch):
            raise RuntimeError("mla-backends: the DeepSeek handler ran before init_forward_metadata for this "
                               "batch; supported SGLang's order (metadata first)")
        return fm.absorbed

    # ---- absorbed ---------------------------------------------------------------------------------------------
    def _absorbed(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                  forward_batch: Any, save_kv_cache: bool, q_rope: torch.Tensor | None,
                  k_rope: torch.Tensor | None) -> torch.Tensor:
        fm = self.forward_metadata
        if fm is None or fm.meta is None or fm.plan is None:
            raise RuntimeError("mla-backends: an absorbed call without the batch's metadata; supported batches "
                               "init_forward_metadata prepared (absorbed)")
        r = self.kv_lora_rank
        if save_kv_cache and k is not None:
            row = k if k_rope is None else torch.cat([k.reshape(k.shape[0], 1, -1),
                                                      k_rope.reshape(k_rope.shape[0], 1, -1)], dim=-1)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch),
                                                row.reshape(row.shape[0], 1, -1), v)
        heads = layer.tp_q_head_num
        if q_rope is None:
            q3 = q.reshape(q.shape[0], heads, -1)
            q_latent, q_pe = q3[..., :r], q3[..., r:]
        else:
            q_latent, q_pe = q.reshape(q.shape[0], heads, r), q_rope.reshape(q_rope.shape[0], heads, -1)
        if not math.isclose(float(layer.scaling), self.mla_scale, rel_tol=1e-5):
            raise SGLangSelectionError(f"mla-backends: SGLang's softmax scale {layer.scaling} differs from the model "
                                       f"config's {self.mla_scale} (MLADims.softmax_scale); supported equal scales")
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        cache = wrap_pool_buffer(buf, self.page_size, kv_lora_rank=r, model_dtype=q_latent.dtype,
                                 previous=self._caches.get(layer.layer_id))
        self._caches[layer.layer_id] = cache
        out, _ = self.mla_backend.forward_mqa(q_latent, q_pe, cache, fm.meta, scale=self.mla_scale, plan=fm.plan)
        return out.reshape(out.shape[0], heads * r)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, q_rope: torch.Tensor | None = None,
                       k_rope: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """SGLang's decode call on the MLA layer's ``attn_mqa``: ``q [B, H, 576]``, ``k [B, 1, 576]`` (the new
        latent rows, written here with SGLang's pool write), ``v`` its first 512; returns ``[B, H * 512]``."""
        if kwargs.get("topk_indices") is not None:
            raise RuntimeError("mla-backends: topk_indices given; supported dense MLA on SGLang (no DSA yet)")
        return self._absorbed(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    # ---- extend -----------------------------------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, q_rope: torch.Tensor | None = None,
                       k_rope: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """An extend batch: absorbed (``attn_mqa``, as :meth:`forward_decode`) when the handler chose MLA, else
        SGLang's one-shot MHA (``attn_mha``: ``q [T, H, 192]``, ``k``/``v`` expanded for every cached and new
        token, nothing to write), computed with SDPA."""
        if kwargs.get("topk_indices") is not None:
            raise RuntimeError("mla-backends: topk_indices given; supported dense MLA on SGLang (no DSA yet)")
        fm = self.forward_metadata
        if fm is not None and fm.absorbed:
            return self._absorbed(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)
        if fm is None:
            raise RuntimeError("mla-backends: forward_extend before init_forward_metadata; supported SGLang's order")
        return self._expanded(q, k, v, layer, fm)

    def _expanded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, fm: SGLangBatch
                  ) -> torch.Tensor:
        heads, dq, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        k3 = k.reshape(k.shape[0], -1, dq)
        # one-shot MHA passes every token of the sequences when a prefix is cached, only the new ones otherwise
        if k3.shape[0] == fm.k_starts[-1]:
            k_starts, prefix = fm.k_starts, fm.prefix
        elif k3.shape[0] == fm.k_starts_new_only[-1] and not any(fm.prefix):
            k_starts, prefix = fm.k_starts_new_only, fm.prefix
        else:
            raise RuntimeError(f"mla-backends: MHA keys of {k3.shape[0]} tokens; supported {fm.k_starts[-1]} (every "
                               "cached and new token, SGLang's one-shot MHA)")
        out = expanded_attention(q.reshape(-1, heads, dq), k3, v.reshape(v.shape[0], -1, dv), fm.q_starts,
                                 k_starts, prefix, scale=float(layer.scaling))
        return out.reshape(out.shape[0], heads * dv)

    # ---- what SGLang asks of every backend ----------------------------------------------------------------------
    def support_triton(self) -> bool:
        return False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError("mla-backends: CUDA graphs are not supported by the SGLang integration yet; "
                                  "run SGLang with --disable-cuda-graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
