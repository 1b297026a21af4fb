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

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .config_fields import ConfigFields, read_config_json
from .validation import require_finite, require_int

__all__ = ["MLADims", "RopeScaling", "IndexerDims", "yarn_mscale", "read_config_json"]


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
        for attr in ("factor", "beta_fast", "beta_slow"):
            require_finite(f"rope_scaling.{attr}", getattr(self, attr), positive=True)
        for attr in ("mscale", "mscale_all_dim"):
            require_finite(f"rope_scaling.{attr}", getattr(self, attr), minimum=0.0)
        require_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings,
                    minimum=1)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None, fields: ConfigFields | None = None) -> RopeScaling | None:
        """Parse a ``rope_scaling`` / ``rope_parameters`` block. Returns None for absent or default scaling.

        ``fields`` reads it (every value type- and range-checked, errors naming the field and the file);
        default: a reader whose errors say ``rope_scaling``.
        """
        if m is None:
            return None
        if not isinstance(m, Mapping):
            raise TypeError(f"config.rope_scaling: got {type(m).__name__} {m!r}; supported a mapping or null"
                            + ("" if fields is None else f" ({fields.source})"))
        if not m:
            return None
        f = fields or ConfigFields(m, "rope_scaling", prefix="rope_scaling.")
        kind = f.raw("type", f.raw("rope_type", "default"))
        if kind == "default":
            return None
        if kind != "yarn":
            raise ValueError(f"config.{f.prefix}type: got {kind!r}; supported 'yarn' (or none) ({f.source})")
        return cls(
            type="yarn",
            factor=f.number("factor", 1.0, positive=True),
            mscale=f.number("mscale", 1.0, minimum=0.0) or 1.0,
            mscale_all_dim=f.number("mscale_all_dim", 0.0, minimum=0.0),
            original_max_position_embeddings=f.integer("original_max_position_embeddings", 4096),
            beta_fast=f.number("beta_fast", 32.0, positive=True),
            beta_slow=f.number("beta_slow", 1.0, positive=True),
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
        require_int("MLADims.max_position_embeddings", self.max_position_embeddings, minimum=1)
        require_finite("MLADims.rope_theta", self.rope_theta, positive=True)
        require_finite("MLADims.rms_norm_eps", self.rms_norm_eps, positive=True)
        if not isinstance(self.rope_interleave, bool):
            raise TypeError(f"MLADims.rope_interleave: got {self.rope_interleave!r}; supported True or False")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"MLADims.rope_scaling: got {type(self.rope_scaling).__name__}; supported "
                            "RopeScaling or None")

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
            source = os.fspath(config)
        elif isinstance(config, Mapping):
            d, source = config, "config dict"
        elif hasattr(config, "to_dict"):
            d, source = config.to_dict(), f"{type(config).__name__}"
            if not isinstance(d, Mapping):
                raise TypeError(f"config: got {type(config).__name__}.to_dict() returning {type(d).__name__}; "
                                "supported a mapping")
        else:
            raise TypeError(
                f"config: got {type(config).__name__}; supported a transformers config, a dict, or a path"
            )
        f = ConfigFields(d, source)
        missing = [k for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim", "hidden_size") if d.get(k) is None]
        if missing:
            raise ValueError(f"config: missing MLA keys {missing} ({source}); supported a DeepSeek-V2/V3-style "
                             "config")
        rope_block = f.mapping("rope_scaling")
        block_key = "rope_scaling"
        theta = f.number("rope_theta", 10000.0, positive=True)
        params = f.mapping("rope_parameters")
        if params is not None:
            theta = f.nested(params, "rope_parameters").number("rope_theta", theta, positive=True)
            if not rope_block:
                rope_block, block_key = params, "rope_parameters"
        num_layers = f.integer("num_hidden_layers", 1)
        indexer = None
        if d.get("index_topk") is not None or d.get("index_n_heads") is not None:
            indexer = IndexerDims(
                n_heads=f.integer("index_n_heads", 64),
                head_dim=f.integer("index_head_dim", 128),
                topk=f.integer("index_topk", 2048),
                skip_layers=_indexer_skip_layers(f, num_layers),
                rope_interleave=f.flag("indexer_rope_interleave", False),
            )
        rope_scaling = None
        if rope_block:
            rope_scaling = RopeScaling.from_mapping(rope_block, f.nested(rope_block, block_key))
        return cls(
            num_heads=f.integer("num_attention_heads"),
            kv_lora_rank=f.integer("kv_lora_rank"),
            qk_nope_head_dim=f.integer("qk_nope_head_dim"),
            qk_rope_head_dim=f.integer("qk_rope_head_dim", minimum=0),
            v_head_dim=f.integer("v_head_dim"),
            q_lora_rank=f.optional_int("q_lora_rank"),
            hidden_size=f.integer("hidden_size"),
            num_layers=num_layers,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rope_interleave=f.flag("rope_interleave", True),
            max_position_embeddings=f.integer("max_position_embeddings", 163840),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
            indexer=indexer,
            name=str(d.get("model_type", "custom")),
        )


def _indexer_skip_layers(f: ConfigFields, num_layers: int) -> frozenset[int]:
    """Layers that reuse the previous layer's top-k instead of indexing (the engines' ``skip_topk``).

    Precedence: ``indexer_types`` (``"full"``/``"shared"`` per layer), then ``index_topk_pattern``
    (``"F"``/``"S"`` per layer), then ``index_topk_freq``/``index_skip_topk_offset``: layer ``i`` skips when
    ``max(i - offset + 1, 0) % freq != 0`` (offset defaults to 2, as in transformers; freq 1 indexes every
    layer).
    """
    types = f.raw("indexer_types")
    if types:
        allowed = {"full", "shared"}
        if isinstance(types, (str, bytes)) or not isinstance(types, (list, tuple)) or not all(
                isinstance(t, str) for t in types):
            raise TypeError(f"config.indexer_types: got {types!r}; supported a list of 'full'/'shared' "
                            f"({f.source})")
        if not set(types) <= allowed:
            bad = sorted(set(types) - allowed)
            raise ValueError(f"config.indexer_types: got {bad}; supported 'full', 'shared' ({f.source})")
        return frozenset(i for i, t in enumerate(types) if t == "shared")
    pattern = f.raw("index_topk_pattern")
    if pattern:
        if not isinstance(pattern, str) or not set(pattern) <= {"F", "S"}:
            raise ValueError(f"config.index_topk_pattern: got {pattern!r}; supported a string of 'F' and 'S' "
                             f"({f.source})")
        return frozenset(i for i, c in enumerate(pattern) if c == "S")
    freq = f.integer("index_topk_freq", 1)
    offset = f.integer("index_skip_topk_offset", 2, minimum=0)
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
