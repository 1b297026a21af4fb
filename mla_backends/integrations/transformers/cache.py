"""The latent caches of one patched call: :class:`MLAGenerationCache` (a transformers ``Cache``) and its page pool.

One cache belongs to one ``generate`` call (or one plain forward): it is made when the call starts, holds one
paged :class:`~mla_backends.step.cache.LatentKVCache` per layer, and is released when the call returns. Nothing in
it is shared with another call, so two calls (threads, or a model and its copy) never see each other's pages.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from ...core.validation import require_int
from ...layer.attention import MLAAttention
from ...step.metadata import BatchMetadata
from ...step.plan import StepPlan, plan_step
from .options import UnsupportedGenerationError

__all__ = ["MLAGenerationCache", "DEFAULT_BLOCK_SIZE", "MAX_RESERVE_TOKENS"]

#: page size of the managed latent caches when ``patch_model(block_size=None)``
DEFAULT_BLOCK_SIZE = 64
#: most tokens per request a call's pool is sized for up front (longer calls grow it by doubling), so that a
#: large ``max_new_tokens`` that ends early at an EOS does not hold memory it never uses
MAX_RESERVE_TOKENS = 32768


class MLAGenerationCache(Cache):
    """The latent caches of one patched ``generate`` call (or one plain forward), one per layer.

    transformers sees the padded sequence length (:meth:`get_seq_length`); per request it keeps the count of
    real tokens cached, a page list, and the :class:`~mla_backends.step.plan.StepPlan` of the step in flight.
    Pages are handed out in order from one pool per layer. ``reserve_tokens`` (tokens per request the call can
    reach, None: unknown) sizes the pool at the first step to ``requests x ceil(reserve_tokens / block_size)`` pages (at
    most the layers' ``max_model_len`` and :data:`MAX_RESERVE_TOKENS` tokens a request), so the pool is
    allocated once; past that (or without a bound) it doubles, copying its rows.
    """

    is_compileable = False

    def __init__(self, layers: dict[int, MLAAttention], *, block_size: int, kv_cache_dtype: str,
                 reserve_tokens: int | None = None) -> None:
        super().__init__(layers=[])
        self.mla_layers = layers
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.reserve_tokens = None if reserve_tokens is None else require_int("reserve_tokens", reserve_tokens,
                                                                               minimum=1)
        self.caches: dict[int, Any] = {}  # layer index -> LatentKVCache (V4LayerCache for DeepSeek-V4)
        self.num_blocks = 0
        self.pages: list[list[int]] = []
        self.context: list[int] = []
        self.seen = 0  # padded tokens processed (what transformers counts)
        #: (the step's plan, real-token indices or None when every token of the step is real)
        self.step: tuple[StepPlan, torch.Tensor | None] | None = None
        self.released = False
        self.allocations = 0  # pools allocated (one per layer each time the pool is sized)
        #: prompt tokens per request of the generate call using the cache (set by it; None: not known)
        self.prompt_tokens: int | None = None
        self._q: list[int] = []

    # ---- what transformers asks ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        q = query_length.shape[-1] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + q, 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * max(1, len(self.mla_layers))

    def _unsupported(self, what: str) -> None:
        raise UnsupportedGenerationError(f"{what}: not supported by mla-backends' patched models "
                                         "(their latent cache cannot be reordered, cropped or copied)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, max_length: int) -> None:
        self._unsupported("cropping the cache (assisted or contrastive decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("selecting requests of a filled cache")

    # ---- steps ---------------------------------------------------------------------------------------------
    def check_usable(self, batch: int) -> None:
        """Raise unless a step of ``batch`` requests can run on this cache (host only, nothing changed)."""
        if self.released:
            raise RuntimeError("MLAGenerationCache: used after its generate call returned; start a new call")
        if self.pages and batch != len(self.pages):
            raise ValueError(f"input_ids: got a batch of {batch}; supported the cache's {len(self.pages)} requests")

    def begin_step(self, new_mask: torch.Tensor) -> None:
        """Start a step whose new tokens are ``new_mask [B, S]`` (True: a real token, False: padding)."""
        B = new_mask.shape[0]
        self.check_usable(B)
        first_step = not self.pages
        if first_step:
            self.pages = [[] for _ in range(B)]
            self.context = [0] * B
        q = [int(v) for v in new_mask.sum(1).tolist()]
        bs = self.block_size
        for b in range(B):
            need = -(-(self.context[b] + q[b]) // bs) - len(self.pages[b])
            for _ in range(need):
                self.pages[b].append(self._next_page())
        width = max(1, max(len(p) for p in self.pages))
        table = [p + [-1] * (width - len(p)) for p in self.pages]
        first = next(iter(self.mla_layers.values()))
        reserve = 0
        if first_step and self.reserve_tokens is not None:
            tokens = min(self.reserve_tokens, first.max_model_len, MAX_RESERVE_TOKENS)
            reserve = B * -(-tokens // bs)
        self._grow(reserve)
        meta = BatchMetadata.build(q, self.context, table, bs, decode_threshold=first.decode_threshold,
                                   num_blocks=self.num_blocks, device=first.weight_device)
        real = None  # every token real (all decode steps, unpadded prefills): no gather / scatter needed
        if sum(q) != new_mask.numel():
            real = new_mask.reshape(-1).nonzero().squeeze(1).to(first.weight_device)
        self.step = (plan_step(meta, self.mla_layers.values()), real)  # the step's plan, before the first layer
        self._q = q

    def end_step(self, seq_len: int, *, done: bool = True) -> None:
        """The step is over: with ``done`` its rows are in and counted (``seq_len``: padded tokens of the
        step); without (the forward raised) nothing is counted, and the next step rewrites the same slots."""
        if self.step is not None and done:
            self.context = [c + q for c, q in zip(self.context, self._q, strict=True)]
            self.seen += seq_len
        self.step = None

    def _next_page(self) -> int:
        used = sum(len(p) for p in self.pages)
        return used

    def _grow(self, reserve: int = 0) -> None:
        """Make the pool hold every page handed out and at least ``reserve`` pages (doubling when a pool
        exists, rows copied) and allocate missing layers."""
        used = sum(len(p) for p in self.pages)
        if max(used, reserve) > self.num_blocks:
            new = max(used, reserve, 2 * self.num_blocks, 1)
            for idx, old in list(self.caches.items()):
                fresh = self.mla_layers[idx].allocate_cache(new, self.block_size, self.kv_cache_dtype)
                if hasattr(fresh, "copy_from"):  # DeepSeek-V4: every store of the layer
                    fresh.copy_from(old)
                else:
                    fresh.data[: old.num_blocks].copy_(old.data)
                self.caches[idx] = fresh
                self.allocations += 1
            self.num_blocks = new
        for idx, layer in self.mla_layers.items():
            if idx not in self.caches:
                self.caches[idx] = layer.allocate_cache(max(self.num_blocks, 1), self.block_size,
                                                        self.kv_cache_dtype)
                self.allocations += 1
        self.num_blocks = max(self.num_blocks, 1)

    def release(self) -> None:
        """Drop every page (the generate call is over)."""
        self.caches.clear()
        self.pages, self.context, self.step, self.num_blocks = [], [], None, 0
        self.released = True

    def __repr__(self) -> str:
        return (f"MLAGenerationCache(layers={len(self.mla_layers)}, requests={len(self.pages)}, "
                f"seen={self.seen}, pages={self.num_blocks} x {self.block_size})")
