"""DeepSeek-V4 attention weights: names, full shapes, tensor-parallel slices and DeepSeek's own names.

Names are those of transformers' ``DeepseekV4Attention`` (``model.layers.{L}.self_attn.`` in a checkpoint):

====================================================  ======================================  ==================
name                                                  full shape                              TP slice
====================================================  ======================================  ==================
``q_a_proj.weight``                                   ``[q_lora_rank, hidden]``               replicated
``q_a_norm.weight``                                   ``[q_lora_rank]``                       replicated
``q_b_proj.weight``                                   ``[heads * head_dim, q_lora_rank]``     rows of the heads
``kv_proj.weight`` / ``kv_norm.weight``               ``[head_dim, hidden]`` / ``[head_dim]`` replicated
``o_a_proj.weight``                                   ``[o_groups * o_lora_rank,              rows of the groups
                                                      heads * head_dim / o_groups]``
``o_b_proj.weight``                                   ``[hidden, o_groups * o_lora_rank]``    columns of groups
``sinks``                                             ``[heads]``                             the heads
CSA/HCA: ``compressor.kv_proj.weight``,               ``[c * head_dim, hidden]`` (each),      replicated
``compressor.gate_proj.weight``,                      ``[ratio, c * head_dim]``,
``compressor.position_bias``,                         ``[head_dim]``
``compressor.kv_norm.weight``                         (``c`` = 2 for CSA's overlap, 1 for HCA)
CSA: ``compressor.indexer.kv_proj.weight``,           ``[2 * index_head_dim, hidden]`` (each), replicated
``.gate_proj.weight``, ``.position_bias``,            ``[ratio, 2 * index_head_dim]``,
``.kv_norm.weight``, ``.q_b_proj.weight``,            ``[index_head_dim]``,
``.scorer.weights_proj.weight``                       ``[index_n_heads * index_head_dim,
                                                      q_lora_rank]``, ``[index_n_heads, hidden]``
====================================================  ======================================  ==================

A rank holds ``heads / tp_size`` heads and ``o_groups / tp_size`` output groups (whole groups); the output
projection is row-parallel, so ranks' outputs are summed. Checkpoints in DeepSeek's own naming
(``layers.{L}.attn.``, or ``model.layers.{L}.attn.`` as transformers' ``save_pretrained`` writes V4, with ``wq_a``,
``wkv``, ``norm``, ``attn_sink``, ``compressor.ape``, ``indexer.compressor.wkv``, fp8 ``.scale`` ...) are read
through :func:`deepseek_name`, the renaming transformers' loader applies (a table).
"""

from __future__ import annotations

from ..core.v4dims import CSA, SLIDING, V4Dims
from .hf import sliced_shapes

__all__ = ["v4_expected_shapes", "v4_shard_range", "v4_rank_shapes", "deepseek_name", "v4_layer_prefixes",
           "V4_PREFIX", "DEEPSEEK_PREFIXES"]

#: where transformers' names keep layer ``L``'s attention, and where DeepSeek's do (transformers' own
#: ``save_pretrained`` writes DeepSeek's names under ``model.``)
V4_PREFIX = "model.layers.{}.self_attn."
DEEPSEEK_PREFIXES = ("model.layers.{}.attn.", "layers.{}.attn.")

#: DeepSeek's leading name parts -> transformers' (longest first); then each dotted part through _PART_NAMES
_PREFIX_NAMES = (
    ("indexer.compressor.", "compressor.indexer."),
    ("indexer.weights_proj.", "compressor.indexer.scorer.weights_proj."),
    ("indexer.wq_b.", "compressor.indexer.q_b_proj."),
)
_PART_NAMES = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
               "wgate": "gate_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj", "norm": "kv_norm",
               "ape": "position_bias", "attn_sink": "sinks", "scale": "weight_scale_inv"}


def v4_layer_prefixes(layer_idx: int) -> tuple[str, ...]:
    """Where layer ``layer_idx``'s attention tensors may live: transformers' prefix, then DeepSeek's."""
    return (V4_PREFIX.format(layer_idx), *(p.format(layer_idx) for p in DEEPSEEK_PREFIXES))


def deepseek_name(name: str) -> str:
    """transformers' name for DeepSeek's attention tensor ``name`` (relative to ``layers.{L}.attn.``)."""
    for old, new in _PREFIX_NAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return ".".join(_PART_NAMES.get(part, part) for part in name.split("."))


def v4_expected_shapes(dims: V4Dims, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shapes of layer ``layer_idx``'s attention tensors (``dims`` may be a per-rank view)."""
    kind = dims.kind(layer_idx)
    H, D, hid, ql = dims.total_num_heads, dims.head_dim, dims.hidden_size, dims.q_lora_rank
    G, og = dims.o_groups, dims.o_lora_rank
    shapes: dict[str, tuple[int, ...]] = {
        "q_a_proj.weight": (ql, hid), "q_a_norm.weight": (ql,), "q_b_proj.weight": (H * D, ql),
        "kv_proj.weight": (D, hid), "kv_norm.weight": (D,),
        "o_a_proj.weight": (G * og, H * D // G), "o_b_proj.weight": (hid, G * og), "sinks": (H,),
    }
    if kind == SLIDING:
        return shapes
    r, c = dims.ratio_of(kind), 2 if kind == CSA else 1
    shapes |= {"compressor.kv_proj.weight": (c * D, hid), "compressor.gate_proj.weight": (c * D, hid),
               "compressor.position_bias": (r, c * D), "compressor.kv_norm.weight": (D,)}
    if kind == CSA:
        Di, nI = dims.index_head_dim, dims.index_n_heads
        shapes |= {"compressor.indexer.kv_proj.weight": (2 * Di, hid),
                   "compressor.indexer.gate_proj.weight": (2 * Di, hid),
                   "compressor.indexer.position_bias": (r, 2 * Di), "compressor.indexer.kv_norm.weight": (Di,),
                   "compressor.indexer.q_b_proj.weight": (nI * Di, ql),
                   "compressor.indexer.scorer.weights_proj.weight": (nI, hid)}
    return shapes


def v4_shard_range(name: str, dims: V4Dims, tp_rank: int) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of full tensor ``name`` that rank ``tp_rank`` holds (``dims`` per rank); None when
    it is replicated (or ``tp_size`` is 1)."""
    if dims.tp_size == 1:
        return None
    H, D, g, og = dims.num_heads, dims.head_dim, dims.local_o_groups, dims.o_lora_rank
    widths = {"q_b_proj.weight": (0, H * D), "sinks": (0, H), "o_a_proj.weight": (0, g * og),
              "o_b_proj.weight": (1, g * og)}
    if name not in widths:
        return None
    dim, w = widths[name]
    return dim, tp_rank * w, (tp_rank + 1) * w


def v4_rank_shapes(dims: V4Dims, layer_idx: int, tp_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of rank ``tp_rank``'s slices of :func:`v4_expected_shapes`."""
    return sliced_shapes(v4_expected_shapes(dims, layer_idx), lambda name: v4_shard_range(name, dims, tp_rank))
