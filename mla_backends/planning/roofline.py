"""The roofline of an absorbed MLA decode call: what it must move, what it must compute, and which binds.

A call over ``T`` query tokens with ``H`` heads must read every visible cache row once, read the queries and
write the outputs:

* ``bytes = rows * (r + d_rope) * cache_bytes + T * H * (r + d_rope) * q_bytes + T * H * r * out_bytes``
  (plus ``T * H * 4`` when an fp32 LSE is written);
* ``flops = sum over query tokens of visible rows * 2 * H * ((r + d_rope) + r)`` (scores over the 576-wide
  row, then the weighted sum over the 512-wide latent: 278,528 FLOP per row at 128 heads).

Its time cannot be below ``max(bytes / bandwidth, flops / tensor rate)``; the larger term names the bound.
At 128 heads a bf16 row costs 278,528 FLOP for 1,152 bytes (242 FLOP/B), above an H200's ridge of 206: the
decode is compute-bound there, not memory-bound. Peaks come from :mod:`mla_backends.core.gpus`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.dims import MLADims
from ..core.gpus import gpu_spec
from . import costs

__all__ = ["DecodeRoofline", "decode_roofline", "model_decode_roofline"]


@dataclass(frozen=True)
class DecodeRoofline:
    """One call's lower bound.

    Attributes:
        bytes: bytes the call must move (cache rows read, queries read, outputs and LSE written).
        flops: FLOPs of the absorbed core.
        memory_us: ``bytes / bandwidth`` in microseconds.
        compute_us: ``flops / tensor rate`` in microseconds.
        roofline_us: ``max(memory_us, compute_us)``.
        bound: ``"memory"`` or ``"compute"``, whichever term is larger.
    """

    bytes: int
    flops: int
    memory_us: float
    compute_us: float
    roofline_us: float
    bound: str

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


def _pos(label: str, value: object, *, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{label}: got {type(value).__name__}; supported int")
    if value < (0 if allow_zero else 1):
        raise ValueError(f"{label}: got {value}; supported {'>= 0' if allow_zero else '>= 1'}")


def decode_roofline(
    dims: MLADims,
    seq_lens: list[int],
    *,
    cache_bytes: int,
    peak_bytes_per_s: float,
    peak_flops_per_s: float,
    q_bytes: int = 2,
    out_bytes: int = 2,
    query_lens: list[int] | None = None,
    lse: bool = False,
) -> DecodeRoofline:
    """The roofline of one absorbed ``forward_mqa`` call.

    Args:
        dims: the latent dims and head count (``num_heads`` heads, ``kv_lora_rank`` r, ``qk_rope_head_dim``).
        seq_lens: visible context rows per request (the new tokens included), one int >= 0 each.
        cache_bytes: bytes per cache element (2 for bf16, 1 for fp8).
        peak_bytes_per_s: memory bandwidth, bytes/s.
        peak_flops_per_s: tensor-core rate used for the compute term, FLOP/s.
        q_bytes / out_bytes: bytes per query / output element.
        query_lens: query tokens per request (default one each: decode). Every token of a request is
            charged the request's full ``seq_len`` (an upper bound for causal multi-token queries).
        lse: count a float32 LSE per (token, head) as output.
    """
    if not isinstance(dims, MLADims):
        raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
    if not isinstance(seq_lens, (list, tuple)):
        raise TypeError(f"seq_lens: got {type(seq_lens).__name__}; supported a list of ints")
    for i, s in enumerate(seq_lens):
        _pos(f"seq_lens[{i}]", s, allow_zero=True)
    qlens = [1] * len(seq_lens) if query_lens is None else list(query_lens)
    if len(qlens) != len(seq_lens):
        raise ValueError(f"query_lens: got {len(qlens)} entries; supported one per request ({len(seq_lens)})")
    for i, q in enumerate(qlens):
        _pos(f"query_lens[{i}]", q, allow_zero=True)
    for label, v in (("cache_bytes", cache_bytes), ("q_bytes", q_bytes), ("out_bytes", out_bytes)):
        _pos(label, v)
    for label, p in (("peak_bytes_per_s", peak_bytes_per_s), ("peak_flops_per_s", peak_flops_per_s)):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
            raise ValueError(f"{label}: got {p!r}; supported a positive number")
    tokens = sum(qlens)
    heads = dims.num_heads
    nbytes = (sum(seq_lens) * costs.latent_bytes_per_token_per_layer(dims, cache_bytes)
              + tokens * heads * dims.cache_row_width * q_bytes
              + tokens * heads * dims.kv_lora_rank * out_bytes
              + (tokens * heads * 4 if lse else 0))
    pairs = sum(q * s for q, s in zip(qlens, seq_lens, strict=True))
    flops = pairs * costs.absorbed_core_flops_per_context_token(dims)
    memory_us = nbytes / peak_bytes_per_s * 1e6
    compute_us = flops / peak_flops_per_s * 1e6
    bound = "compute" if compute_us > memory_us else "memory"
    return DecodeRoofline(nbytes, flops, memory_us, compute_us, max(memory_us, compute_us), bound)


def model_decode_roofline(dims: MLADims, context_len: int, *, tp: int = 1, dtype_bytes: int = 2,
                          gpu: str = "h100") -> DecodeRoofline:
    """The model-level bound of one decode token: the absorbed core over ``context_len`` cached tokens in every
    layer, on one rank of ``tp`` (heads split, the latent cache replicated), with peaks from the GPU table.

    DeepSeek-V3 at S=4,096, TP=1 on an H100: 69.6 GFLOP (70 us) against 287.8 MB of cache reads (86 us); at
    TP=8 the FLOPs (8.8 us) divide by eight, the bytes do not. Query and output bytes are left out (they are
    per layer and small beside the cache at these lengths); :func:`decode_roofline` counts them per call.
    """
    if not isinstance(dims, MLADims):
        raise TypeError(f"dims: got {type(dims).__name__}; supported MLADims")
    for label, value in (("context_len", context_len), ("tp", tp), ("dtype_bytes", dtype_bytes)):
        _pos(label, value)
    spec = gpu_spec(gpu)
    flops = dims.num_layers * context_len * costs.absorbed_core_flops_per_context_token(dims, tp)
    nbytes = context_len * costs.latent_bytes_per_token(dims, dtype_bytes)
    memory_us = nbytes / spec.bandwidth_bytes_per_s * 1e6
    compute_us = flops / spec.tensor_flops_per_s() * 1e6
    bound = "compute" if compute_us > memory_us else "memory"
    return DecodeRoofline(nbytes, flops, memory_us, compute_us, max(memory_us, compute_us), bound)
