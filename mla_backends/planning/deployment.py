"""Deployment sizing: weights per rank, the prefill workspace, what is left for the latent cache, tokens per
rank and for the deployment, and the per-step communication of decode context parallelism (DCP).

Pure functions of :class:`~mla_backends.core.dims.MLADims` plus the model's MLP/MoE shape (:class:`ModelShape`:
from a ``config.json`` or the presets' published values). ``mla-backends kv-cache`` prints them.

**Weight counting rule** (stated in the JSON as ``weights_rule``): every decoder layer's attention (``q_a``,
``q_b`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, the norms), its MLP (dense layers:
gate/up/down) or MoE (routed + shared experts, router), the embedding, the final norm and ``lm_head``.
The MTP module (``num_nextn_predict_layers``) is *not* counted: engines load it only for speculative decoding.
Sharding at TP ``T``: the per-head projections (``q_b``/``q_proj``, ``kv_b``, ``o_proj``) split by heads, the
latent projections and norms are replicated; with DP-attention the attention is whole on every rank. MLP and
experts (TP or EP), embedding and ``lm_head`` (by vocabulary) split across the ``T`` ranks. Dtype: linear
layers of the decoder in the weights dtype (fp8 adds one float32 scale per 128 x 128 block); embedding,
``lm_head``, norms and routers in bf16.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from ..core.config_fields import ConfigFields
from ..core.dims import MLADims
from ..core.validation import require_int

__all__ = ["ModelShape", "MODEL_SHAPES", "WEIGHTS_RULE", "MAX_SIZE_BYTES", "parse_memory", "model_shape",
           "weight_bytes_per_rank", "dcp_comm_bytes_per_token", "PUBLISHED_WEIGHTS_DTYPE"]

GiB = 1 << 30
WEIGHTS_RULE = ("decoder layers (attention, dense MLP or MoE experts + router), embedding, final norm and "
                "lm_head; MTP module not counted; per-head attention projections split by TP heads (whole "
                "under DP-attention), latent projections and norms replicated; MLP/experts, embedding and "
                "lm_head split across the TP ranks; decoder linear layers in the weights dtype (fp8: + one "
                "float32 scale per 128x128 block), embedding/lm_head/norms/router in bf16")


@dataclass(frozen=True)
class ModelShape:
    """The non-attention shape of a DeepSeek-style model (transformers' config names)."""

    vocab_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k); 0 for a dense model

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config dict") -> ModelShape:
        """From a ``config.json`` dict; a model without MoE keys is dense in every layer. Every field gets the
        layer's checks (:class:`~mla_backends.core.config_fields.ConfigFields`: ``vocab_size`` and
        ``intermediate_size`` required and >= 1, ``moe_intermediate_size`` too when there are routed experts,
        the other counts >= 0, no bools or strings); errors name the field and ``source``."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config: got {type(config).__name__}; supported a mapping (a config.json's object)")
        f = ConfigFields(config, source)
        experts = f.integer("n_routed_experts", 0, minimum=0)
        moe = f.integer("moe_intermediate_size") if experts else f.integer("moe_intermediate_size", 0, minimum=0)
        return cls(vocab_size=f.integer("vocab_size"), intermediate_size=f.integer("intermediate_size"),
                   moe_intermediate_size=moe, n_routed_experts=experts,
                   n_shared_experts=f.integer("n_shared_experts", 0, minimum=0),
                   first_k_dense_replace=f.integer("first_k_dense_replace", 0, minimum=0) if experts else 10**9,
                   num_experts_per_tok=f.integer("num_experts_per_tok", 0, minimum=0) if experts else 0)


#: the presets' published shapes (their config.json files)
MODEL_SHAPES: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(129280, 18432, 2048, 256, 1, 3, 8),
    "deepseek-v3.2": ModelShape(129280, 18432, 2048, 256, 1, 3, 8),
    "kimi-k2": ModelShape(163840, 18432, 2048, 384, 1, 1, 8),
    "deepseek-v2": ModelShape(102400, 12288, 1536, 160, 2, 1, 6),
    "deepseek-v2-lite": ModelShape(102400, 10944, 1408, 64, 2, 1, 6),
}
#: the dtype each preset's weights are published in (DeepSeek-V3/R1/V3.2, Kimi K2: fp8 e4m3, 128x128 blocks)
PUBLISHED_WEIGHTS_DTYPE = {"deepseek-v3": "fp8_e4m3", "deepseek-v3.2": "fp8_e4m3", "kimi-k2": "fp8_e4m3",
                           "deepseek-v2": "bfloat16", "deepseek-v2-lite": "bfloat16"}
_WEIGHT_BYTES = {"fp8_e4m3": 1, "fp8": 1, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4}


def model_shape(dims: MLADims, config: dict[str, Any] | None = None) -> ModelShape:
    """``config``'s shape, else the preset's (``dims.name``); ValueError for an unknown model."""
    if config is not None:
        return ModelShape.from_config(config)
    if dims.name in MODEL_SHAPES:
        return MODEL_SHAPES[dims.name]
    raise ValueError(f"model: got {dims.name!r} without a config.json; supported a config.json or a preset "
                     f"({', '.join(MODEL_SHAPES)}) for weight sizing")


#: the largest size a size flag takes, in bytes: 2**53 (8 PiB), the largest whole number a float holds exactly,
#: so every figure the reports derive from a size stays exact
MAX_SIZE_BYTES = 2**53
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([KMGT]i?B)?\s*", re.IGNORECASE)


def parse_memory(text: str | float | int, argument: str = "--gpu-memory", *, allow_zero: bool = False) -> int:
    """``"141GB"`` (10**9), ``"80GiB"`` (2**30), ``"512MB"``/``"MiB"``, ``"1.5TB"``; a bare number is GiB.

    Read exactly as written, in decimal arithmetic (``4.35TB`` is 4,350,000,000,000 bytes; a float is read
    as the decimal it prints as), then rounded down to whole bytes. ``allow_zero`` accepts ``0``
    (``--reserve 0``: hold nothing back). Errors name ``argument``: a malformed or negative size, a positive
    one under one byte, one above :data:`MAX_SIZE_BYTES`."""
    if isinstance(text, bool):
        raise TypeError(f"{argument}: got bool; supported a size such as 141GB, 80GiB or a number of GiB")
    kind = "non-negative" if allow_zero else "positive"
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{argument}: got {text!r}; supported a {kind} size such as 141GB, 80GiB or a bare "
                         "number of GiB")
    mantissa = Fraction(Decimal(m.group(1)))  # exact: no binary float on the way
    exponent = m.group(2) or "0"
    exponent = int(exponent) if len(exponent.lstrip("+-")) <= 6 else (-1 if exponent[0] == "-" else 1) * 10**6
    unit = (m.group(3) or "GiB").upper()
    multiplier = (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    magnitude = Decimal(m.group(1)).adjusted() + exponent if mantissa else 0  # its power of ten
    if magnitude > 40:  # over 1e40 bytes, far past the limit: never build the integer
        nbytes = MAX_SIZE_BYTES + 1
    elif magnitude < -40:  # under 1e-27 bytes
        nbytes = 0
    else:
        nbytes = math.floor(mantissa * multiplier * Fraction(10) ** exponent)
    if nbytes > MAX_SIZE_BYTES:
        raise ValueError(f"{argument}: got {text!r}, which is more than a size may be; supported a {kind} "
                         f"size of at most {MAX_SIZE_BYTES:,} bytes (2**53, 8 PiB)")
    if not mantissa and not allow_zero:
        raise ValueError(f"{argument}: got {text!r}; supported a {kind} size such as 141GB, 80GiB or a bare "
                         "number of GiB")
    if mantissa and nbytes == 0:
        raise ValueError(f"{argument}: got {text!r}, which is less than one byte; supported a {kind} size "
                         f"of at least 1 byte{' (or 0)' if allow_zero else ''}")
    return nbytes


def _block_scales(rows: int, cols: int) -> int:
    return math.ceil(rows / 128) * math.ceil(cols / 128)


def weight_bytes_per_rank(dims: MLADims, shape: ModelShape, *, weights_dtype: str, tp: int = 1,
                          dp_attention: bool = False) -> int:
    """Bytes of one rank's weights under :data:`WEIGHTS_RULE` (``dims``: the whole model, ``tp_size`` 1)."""
    if weights_dtype not in _WEIGHT_BYTES:
        raise ValueError(f"weights_dtype: got {weights_dtype!r}; supported {', '.join(_WEIGHT_BYTES)}")
    require_int("tp", tp, minimum=1)
    wb = _WEIGHT_BYTES[weights_dtype]
    fp8 = wb == 1
    d = dims
    hid, H = d.hidden_size, d.total_num_heads
    attn_split = 1 if dp_attention else tp
    N, P, V, R = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank

    def linear(rows: int, cols: int, split: int) -> float:  # one [rows, cols] matrix, split ways
        return (rows * cols * wb + (4 * _block_scales(rows, cols) if fp8 else 0)) / split

    q = (linear(d.q_lora_rank, hid, 1) + linear(H * (N + P), d.q_lora_rank, attn_split) + 2 * d.q_lora_rank
         if d.q_lora_rank else linear(H * (N + P), hid, attn_split))
    attn = (q + linear(R + P, hid, 1) + linear(H * (N + V), R, attn_split) + linear(hid, H * V, attn_split)
            + 2 * R + 2 * 2 * hid)  # kv_a norm, two layer norms (bf16)
    dense = 3 * linear(shape.intermediate_size, hid, tp)
    experts = shape.n_routed_experts + shape.n_shared_experts
    moe = experts * 3 * linear(shape.moe_intermediate_size, hid, tp) + 2 * shape.n_routed_experts * hid
    n_dense = min(d.num_layers, shape.first_k_dense_replace)
    total = d.num_layers * attn + n_dense * dense + (d.num_layers - n_dense) * moe
    total += 2 * (2 * shape.vocab_size * hid) / tp + 2 * hid  # embedding + lm_head (bf16, vocab-split), norm
    return int(math.ceil(total))


