"""The attention shape of an MLA layer: :class:`MLADims` and its presets.

Everything downstream (cache layout, kernel capability checks, cost model, the layer) reads its widths from
one :class:`MLADims`. The names follow the Hugging Face DeepSeek configs:

=====================  ==========================================  ======  ======
field                  meaning                                     V2/V3   Lite
=====================  ==========================================  ======  ======
``num_heads``          query heads (per rank after TP)             128     16
``kv_lora_rank``       width of the cached latent ``kv_c``         512     512
``qk_nope_head_dim``   per-head key width without RoPE             128     128
``qk_rope_head_dim``   decoupled RoPE slice, shared by all heads   64      64
``v_head_dim``         per-head value width                        128     128
``q_lora_rank``        query latent width (None: plain q_proj)     1536    None
=====================  ==========================================  ======  ======
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .validation import require_int

__all__ = ["MLADims", "RopeScaling", "IndexerDims", "yarn_mscale", "read_config_json"]


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path``, or inside ``path`` when it is a folder (a checkpoint's)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config: got path {path!r}; supported a config.json file or a folder holding one")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def hf_config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a transformers config object, a dict or a ``config.json`` path (``default`` when
    absent; an :class:`MLADims` carries no raw config keys, so it always gives ``default``)."""
    if isinstance(config, MLADims):
        return default
    if isinstance(config, (str, os.PathLike)):
        config = read_config_json(config)
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek-YaRN attention magnitude factor: ``0.1 * mscale * ln(factor) + 1`` (1.0 when factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling parameters. ``type`` is ``"default"`` (plain RoPE) or ``"yarn"`` (DeepSeek-YaRN)."""

    type: str = "default"
    factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling.type: got {self.type!r}; supported 'default', 'yarn'")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: got {self.factor}; supported > 0")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> RopeScaling | None:
        """Parse a ``rope_scaling`` / ``rope_parameters`` block. Returns None for absent or default scaling."""
        if not m:
            return None
        kind = m.get("type", m.get("rope_type", "default")) or "default"
        if kind == "default":
            return None
        if kind != "yarn":
            raise ValueError(f"rope_scaling: got type {kind!r}; supported 'yarn' (or none)")
        return cls(
            type="yarn",
            factor=float(m.get("factor", 1.0)),
            mscale=float(m.get("mscale", 1.0) or 1.0),
            mscale_all_dim=float(m.get("mscale_all_dim", 0.0) or 0.0),
            original_max_position_embeddings=int(m.get("original_max_position_embeddings", 4096)),
            beta_fast=float(m.get("beta_fast", 32.0)),
            beta_slow=float(m.get("beta_slow", 1.0)),
        )


@dataclass(frozen=True)
class IndexerDims:
    """DeepSeek-V3.2 sparse indexer shape (``index_n_heads`` query heads over one 128-wide key per token)."""

    n_heads: int = 64
    head_dim: int = 128
    topk: int = 2048
    # layers whose indexer is skipped (they reuse the previous layer's top-k); empty means every layer indexes
    skip_layers: frozenset[int] = frozenset()
    # indexer RoPE layout: False for V3.2 (rotate-half); True for GLM-style ``indexer_rope_interleave``
    rope_interleave: bool = False

    def indexes(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` runs its own indexer (and keeps an indexer key cache)."""
        return layer_idx not in self.skip_layers


@dataclass(frozen=True)
class MLADims:
    """Shape of one MLA attention layer.

    ``cache_row_width`` (``kv_lora_rank + qk_rope_head_dim``) is the width of one cached token: 576 for
    DeepSeek-V2/V3. ``softmax_scale`` is the *unabsorbed* ``(qk_nope + qk_rope) ** -0.5`` (times ``mscale**2``
    under DeepSeek-YaRN); absorption changes the key width the kernel sees but not the function.
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int | None = 1536
    hidden_size: int = 7168
    num_layers: int = 61
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    indexer: IndexerDims | None = None
    tp_size: int = 1
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for attr in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "hidden_size", "num_layers", "tp_size"):
            require_int(f"MLADims.{attr}", getattr(self, attr), minimum=0 if attr == "qk_rope_head_dim" else 1)
        if self.q_lora_rank is not None:
            require_int("MLADims.q_lora_rank", self.q_lora_rank, minimum=1)

    # ---- derived widths -------------------------------------------------------------------------------
    @property
    def cache_row_width(self) -> int:
        """Values cached per token per layer: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head key width of the expanded (MHA) path: ``qk_nope + qk_rope`` (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN magnitude factor applied (squared) to the softmax scale; 1.0 without YaRN."""
        rs = self.rope_scaling
        if rs is None or rs.type != "yarn" or not rs.mscale_all_dim:
            return 1.0
        return yarn_mscale(rs.factor, rs.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """The unabsorbed softmax scale ``(qk_nope + qk_rope) ** -0.5 * mscale ** 2``."""
        return self.qk_head_dim ** -0.5 * self.mscale**2

    @property
    def total_num_heads(self) -> int:
        """Heads of the whole (unsharded) layer."""
        return self.num_heads * self.tp_size

    @property
    def is_sparse(self) -> bool:
        """True for DeepSeek-V3.2-style layers with a sparse indexer."""
        return self.indexer is not None

    def tensor_parallel(self, tp_size: int) -> MLADims:
        """Per-rank view: ``num_heads / tp_size`` heads. The latent cache stays replicated on every rank."""
        require_int("tp_size", tp_size, minimum=1)
        if self.num_heads % tp_size:
            raise ValueError(
                f"tp_size: got {tp_size}; supported a divisor of num_heads={self.num_heads} "
                f"(heads must split evenly across ranks)"
            )
        return replace(self, num_heads=self.num_heads // tp_size, tp_size=self.tp_size * tp_size)

    # ---- presets --------------------------------------------------------------------------------------
    @classmethod
    def deepseek_v2(cls) -> MLADims:
        """DeepSeek-V2 (236B): 128 heads, 60 layers, q_lora_rank 1536, hidden 5120."""
        return cls(num_heads=128, hidden_size=5120, num_layers=60, q_lora_rank=1536,
                   rope_scaling=_DEEPSEEK_YARN, name="deepseek-v2")

    @classmethod
    def deepseek_v2_lite(cls) -> MLADims:
        """DeepSeek-V2-Lite (16B): 16 heads, 27 layers, no query latent, hidden 2048."""
        return cls(num_heads=16, hidden_size=2048, num_layers=27, q_lora_rank=None,
                   rope_scaling=_DEEPSEEK_YARN, name="deepseek-v2-lite")

    @classmethod
    def deepseek_v3(cls) -> MLADims:
        """DeepSeek-V3 / R1 (671B): 128 heads, 61 layers, q_lora_rank 1536, hidden 7168."""
        return cls(num_heads=128, hidden_size=7168, num_layers=61, q_lora_rank=1536,
                   rope_scaling=_DEEPSEEK_YARN, name="deepseek-v3")

    @classmethod
    def kimi_k2(cls) -> MLADims:
        """Kimi K2: DeepSeek-V3 geometry with 64 heads."""
        return replace(cls.deepseek_v3(), num_heads=64, name="kimi-k2")

    @classmethod
    def deepseek_v32(cls) -> MLADims:
        """DeepSeek-V3.2: V3 geometry plus the sparse indexer (64 heads x 128, top-2048)."""
        return replace(cls.deepseek_v3(), indexer=IndexerDims(), name="deepseek-v3.2")

    @classmethod
    def preset(cls, name: str) -> MLADims:
        """A preset by name (``deepseek-v3``, ``deepseek_v3``, ``v3``, ``r1`` ...); case-insensitive."""
        key = str(name).lower().replace("_", "-").removeprefix("deepseek-")
        if key in _PRESET_ALIASES:
            return getattr(cls, _PRESET_ALIASES[key])()
        raise ValueError(f"preset: got {name!r}; supported {', '.join(sorted(PRESET_NAMES))}")

    # ---- Hugging Face configs ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any) -> MLADims:
        """Build from a transformers config object, a dict, or a path to a ``config.json`` (or its folder).

        Understands both ``rope_scaling`` (real DeepSeek checkpoints) and transformers 5's ``rope_parameters``.
        """
        if isinstance(config, MLADims):
            return config
        d: Mapping[str, Any]
        if isinstance(config, (str, os.PathLike)):
            d = read_config_json(config)
        elif isinstance(config, Mapping):
            d = config
        elif hasattr(config, "to_dict"):
            d = config.to_dict()
        else:
            raise TypeError(
                f"config: got {type(config).__name__}; supported a transformers config, a dict, or a path"
            )
        missing = [k for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim", "hidden_size") if d.get(k) is None]
        if missing:
            raise ValueError(f"config: missing MLA keys {missing}; supported a DeepSeek-V2/V3-style config")
        rope_block = d.get("rope_scaling") or None
        theta = d.get("rope_theta")
        params = d.get("rope_parameters")
        if isinstance(params, Mapping):
            theta = params.get("rope_theta", theta)
            if rope_block is None:
                rope_block = params
        indexer = None
        if d.get("index_topk") is not None or d.get("index_n_heads") is not None:
            indexer = IndexerDims(
                n_heads=require_int("config.index_n_heads", d.get("index_n_heads", 64), minimum=1),
                head_dim=require_int("config.index_head_dim", d.get("index_head_dim", 128), minimum=1),
                topk=require_int("config.index_topk", d.get("index_topk", 2048), minimum=1),
                skip_layers=_indexer_skip_layers(d, int(d.get("num_hidden_layers", 1))),
                rope_interleave=bool(d.get("indexer_rope_interleave", False)),
            )
        return cls(
            num_heads=int(d["num_attention_heads"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d.get("num_hidden_layers", 1)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_mapping(rope_block),
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 163840)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            indexer=indexer,
            name=str(d.get("model_type", "custom")),
        )


def _indexer_skip_layers(d: Mapping[str, Any], num_layers: int) -> frozenset[int]:
    """Layers that reuse the previous layer's top-k instead of indexing (the engines' ``skip_topk``).

    Precedence: ``indexer_types`` (``"full"``/``"shared"`` per layer), then ``index_topk_pattern``
    (``"F"``/``"S"`` per layer), then ``index_topk_freq``/``index_skip_topk_offset``: layer ``i`` skips when
    ``max(i - offset + 1, 0) % freq != 0`` (offset defaults to 2, as in transformers; freq 1 indexes every
    layer).
    """
    types = d.get("indexer_types")
    if types:
        allowed = {"full", "shared"}
        if not set(types) <= allowed:
            bad = sorted(set(types) - allowed)
            raise ValueError(f"config.indexer_types: got {bad}; supported 'full', 'shared'")
        return frozenset(i for i, t in enumerate(types) if t == "shared")
    pattern = d.get("index_topk_pattern")
    if pattern:
        if not set(pattern) <= {"F", "S"}:
            raise ValueError(f"config.index_topk_pattern: got {pattern!r}; supported a string of 'F' and 'S'")
        return frozenset(i for i, c in enumerate(pattern) if c == "S")
    freq = d.get("index_topk_freq")
    freq = 1 if freq is None else require_int("config.index_topk_freq", freq, minimum=1)
    offset = d.get("index_skip_topk_offset")
    offset = 2 if offset is None else int(offset)
    return frozenset(i for i in range(num_layers) if max(i - offset + 1, 0) % freq != 0)


_DEEPSEEK_YARN = RopeScaling(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)

_PRESET_ALIASES = {
    "v2": "deepseek_v2", "deepseek-v2": "deepseek_v2",
    "v2-lite": "deepseek_v2_lite", "deepseek-v2-lite": "deepseek_v2_lite",
    "v3": "deepseek_v3", "deepseek-v3": "deepseek_v3", "r1": "deepseek_v3", "deepseek-r1": "deepseek_v3",
    "kimi-k2": "kimi_k2", "k2": "kimi_k2",
    "v3.2": "deepseek_v32", "v32": "deepseek_v32", "deepseek-v3.2": "deepseek_v32",
}
PRESET_NAMES = ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "deepseek-r1", "kimi-k2", "deepseek-v3.2")
