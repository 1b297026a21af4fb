"""What an engine holds back on each rank before it sizes the KV cache: the *reserve*, term by term.

An engine gives the cache what is left of ``gpu memory x utilization`` after the weights and what a forward
pass and the runtime need. vLLM measures the forward-pass part by profiling one dummy forward pass at its
token budget (``--max-num-batched-tokens``) and adds the CUDA-graph pool and the memory outside PyTorch
(NCCL); SGLang keeps a static fraction (``--mem-fraction-static``) and leaves the rest to activations, graphs
and communication. This module *models* those terms from the shapes, so a plan can be made without a GPU:

- ``activations``: one forward pass over ``T`` = ``max_num_batched_tokens`` tokens (8,192 by default, vLLM's
  budget): the residual stream (hidden states and residual, ``2 hidden`` values per token) plus the larger of
  one attention layer's prefill buffers (``q_lora + R + P`` latent values and, per rank head, a ``N + P``
  query and key, a ``V`` value and output) and one dense MLP's (``3 I / tp``: gate, up, activated), in the
  model dtype; plus the sampler's float32 logits for ``max_num_seqs`` rows (``S x vocab x 4``).
- ``moe_dispatch``: the MoE layer's per-(token, expert) buffers: every token goes to its ``k`` experts, and a
  fused MoE kernel keeps ``k`` rows per token of the larger of (gate/up output ``2 I_e / tp``, expert output
  ``hidden``) and of the activated ``I_e / tp``, in the model dtype, for at most 32,768 tokens at a time
  (vLLM's fused-MoE chunk). 0 for a dense model.
- ``cuda_graph_pool``: decode graphs are captured for batch sizes up to 512 (vLLM's default largest capture
  size, ``min(2 x max_num_seqs, 512)``); the graphs share one memory pool, which holds the largest graph's
  intermediates: the per-token footprint of the two terms above (without the logits) times that batch.
- ``nccl``: every communicator a rank joins with more than one rank keeps receive buffers per channel and
  connection, one per protocol: Simple (``NCCL_BUFFSIZE``, 4 MiB by default), LL128 (4,915,200 B) and LL
  (524,288 B). We count 16 channels (what NCCL logs for 8 NVLink-connected Hopper GPUs) and 2 connections per
  channel (ring and tree). Communicators: the TP group (the MoE group under DP-attention) and, with DCP,
  its own group.

These are estimates: engines differ by version, and the CUDA context, cuBLAS workspaces and allocator
fragmentation are not counted. The terms are added, which errs high (one layer's attention and MoE buffers
are not alive at once); under DP-attention the MoE term counts the rank's own tokens only. An engine's log
gives the real figures (vLLM prints its peak activation and CUDA-graph memory); ``mla-backends kv-cache
--reserve SIZE`` replaces the modelled total with such a figure.
``docs/cost-model.md`` works the terms through for DeepSeek-V3 on 8 H200.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module is imported when the CLI builds its parser: no torch at import time
    from ..core.dims import MLADims

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "CUDA_GRAPH_MAX_BATCH",
           "FUSED_MOE_CHUNK_TOKENS", "NCCL_BYTES_PER_COMMUNICATOR", "RESERVE_TERMS", "reserve_terms",
           "nccl_communicators"]

#: vLLM's default token budget per step (``--max-num-batched-tokens``), the batch its profiling pass runs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
#: sequences per step (``--max-num-seqs``): rows of logits the sampler makes, and the capture sizes' bound
DEFAULT_MAX_NUM_SEQS = 256
#: the largest decode batch vLLM captures a CUDA graph for by default
CUDA_GRAPH_MAX_BATCH = 512
#: tokens a fused MoE layer processes at a time (vLLM's ``VLLM_FUSED_MOE_CHUNK_SIZE`` default)
FUSED_MOE_CHUNK_TOKENS = 32768
_NCCL_CHANNELS = 16
_NCCL_CONNECTIONS_PER_CHANNEL = 2
_NCCL_PROTOCOL_BYTES = 4 * 2**20 + 4_915_200 + 524_288  # Simple (NCCL_BUFFSIZE) + LL128 + LL
#: one communicator's buffers on one rank: 16 channels x 2 connections x (Simple + LL128 + LL) = 308,281,344
NCCL_BYTES_PER_COMMUNICATOR = _NCCL_CHANNELS * _NCCL_CONNECTIONS_PER_CHANNEL * _NCCL_PROTOCOL_BYTES
#: the terms, in the order the reports show them
RESERVE_TERMS = ("activations", "moe_dispatch", "cuda_graph_pool", "nccl")


def nccl_communicators(tp: int, dcp: int = 1) -> int:
    """Communicators of more than one rank a rank joins: the TP (or MoE) group when ``tp > 1``, plus the DCP
    group when ``dcp > 1``."""
    from ..core.validation import require_int

    return int(require_int("tp", tp, minimum=1) > 1) + int(require_int("dcp", dcp, minimum=1) > 1)


def _per_token(dims: MLADims, shape: Any, *, tp: int, attn_tp: int, model_bytes: int) -> tuple[int, int]:
    """(activation bytes, MoE dispatch bytes) one token of a forward pass holds on one rank."""
    d = dims
    heads = d.total_num_heads // attn_tp
    N, P, V, R = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    residual = 2 * d.hidden_size
    attention = (d.q_lora_rank or 0) + R + P + heads * (2 * (N + P) + 2 * V)
    dense = 3 * shape.intermediate_size // tp if shape.first_k_dense_replace > 0 else 0
    moe = 0
    if shape.n_routed_experts and shape.first_k_dense_replace < d.num_layers:
        if shape.num_experts_per_tok < 1:
            raise ValueError(f"num_experts_per_tok: got {shape.num_experts_per_tok} for a model with "
                             f"{shape.n_routed_experts} routed experts; supported the config's top-k (>= 1), "
                             "which sizes the MoE dispatch buffers")
        inter = shape.moe_intermediate_size // tp
        moe = shape.num_experts_per_tok * (max(2 * inter, d.hidden_size) + inter) * model_bytes
    return (residual + max(attention, dense)) * model_bytes, moe


def reserve_terms(dims: MLADims, shape: Any, *, tp: int, dcp: int = 1, dp_attention: bool = False,
                  model_bytes: int = 2, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                  max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict[str, int]:
    """Bytes of each reserve term on one rank (:data:`RESERVE_TERMS`, integers; the module docstring gives
    the formulas). ``dims``: the whole model; ``shape``: its :class:`~mla_backends.planning.deployment.ModelShape`.

    DeepSeek-V3 at TP=8, bf16 activations, the defaults: activations 569,638,912 (8,192 tokens x 53,376 B
    plus 256 x 129,280 float32 logits), MoE dispatch 973,078,528 (8,192 x 118,784), CUDA-graph pool
    88,145,920 (512 x 172,160), NCCL 308,281,344 (one communicator; two with ``dcp > 1``).
    """
    from ..core.validation import require_int

    require_int("tp", tp, minimum=1)
    T = require_int("--max-num-batched-tokens", max_num_batched_tokens, minimum=1)
    S = require_int("max_num_seqs", max_num_seqs, minimum=1)
    mb = require_int("model_bytes", model_bytes, minimum=1)
    act, moe = _per_token(dims, shape, tp=tp, attn_tp=1 if dp_attention else tp, model_bytes=mb)
    graph_batch = min(CUDA_GRAPH_MAX_BATCH, 2 * S)
    return {
        "activations": T * act + S * shape.vocab_size * 4,
        "moe_dispatch": min(T, FUSED_MOE_CHUNK_TOKENS) * moe,
        "cuda_graph_pool": graph_batch * (act + moe),
        "nccl": nccl_communicators(tp, dcp) * NCCL_BYTES_PER_COMMUNICATOR,
    }