def dcp_comm_bytes_per_token(dims: MLADims, *, tp: int, dcp: int, dtype_bytes: int = 2,
                             cache_bytes: int = 2) -> dict[str, int]:
    """Bytes one rank sends per token per layer, by collective (ring algorithms: an all-gather or
    reduce-scatter of ``n`` bytes per rank sends ``(D - 1) * n``; an all-reduce of ``n`` bytes sends
    ``2 (T - 1) / T * n``). ``dims``: the whole model. Decode: the query all-gather (``H (R + P)`` per rank),
    the LSE all-gather (``D H`` float32), the output reduce-scatter (``D H R`` per rank, ``1/D`` kept).
    Prefill: the context-row all-gather, per context token (``(R + P)`` cache bytes, ``1/D`` of the rows per
    rank). The TP all-reduce of ``o_proj`` (``hidden`` values) is listed apart."""
    require_int("tp", tp, minimum=1)
    require_int("dcp", dcp, minimum=1)
    if tp % dcp:
        raise ValueError(f"dcp: got {dcp}; supported a divisor of tp {tp}")
    H = dims.total_num_heads // tp
    R, W = dims.kv_lora_rank, dims.cache_row_width
    D = dcp
    return {
        "decode_query_all_gather": (D - 1) * H * W * dtype_bytes,
        "decode_lse_all_gather": (D - 1) * D * H * 4,
        "decode_output_reduce_scatter": (D - 1) * H * R * dtype_bytes,
        "prefill_context_all_gather_per_context_token": (D - 1) * W * cache_bytes // D,
        "tp_all_reduce": 2 * (tp - 1) * dims.hidden_size * dtype_bytes // tp,
    }
