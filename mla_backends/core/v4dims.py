"""The attention shape of a DeepSeek-V4 model: :class:`V4Dims`.

DeepSeek-V4 keeps one row per token and layer that is both key and value: ``head_dim`` (512) values, the last
``rope_head_dim`` (64) of them rotated (interleaved pairs). Queries are ``num_heads`` rows of the same width;
there is no up-projection, so attention has the shape of MLA's absorbed decode with ``kv_lora_rank = 512`` and
no separate rope slice. Each layer is one of three kinds (:data:`LAYER_KINDS`, transformers' names):

======================================  ==========================================================  =========
kind                                    keys a query at position ``p`` sees                         ratio
======================================  ==========================================================  =========
``sliding_attention``                   its window: positions ``p - sliding_window + 1 .. p``       --
``compressed_sparse_attention`` (CSA)   its window + the ``index_topk`` best compressed entries      ``csa_ratio`` (4)
``heavily_compressed_attention`` (HCA)  its window + every compressed entry                          ``hca_ratio`` (128)
======================================  ==========================================================  =========

Compressed entry ``w`` of a layer with ratio ``r`` pools tokens ``w*r .. w*r + r - 1`` (CSA: and the window
before, an overlapping width of ``2r``) and is visible to positions ``p >= (w + 1) * r - 1`` (once its window is
complete). Every query also has a learned per-head *sink* logit in its softmax denominator. Window-only layers
use the ``main`` rotary (``rope_theta``); CSA/HCA layers and their compressors the ``compress`` rotary
(``compress_rope_theta``, optionally YaRN with ``attention_factor`` 1).

:meth:`V4Dims.from_hf_config` reads transformers' ``DeepseekV4Config`` (an object, a dict or a ``config.json``)
including the legacy keys DeepSeek's own configs ship (``compress_ratios``, ``compress_rate_csa`` ...); a field
this library cannot run is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .config_fields import ConfigFields, read_config_json
from .dims import RopeScaling
from .validation import require_finite, require_int

__all__ = ["V4Dims", "LAYER_KINDS", "SLIDING", "CSA", "HCA", "is_v4_config", "V4_PRESET_NAMES"]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
#: the three layer kinds, in transformers' spelling
LAYER_KINDS = (SLIDING, CSA, HCA)
#: DeepSeek's legacy per-layer ``compress_ratios`` (0: window only), read with the config's own two rates
_LEGACY_RATIO_ZERO = 0
_MODEL_TYPE = "deepseek_v4"
#: preset names (``V4Dims.preset``), the first one canonical
V4_PRESET_NAMES = ("deepseek-v4-flash",)
_V4_ALIASES = {"deepseek-v4-flash": "deepseek_v4_flash", "v4-flash": "deepseek_v4_flash",
               "deepseek-v4": "deepseek_v4_flash", "v4": "deepseek_v4_flash"}


def is_v4_config(config: Any) -> bool:
    """Whether ``config`` (a transformers config, a dict or a ``config.json`` path) describes DeepSeek-V4
    (``model_type == "deepseek_v4"``, or V4's own keys ``compress_ratios`` / ``compress_rates`` / ``o_groups``)."""
    if isinstance(config, V4Dims):
        return True
    if isinstance(config, (str, os.PathLike)):
        config = read_config_json(config)
    get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    return get("model_type") == _MODEL_TYPE or (get("o_groups") is not None and (
        get("compress_ratios") is not None or get("compress_rates") is not None))


@dataclass(frozen=True)
class V4Dims:
    """Shape of DeepSeek-V4 attention (this rank's heads; caches are replicated on every rank).

    Attributes:
        num_heads: query heads on this rank. head_dim: width of a row (query, key and value; 512).
        rope_head_dim: its rotated tail (64). q_lora_rank: query latent width. hidden_size / num_layers.
        layer_types: one of :data:`LAYER_KINDS` per layer.
        csa_ratio / hca_ratio: tokens per compressed entry of CSA and HCA layers (4 and 128 in the releases).
        sliding_window: positions of the window, the query's own included.
        index_n_heads / index_head_dim / index_topk: the CSA indexer (64 heads x 128, top-512).
        o_groups / o_lora_rank: the grouped output projection (groups of the whole layer; a rank holds
            ``o_groups / tp_size``).
        rope_theta: base of the ``main`` rotary (window-only layers). compress_rope_theta / compress_rope /
            compress_attention_factor: the ``compress`` rotary (CSA/HCA layers, compressors, indexer).
        rms_norm_eps, max_position_embeddings, tp_size, name.
    """

    num_heads: int
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    hidden_size: int = 4096
    num_layers: int = 43
    layer_types: tuple[str, ...] = ()
    csa_ratio: int = 4
    hca_ratio: int = 128
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    o_groups: int = 8
    o_lora_rank: int = 1024
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope: RopeScaling | None = None
    compress_attention_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tp_size: int = 1
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for attr in ("num_heads", "head_dim", "rope_head_dim", "q_lora_rank", "hidden_size", "num_layers",
                     "csa_ratio", "hca_ratio", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                     "o_groups", "o_lora_rank", "max_position_embeddings", "tp_size"):
            require_int(f"V4Dims.{attr}", getattr(self, attr), minimum=1)
        for attr in ("rope_theta", "compress_rope_theta", "compress_attention_factor", "rms_norm_eps"):
            require_finite(f"V4Dims.{attr}", getattr(self, attr), positive=True)
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            raise ValueError(f"V4Dims.rope_head_dim: got {self.rope_head_dim}; supported an even width below "
                             f"head_dim ({self.head_dim})")
        if self.rope_head_dim >= self.index_head_dim:
            raise ValueError(f"V4Dims.index_head_dim: got {self.index_head_dim}; supported more than "
                             f"rope_head_dim ({self.rope_head_dim}), whose tail it rotates")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            raise ValueError(f"V4Dims.layer_types: got {self.layer_types!r}; supported a tuple of "
                             f"num_layers ({self.num_layers}) kinds")
        bad = sorted({t for t in self.layer_types if t not in LAYER_KINDS}, key=str)
        if bad:
            raise ValueError(f"V4Dims.layer_types: got {bad}; supported {', '.join(LAYER_KINDS)}")
        if (self.num_heads * self.tp_size) % self.o_groups:
            raise ValueError(f"V4Dims.o_groups: got {self.o_groups}; supported a divisor of the heads "
                             f"({self.num_heads * self.tp_size})")
        if self.o_groups % self.tp_size:
            raise ValueError(f"V4Dims.tp_size: got {self.tp_size}; supported a divisor of o_groups "
                             f"({self.o_groups}), so that every rank holds whole output groups")
        if self.compress_rope is not None and not isinstance(self.compress_rope, RopeScaling):
            raise TypeError(f"V4Dims.compress_rope: got {type(self.compress_rope).__name__}; supported "
                            "RopeScaling or None")

    # ---- per layer --------------------------------------------------------------------------------------
    def kind(self, layer_idx: int) -> str:
        """Layer ``layer_idx``'s kind (one of :data:`LAYER_KINDS`)."""
        require_int("layer_idx", layer_idx, minimum=0)
        if layer_idx >= self.num_layers:
            raise ValueError(f"layer_idx: got {layer_idx}; supported 0..{self.num_layers - 1}")
        return self.layer_types[layer_idx]

    def ratio(self, layer_idx: int) -> int:
        """Tokens per compressed entry of layer ``layer_idx`` (0: a window-only layer)."""
        return self.ratio_of(self.kind(layer_idx))

    def ratio_of(self, kind: str) -> int:
        """Tokens per compressed entry of ``kind`` layers (0 for window-only layers)."""
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[kind]

    @property
    def ratios(self) -> tuple[int, ...]:
        """The compress ratios the model's layers use, ascending (each once)."""
        return tuple(sorted({self.ratio_of(k) for k in self.layer_types} - {0}))

    def kinds_count(self) -> dict[str, int]:
        """How many layers of each kind."""
        return {k: self.layer_types.count(k) for k in LAYER_KINDS}

    # ---- derived ------------------------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        """The unrotated part of a row: ``head_dim - rope_head_dim`` (448)."""
        return self.head_dim - self.rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5``: queries and keys are whole rows."""
        return self.head_dim ** -0.5

    @property
    def total_num_heads(self) -> int:
        return self.num_heads * self.tp_size

    @property
    def local_o_groups(self) -> int:
        """Output groups this rank holds (``o_groups / tp_size``)."""
        return self.o_groups // self.tp_size

    def tensor_parallel(self, tp_size: int) -> V4Dims:
        """Per-rank view: ``num_heads / tp_size`` heads and ``o_groups / tp_size`` output groups; every cache,
        the compressors and the indexer are replicated."""
        require_int("tp_size", tp_size, minimum=1)
        if self.num_heads % tp_size or (self.o_groups // self.tp_size) % tp_size:
            raise ValueError(f"tp_size: got {tp_size}; supported a divisor of num_heads={self.num_heads} and of "
                             f"the rank's output groups ({self.local_o_groups})")
        return replace(self, num_heads=self.num_heads // tp_size, tp_size=self.tp_size * tp_size)

    # ---- presets ----------------------------------------------------------------------------------------
    @classmethod
    def deepseek_v4_flash(cls) -> V4Dims:
        """transformers' ``DeepseekV4Config()`` defaults (the V4-Flash attention geometry: 64 heads, hidden
        4096, 43 layers, two HCA layers then CSA/HCA alternating, window 128, top-512)."""
        return replace(cls.from_hf_config({"model_type": _MODEL_TYPE}), name="deepseek-v4-flash")

    @staticmethod
    def is_preset(name: object) -> bool:
        """Whether ``name`` names a V4 preset (``deepseek-v4-flash``, ``v4-flash``, ``v4``; case-insensitive)."""
        return isinstance(name, str) and name.strip().lower().replace("_", "-") in _V4_ALIASES

    @classmethod
    def preset(cls, name: str) -> V4Dims:
        """A preset by name (:meth:`is_preset`)."""
        if not cls.is_preset(name):
            raise ValueError(f"preset: got {name!r}; supported {', '.join(V4_PRESET_NAMES)}")
        return getattr(cls, _V4_ALIASES[name.strip().lower().replace("_", "-")])()

    # ---- Hugging Face configs ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any) -> V4Dims:
        """Build from transformers' ``DeepseekV4Config``, a dict or a ``config.json`` path (or its folder).

        Reads ``layer_types`` (or DeepSeek's per-layer ``compress_ratios``: 0 window-only, the CSA rate, the
        HCA rate), ``compress_rates`` (or ``compress_rate_csa`` / ``compress_rate_hca``), ``sliding_window``,
        ``index_*``, ``o_groups``, ``o_lora_rank``, ``head_dim`` and ``partial_rotary_factor`` (or
        ``qk_rope_head_dim``), ``rope_theta``, ``compress_rope_theta`` and the rotary block (transformers'
        nested ``rope_parameters = {"main": ..., "compress": ...}``, or a flat ``rope_parameters`` /
        ``rope_scaling`` that applies to the compress rotary). Absent keys take ``DeepseekV4Config``'s
        defaults. Refused, naming the field: ``num_key_value_heads != 1``, ``attention_bias``, a rotary type
        other than default/YaRN (and any scaling on the main rotary), unknown layer kinds, and a
        ``num_hidden_layers`` that disagrees with ``layer_types``.
        """
        if isinstance(config, V4Dims):
            return config
        d, source = _as_mapping(config)
        f = ConfigFields(d, source)
        kv_heads = f.integer("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ValueError(f"config.num_key_value_heads: got {kv_heads}; supported 1 (one shared key/value "
                             f"row per token) ({source})")
        if f.flag("attention_bias", False):
            raise ValueError(f"config.attention_bias: got true; supported false (V4 projections have no bias) "
                             f"({source})")
        n = f.integer("num_hidden_layers", 43)
        head_dim = f.integer("head_dim", 512)
        rope_dim = _rope_dim(f, head_dim)
        csa, hca = _compress_rates(f)
        layer_types = _layer_types(f, n, csa, hca)
        main, compress_theta, compress, attention_factor = _rope_blocks(f)
        return cls(
            num_heads=f.integer("num_attention_heads", 64),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=f.integer("q_lora_rank", 1024),
            hidden_size=f.integer("hidden_size", 4096),
            num_layers=n,
            layer_types=layer_types,
            csa_ratio=csa,
            hca_ratio=hca,
            sliding_window=f.integer("sliding_window", 128),
            index_n_heads=f.integer("index_n_heads", 64),
            index_head_dim=f.integer("index_head_dim", 128),
            index_topk=f.integer("index_topk", 512),
            o_groups=f.integer("o_groups", 8),
            o_lora_rank=f.integer("o_lora_rank", 1024),
            rope_theta=main,
            compress_rope_theta=compress_theta,
            compress_rope=compress,
            compress_attention_factor=attention_factor,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
            max_position_embeddings=f.integer("max_position_embeddings", 1048576),
            name=str(d.get("model_type", "custom")),
        )


def _as_mapping(config: Any) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, (str, os.PathLike)):
        return read_config_json(config), os.fspath(config)
    if isinstance(config, Mapping):
        return config, "config dict"
    if hasattr(config, "to_dict"):
        d = config.to_dict()
        if not isinstance(d, Mapping):
            raise TypeError(f"config: got {type(config).__name__}.to_dict() returning {type(d).__name__}; "
                            "supported a mapping")
        return d, type(config).__name__
    raise TypeError(f"config: got {type(config).__name__}; supported a DeepseekV4Config, a dict or a path")


def _rope_dim(f: ConfigFields, head_dim: int) -> int:
    """``qk_rope_head_dim`` when given (DeepSeek's configs), else ``head_dim * partial_rotary_factor``."""
    if f.raw("qk_rope_head_dim") is not None:
        return f.integer("qk_rope_head_dim")
    factor = f.number("partial_rotary_factor", 64 / 512, positive=True)
    dim = head_dim * factor
    if not float(dim).is_integer():
        raise ValueError(f"config.partial_rotary_factor: got {factor!r}; supported a factor giving a whole "
                         f"rotary width of head_dim {head_dim} ({f.source})")
    return int(dim)


def _compress_rates(f: ConfigFields) -> tuple[int, int]:
    rates = f.mapping("compress_rates") or {}
    nf = f.nested(rates, "compress_rates")
    unknown = sorted(set(rates) - {CSA, HCA}, key=str)
    if unknown:
        raise ValueError(f"config.compress_rates: got keys {unknown}; supported {CSA!r}, {HCA!r} ({f.source})")
    csa = nf.integer(CSA, f.integer("compress_rate_csa", 4))
    hca = nf.integer(HCA, f.integer("compress_rate_hca", 128))
    return csa, hca


def _layer_types(f: ConfigFields, n: int, csa: int, hca: int) -> tuple[str, ...]:
    types = f.raw("layer_types")
    legacy = f.raw("compress_ratios")
    if types is None and legacy is not None:
        if isinstance(legacy, (str, bytes)) or not isinstance(legacy, (list, tuple)):
            raise TypeError(f"config.compress_ratios: got {legacy!r}; supported a list of ints ({f.source})")
        by_ratio = {_LEGACY_RATIO_ZERO: SLIDING, csa: CSA, hca: HCA}
        bad = sorted({r for r in legacy if r not in by_ratio or isinstance(r, bool)}, key=repr)
        if bad:
            raise ValueError(f"config.compress_ratios: got {bad}; supported 0 (window only), {csa} (CSA) or "
                             f"{hca} (HCA) ({f.source})")
        types = [by_ratio[r] for r in legacy]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if isinstance(types, (str, bytes)) or not isinstance(types, (list, tuple)):
        raise TypeError(f"config.layer_types: got {types!r}; supported a list of layer kinds ({f.source})")
    bad = sorted({repr(t) for t in types if t not in LAYER_KINDS})
    if bad:
        raise ValueError(f"config.layer_types: got {', '.join(bad)}; supported {', '.join(LAYER_KINDS)} "
                         f"({f.source})")
    if len(types) < n:
        raise ValueError(f"config.layer_types: got {len(types)} entries; supported one per layer "
                         f"(num_hidden_layers {n}) ({f.source})")
    return tuple(types[:n])


def _rope_blocks(f: ConfigFields) -> tuple[float, float, RopeScaling | None, float]:
    """``(main theta, compress theta, compress YaRN or None, compress attention factor)``."""
    main_theta = f.number("rope_theta", 10000.0, positive=True)
    compress_theta = f.number("compress_rope_theta", 160000.0, positive=True)
    params = f.mapping("rope_parameters")
    key = "rope_parameters"
    if not params:
        params, key = f.mapping("rope_scaling"), "rope_scaling"
    params = params or {}
    if isinstance(params.get("main"), Mapping) or isinstance(params.get("compress"), Mapping):
        main = params.get("main") or {}
        mf = f.nested(main, f"{key}.main")
        kind = mf.raw("rope_type", mf.raw("type", "default"))
        if kind != "default":
            raise ValueError(f"config.{key}.main.rope_type: got {kind!r}; supported 'default' (window-only "
                             f"layers use plain RoPE) ({f.source})")
        main_theta = mf.number("rope_theta", main_theta, positive=True)
        block, block_key = params.get("compress") or {}, f"{key}.compress"
    else:
        block, block_key = params, key
    if not isinstance(block, Mapping):
        raise TypeError(f"config.{block_key}: got {type(block).__name__}; supported a mapping ({f.source})")
    bf = f.nested(block, block_key)
    compress_theta = bf.number("rope_theta", compress_theta, positive=True)
    kind = bf.raw("rope_type", bf.raw("type", "default"))
    if kind == "default":
        return main_theta, compress_theta, None, 1.0
    if kind != "yarn":
        raise ValueError(f"config.{block_key}.rope_type: got {kind!r}; supported 'default' or 'yarn' "
                         f"({f.source})")
    max_pos = f.integer("max_position_embeddings", 1048576)
    original = bf.integer("original_max_position_embeddings", 4096)
    factor = bf.number("factor", max_pos / original, positive=True)
    yarn = RopeScaling(type="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=bf.number("beta_fast", 32.0, positive=True) or 32.0,
                       beta_slow=bf.number("beta_slow", 1.0, positive=True) or 1.0)
    # V4 does not scale cos/sin by YaRN's magnitude factor: transformers sets attention_factor = 1 for it
    return main_theta, compress_theta, yarn, bf.number("attention_factor", 1.0, positive=True)
