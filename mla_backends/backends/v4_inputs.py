"""DeepSeek-V4's extra ``forward_mqa`` inputs: sinks, a sliding window and a compressed key set.

A V4 query at position ``p`` attends to one softmax over

- its **window**: the rows of the main cache (the call's ``cache``, through ``meta``'s block table) at positions
  ``max(0, p - window + 1) .. p``;
- its **compressed keys**: rows of a second cache (:class:`CompressedKeys`: entries of its own request chosen per
  token, ``-1`` padded, through a block table of their own);
- a per-head **sink** logit that joins the denominator with no value.

Both key sets are whole rows (key and value at once), so ``forward_mqa`` keeps its shape: ``q_latent [T, H, W]``
against rows of width ``W = kv_lora_rank`` (512, ``qk_rope_head_dim`` 0), output ``[T, H, W]``. The LSE returned
counts the sink as a key whose value is zero: ``lse = log(sum_keys exp(s) + exp(sink))`` and the output is
``sum_keys exp(s - lse) * row``, so a token that sees no key returns 0 and a finite LSE (the sink's).

Backends declare what they run (``Capabilities.sinks`` / ``window`` / ``compressed``); ``forward_mqa`` hands the
three to the kernel as one :class:`V4Keys` (the ``v4`` keyword of ``forward_mqa_kernel``) only when one is given,
so kernels that declare none never see the keyword.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.validation import require_int, require_on_device, require_tensor
from ..step.cache import LatentKVCache
from ..step.metadata import BatchMetadata

__all__ = ["CompressedKeys", "V4Keys", "check_v4_inputs", "v4_flags"]


@dataclass(frozen=True)
class CompressedKeys:
    """The second key set of a V4 call.

    Attributes:
        cache: a :class:`LatentKVCache` of rows as wide as the main cache's, ``block_size`` entries per page.
        block_table: ``[B, pages]`` int page ids of each request's entries (processing order, as ``meta``):
            entry ``e`` of request ``b`` lives in slot ``block_table[b, e // block_size] * block_size + e % bs``.
        indices: ``[T, K]`` int entry numbers each token attends (of its own request; ``-1`` pads; a number
            listed twice counts once).
        trusted: the indices and table were made by a step plan that checked them (the V4 layer's): their values
            are not read again. Otherwise ``forward_mqa`` checks them on the device (one sync), as it checks a
            V3.2 top-k.
    """

    cache: LatentKVCache
    block_table: torch.Tensor
    indices: torch.Tensor
    trusted: bool = False


@dataclass(frozen=True)
class V4Keys:
    """What a V4 kernel receives besides the dense inputs: ``sinks [H]`` (float, None: no sink), ``window``
    (positions, None: the whole causal context) and ``compressed`` (None: none)."""

    sinks: torch.Tensor | None = None
    window: int | None = None
    compressed: CompressedKeys | None = None


def v4_flags(sinks: object, window: object, compressed: object) -> tuple[bool, bool, bool]:
    """Which of the three V4 inputs a call passes: the ``(sinks, window, compressed)`` flags of its spec."""
    return sinks is not None, window is not None, compressed is not None


def check_v4_inputs(q_latent: torch.Tensor, cache: LatentKVCache, meta: BatchMetadata, *,
                    sinks: torch.Tensor | None, window: int | None, compressed: CompressedKeys | None,
                    topk_indices: torch.Tensor | None, check_values: bool) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the V4 inputs disagree with the call:
    ``sinks [H]`` floating point on the cache's device, ``window`` an int >= 1, ``compressed`` a
    :class:`CompressedKeys` whose cache has the main cache's row widths and dtype and whose table and indices have
    one row per request / token; no ``topk_indices`` beside them. With ``check_values`` and untrusted
    ``compressed``, the entries are read (one sync): within the table, on pages the cache holds."""
    if not (sinks is not None or window is not None or compressed is not None):
        return
    if topk_indices is not None:
        raise ValueError("topk_indices: got a tensor with DeepSeek-V4 inputs (sinks/window/compressed); "
                         "supported None (V4 passes its selected entries in compressed=)")
    H = q_latent.shape[1]
    if sinks is not None:
        require_tensor("sinks", sinks, shape=(H,))
        if not sinks.is_floating_point():
            raise TypeError(f"sinks: got dtype {sinks.dtype}; supported a floating-point tensor (one logit a head)")
        require_on_device(cache.device, sinks=sinks)
    if window is not None:
        require_int("window", window, minimum=1)
    if compressed is None:
        return
    if not isinstance(compressed, CompressedKeys):
        raise TypeError(f"compressed: got {type(compressed).__name__}; supported CompressedKeys or None")
    cc = compressed.cache
    if not isinstance(cc, LatentKVCache):
        raise TypeError(f"compressed.cache: got {type(cc).__name__}; supported LatentKVCache")
    if (cc.kv_lora_rank, cc.qk_rope_head_dim) != (cache.kv_lora_rank, cache.qk_rope_head_dim):
        raise ValueError(f"compressed.cache: got rows of {cc.kv_lora_rank}+{cc.qk_rope_head_dim}; supported the "
                         f"main cache's {cache.kv_lora_rank}+{cache.qk_rope_head_dim}")
    if cc.kv_cache_dtype != cache.kv_cache_dtype:
        raise TypeError(f"compressed.cache: got dtype {cc.kv_cache_dtype}; supported the main cache's "
                        f"{cache.kv_cache_dtype}")
    B, T = meta.num_requests, meta.num_tokens
    require_tensor("compressed.block_table", compressed.block_table, shape=(B, None),
                   dtypes=(torch.int32, torch.int64))
    require_tensor("compressed.indices", compressed.indices, shape=(T, None), dtypes=(torch.int32, torch.int64))
    if compressed.indices.shape[1] < 1:
        raise ValueError("compressed.indices: got width 0; supported >= 1 (pad with -1)")
    require_on_device(cache.device, **{"compressed.cache": cc.data, "compressed.block_table": compressed.block_table,
                                       "compressed.indices": compressed.indices})
    if not check_values or compressed.trusted or not T:
        return
    idx = compressed.indices.long()
    limit = compressed.block_table.shape[1] * cc.block_size
    if bool(((idx < -1) | (idx >= limit)).any()):
        raise ValueError(f"compressed.indices: got entries outside [-1, {limit - 1}]; supported -1 (padding) or an "
                         f"entry of the token's request within its block table ({limit} entries)")
    pages = compressed.block_table.long()[meta.token_request[:, None].expand_as(idx),
                                          idx.clamp_min(0) // cc.block_size]
    if bool(((pages < 0) | (pages >= cc.num_blocks))[idx >= 0].any()):
        raise ValueError(f"compressed.block_table: got page ids outside [0, {cc.num_blocks - 1}] for selected "
                         f"entries; supported pages of compressed.cache ({cc.num_blocks} blocks)")
