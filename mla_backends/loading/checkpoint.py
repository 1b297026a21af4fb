"""Checkpoint folders as they are published: ``config.json`` plus safetensors, read one attention layer at a time.

A folder holds either one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``weight_map: tensor name -> shard file``). :class:`Checkpoint` reads layer ``L``'s
``model.layers.{L}.self_attn.*`` tensors lazily through ``safetensors.safe_open``:

- only the shards the index names for those tensors are opened (no other shard, not even its header);
- with tensor parallelism a rank reads only its rows of ``q_b_proj`` / ``q_proj`` / ``kv_b_proj`` and its
  columns of ``o_proj`` through ``get_slice`` (never the full tensor);
- block-quantised fp8 weights (DeepSeek's releases) are dequantised block-aligned, slice by slice, with their
  ``weight_scale_inv`` (:mod:`mla_backends.loading.fp8`);
- every problem (no config, not an MLA model, a missing key or shard, a shard that does not hold what the
  index says, a misshaped tensor) raises ValueError naming the path before anything is handed to a layer.

This module does not import the layer; :meth:`MLAAttention.from_pretrained` and
:func:`mla_backends.layer.pretrained.load_attention_layers` build layers from what it returns.
"""

from __future__ import annotations

import inspect
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.config_fields import load_json_file
from ..core.dims import MLADims, hf_config_value, read_config_json
from ..core.dtypes import parse_model_dtype
from ..core.v4dims import V4Dims, is_v4_config
from ..core.validation import require_device, require_int
from .fp8 import SCALE_SUFFIX, dequantize_block_fp8, weight_block_size_from_config
from .hf import expected_hf_shapes, hf_attention_bias, hf_shard_range
from .v4 import deepseek_name, v4_expected_shapes, v4_layer_prefixes, v4_shard_range

__all__ = ["Checkpoint", "CheckpointError", "read_layer", "INDEX_FILE", "SINGLE_FILE", "attention_prefix",
           "check_load_arguments", "load_layer"]

#: the index of a sharded checkpoint and the single file of an unsharded one (transformers' names)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_FP8_NAMES = ("F8_E4M3", "F8_E5M2")
#: safetensors dtype names of the floating-point tensors read as they are (cast to the layer dtype)
_FLOAT_NAMES = ("F16", "BF16", "F32", "F64")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot give what was asked; the message names the path and what is missing."""


def attention_prefix(layer_idx: int) -> str:
    """``model.layers.{layer_idx}.self_attn.``: where transformers' DeepSeek models keep layer attention."""
    return f"model.layers.{layer_idx}.self_attn."


def _safe_open(file: str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - safetensors ships with transformers
        raise ImportError("reading checkpoints needs safetensors: pip install 'mla-backends[hf]'") from err
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as err:  # safetensors' own error type for a truncated or corrupt header
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from err


class Checkpoint:
    """A checkpoint folder: its config, its tensor -> shard map, and per-layer attention reads.

    Attributes:
        path: the folder. config: the parsed ``config.json``. dims: the full (unsharded) :class:`MLADims`, or
            :class:`~mla_backends.core.v4dims.V4Dims` for DeepSeek-V4 (``is_v4``), whose layers are read under
            transformers' names (``model.layers.{L}.self_attn.``) or DeepSeek's (``layers.{L}.attn.``, renamed).
        weight_map: tensor name -> shard file name (None for a single ``model.safetensors`` until it is
            opened for its keys).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: got {type(path).__name__}; supported a checkpoint folder path (str or PathLike)")
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"path: got {self.path!r}, which is not a folder; supported a checkpoint folder "
                                  "holding config.json and safetensors")
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise CheckpointError(f"{self.path}: no config.json; supported a checkpoint folder holding one")
        self.config: dict[str, Any] = read_config_json(self.path)
        self.is_v4 = is_v4_config(self.config)
        self.dims: MLADims | V4Dims
        try:
            self.dims = V4Dims.from_hf_config(self.config) if self.is_v4 else MLADims.from_hf_config(self.config)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{self.path}: not an MLA model ({err})") from err
        index = os.path.join(self.path, INDEX_FILE)
        self.weight_map: dict[str, str] | None
        if os.path.isfile(index):
            try:
                parsed = load_json_file(index)
            except ValueError as err:  # unreadable, not JSON, nested too deeply
                raise CheckpointError(f"{index}: not a readable JSON index ({err})") from None
            wm = parsed.get("weight_map") if isinstance(parsed, Mapping) else None
            if not isinstance(wm, Mapping):
                raise CheckpointError(f"{index}: no weight_map; supported a safetensors index")
            self.weight_map = {str(k): str(v) for k, v in wm.items()}
            outside = sorted({v for v in self.weight_map.values()
                              if os.path.basename(v) != v or v in ("", ".", "..")})
            if outside:  # shards live in the folder itself: no paths, so an index cannot point outside it
                raise CheckpointError(f"{index}: got shard names {outside}; supported plain file names in "
                                      f"{self.path}")
        elif os.path.isfile(os.path.join(self.path, SINGLE_FILE)):
            self.weight_map = None
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} and no {INDEX_FILE}; supported a folder of "
                                  "safetensors weights")

    # ---- config ------------------------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        """Whether the config declares fp8 weights (``quantization_config.quant_method == "fp8"``)."""
        quant = hf_config_value(self.config, "quantization_config")
        return isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8"

    def resolve_dtype(self, dtype: str | torch.dtype | None) -> torch.dtype:
        """``dtype``, or the checkpoint's own when None: ``torch_dtype`` / ``dtype`` of the config; bfloat16
        for fp8 checkpoints (their weights are dequantised)."""
        if dtype is not None:
            return parse_model_dtype(dtype)
        if self.is_fp8:
            return torch.bfloat16
        own = hf_config_value(self.config, "torch_dtype") or hf_config_value(self.config, "dtype") or "bfloat16"
        return parse_model_dtype(str(own).removeprefix("torch."))

    @property
    def num_layers(self) -> int:
        return self.dims.num_layers

    # ---- keys ----------------------------------------------------------------------------------------------
    def _expected(self, dims: Any, layer_idx: int) -> dict[str, tuple[int, ...]]:
        """Full shapes of layer ``layer_idx``'s attention tensors under transformers' names."""
        if self.is_v4:
            return v4_expected_shapes(dims, layer_idx)
        return expected_hf_shapes(dims, hf_attention_bias(self.config))

    def _shard_range(self, name: str, dims: Any, tp_rank: int) -> tuple[int, int, int] | None:
        return v4_shard_range(name, dims, tp_rank) if self.is_v4 else hf_shard_range(name, dims, tp_rank)

    def _prefix(self, layer_idx: int) -> tuple[str, Callable[[str], str]]:
        """``(prefix, rename)``: where layer ``layer_idx``'s attention tensors live and how a name after the
        prefix becomes transformers' (DeepSeek-V4 checkpoints in DeepSeek's own naming are renamed)."""
        if not self.is_v4:
            return attention_prefix(layer_idx), str
        ours, *theirs = v4_layer_prefixes(layer_idx)
        keys = self.weight_map or {}
        found = next((p for p in (ours, *theirs) if any(k.startswith(p) for k in keys)), ours)
        return found, (str if found == ours else deepseek_name)

    def layer_files(self, layer_idx: int) -> dict[str, str]:
        """``tensor name -> shard file name`` of layer ``layer_idx``'s attention (full names)."""
        require_int("layer_idx", layer_idx, minimum=0)
        if layer_idx >= self.num_layers:
            raise ValueError(f"layer_idx: got {layer_idx}; supported 0..{self.num_layers - 1} "
                             f"({self.path} has {self.num_layers} layers)")
        if self.weight_map is None:
            with _safe_open(os.path.join(self.path, SINGLE_FILE)) as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        prefix, rename = self._prefix(layer_idx)
        out = {k: v for k, v in self.weight_map.items() if k.startswith(prefix)}
        held = {rename(k[len(prefix):]) for k in out}
        missing = [prefix + n for n in self._expected(self.dims, layer_idx) if n not in held]
        if missing:
            where = INDEX_FILE if os.path.isfile(os.path.join(self.path, INDEX_FILE)) else SINGLE_FILE
            raise CheckpointError(f"{self.path}: layer {layer_idx} has no {missing} (in its {where})")
        absent = sorted({s for s in out.values() if not os.path.isfile(os.path.join(self.path, s))})
        if absent:
            raise CheckpointError(f"{self.path}: missing shard(s) {absent} holding layer {layer_idx}'s attention")
        return out

    # ---- reads ---------------------------------------------------------------------------------------------
    def read_attention_layer(self, layer_idx: int, *, tp_rank: int = 0, tp_size: int = 1,
                             dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Layer ``layer_idx``'s attention tensors for rank ``tp_rank`` of ``tp_size``, names without the
        ``model.layers.{L}.self_attn.`` prefix, in ``dtype`` (default :meth:`resolve_dtype`), on the CPU.

        Sliced tensors have the rank's shapes (``mla_backends.loading.hf.rank_hf_shapes``); fp8 weights come back
        dequantised and their ``weight_scale_inv`` are consumed. Raises :class:`CheckpointError`.
        """
        out_dtype = self.resolve_dtype(dtype)
        dims = self.dims.tensor_parallel(tp_size)
        require_int("tp_rank", tp_rank, minimum=0)
        if tp_rank >= tp_size:
            raise ValueError(f"tp_rank: got {tp_rank}; supported 0..{tp_size - 1} (tp_size {tp_size})")
        files = self.layer_files(layer_idx)
        prefix, rename = self._prefix(layer_idx)
        expected = self._expected(dims, layer_idx)
        names = {key: rename(key[len(prefix):]) for key in files}  # transformers' names
        scales = {name: key for key, name in names.items() if name.endswith(SCALE_SUFFIX)}
        block = weight_block_size_from_config(self.config)
        by_shard: dict[str, list[str]] = defaultdict(list)
        for key, shard in files.items():
            by_shard[shard].append(key)
        out: dict[str, torch.Tensor] = {}
        for shard, keys in sorted(by_shard.items()):
            file = os.path.join(self.path, shard)
            with _safe_open(file) as f:
                held = set(f.keys())
                lost = sorted(k for k in keys if k not in held)
                if lost:
                    raise CheckpointError(f"{file}: does not hold {lost}, which the index puts there")
                for key in keys:
                    name = names[key]
                    if name.endswith(SCALE_SUFFIX):
                        continue  # read with its weight
                    scale_key = scales.get(name[: -len("weight")] + SCALE_SUFFIX) if name.endswith("weight") else None
                    out[name] = self._read(f, file, key, name, expected.get(name), dims, tp_rank, block,
                                           out_dtype, scale_key, files)
        return out

    def _read(self, f: Any, file: str, key: str, name: str, want: tuple[int, ...] | None, dims: MLADims,
              tp_rank: int, block: tuple[int, int], dtype: torch.dtype, scale_key: str | None,
              files: Mapping[str, str]) -> torch.Tensor:
        """One tensor: its rank slice (block-aligned and dequantised for fp8), as ``dtype``."""
        sl = f.get_slice(key)
        shape = tuple(sl.get_shape())
        if want is not None and shape != want:
            raise CheckpointError(f"{file}: {key} has shape {list(shape)}; supported {list(want)}")
        stored = sl.get_dtype()
        if stored not in _FLOAT_NAMES + _FP8_NAMES:  # an int32 or bool weight is not cast into a layer
            raise CheckpointError(f"{file}: {key} is stored as {stored}; supported floating point "
                                  f"({', '.join(_FLOAT_NAMES)}) or fp8 ({', '.join(_FP8_NAMES)}) with its "
                                  f"{SCALE_SUFFIX}")
        fp8 = stored in _FP8_NAMES
        if fp8 and scale_key is None:
            raise CheckpointError(f"{file}: {key} is {sl.get_dtype()} without its {SCALE_SUFFIX}")
        rng = self._shard_range(name, dims, tp_rank)
        dim, start, stop = rng if rng is not None else (0, 0, shape[0])
        if not fp8:
            return (sl[start:stop] if dim == 0 else sl[:, start:stop]).to(dtype)
        scale_file = os.path.join(self.path, files[scale_key])
        bsz = block[dim]
        lo, hi = start // bsz * bsz, min(-(-stop // bsz) * bsz, shape[dim])  # whole blocks around the slice
        if scale_file == file:
            return self._dequant(f, sl, scale_key, dim, lo, hi, start, stop, bsz, block, dtype)
        with _safe_open(scale_file) as g:
            return self._dequant(g, sl, scale_key, dim, lo, hi, start, stop, bsz, block, dtype)

    @staticmethod
    def _dequant(f: Any, sl: Any, scale_key: str, dim: int, lo: int, hi: int, start: int, stop: int, bsz: int,
                 block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        s = f.get_slice(scale_key)
        want = [-(-n // b) for n, b in zip(sl.get_shape(), block, strict=True)]  # the full scale, every rank
        if list(s.get_shape()) != want:
            raise CheckpointError(f"{scale_key}: got shape {list(s.get_shape())}; supported {want} (weight "
                                  f"{list(sl.get_shape())} in blocks of {list(block)})")
        b0, b1 = lo // bsz, -(-hi // bsz)
        if dim == 0:
            w, scale = sl[lo:hi], s[b0:b1]
        else:
            w, scale = sl[:, lo:hi], s[:, b0:b1]
        try:
            full = dequantize_block_fp8(w, scale, block, dtype)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{scale_key}: {err}") from err
        return full.narrow(dim, start - lo, stop - start).contiguous()


#: the keywords :meth:`MLAAttention.from_pretrained` and ``load_attention_layers`` set themselves
_LOADER_KEYWORDS = ("config", "dtype", "tp_rank", "tp_size", "layer_idx")


def check_load_arguments(builder: Callable[..., Any], *, layer_idx: int | None = None, dtype: Any = None,
                         tp_rank: int = 0, tp_size: int = 1, options: dict[str, Any] | None = None) -> None:
    """The checks a checkpoint loader makes before it opens the checkpoint: ``layer_idx`` an int >= 0 (None:
    not given), ``dtype`` a model dtype or None, ``tp_size`` >= 1 and ``0 <= tp_rank < tp_size``, every key of
    ``options`` a keyword of ``builder`` (``MLAAttention.from_hf_config``; a misspelt one is a TypeError naming
    it), and ``options["device"]`` a device present here. TypeError/ValueError naming the argument."""
    if layer_idx is not None:
        require_int("layer_idx", layer_idx, minimum=0)
    if dtype is not None:
        parse_model_dtype(dtype)
    require_int("tp_size", tp_size, minimum=1)
    require_int("tp_rank", tp_rank, minimum=0)
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank: got {tp_rank}; supported 0..{tp_size - 1} (tp_size {tp_size})")
    options = options or {}
    known = [n for n in inspect.signature(builder).parameters if n not in _LOADER_KEYWORDS]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"options: got unexpected keyword(s) {unknown}; supported {', '.join(known)} "
                        "(passed to MLAAttention.from_hf_config)")
    if options.get("device") is not None:
        require_device("device", options["device"])


def load_layer(cls: Any, path: str | os.PathLike, layer_idx: int, *, dtype: str | torch.dtype | None = None,
               tp_rank: int = 0, tp_size: int = 1, **options: Any) -> Any:
    """``cls.from_pretrained`` (``cls``: :class:`~mla_backends.layer.attention.MLAAttention` or a subclass): the
    arguments that need no checkpoint checked before it is opened (:func:`check_load_arguments`), then ``layer_idx``
    against its layers and keys, then the layer built from the config (``backend``, ``dispatch`` ...,
    ``tp_size`` against the heads), and only then its tensors read and loaded."""
    check_load_arguments(cls.from_hf_config, layer_idx=layer_idx, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                         options=options)
    ckpt = Checkpoint(path)  # config.json and the index, no tensors
    ckpt.layer_files(layer_idx)  # in range, every key and shard there (a single file: its header)
    out_dtype = ckpt.resolve_dtype(dtype)
    layer = cls.from_hf_config(ckpt.config, dtype=out_dtype, tp_rank=tp_rank, tp_size=tp_size, layer_idx=layer_idx,
                               **options)
    layer.load_hf_state_dict(ckpt.read_attention_layer(layer_idx, tp_rank=tp_rank, tp_size=tp_size, dtype=out_dtype),
                             sharded=True)
    return layer


def read_layer(path: str | os.PathLike, layer_idx: int, *, dtype: str | torch.dtype | None = None, tp_rank: int = 0,
               tp_size: int = 1) -> tuple[dict[str, Any], torch.dtype, dict[str, torch.Tensor]]:
    """``(config, dtype, rank state dict)`` of layer ``layer_idx`` of the checkpoint folder ``path``:
    only its shards are opened, only rank ``tp_rank``'s slices read, fp8 weights dequantised to ``dtype``
    (None: the checkpoint's own, bfloat16 for fp8). Load with ``load_hf_state_dict(state, sharded=True)``."""
    ckpt = Checkpoint(path)
    out_dtype = ckpt.resolve_dtype(dtype)
    state = ckpt.read_attention_layer(layer_idx, tp_rank=tp_rank, tp_size=tp_size, dtype=out_dtype)
    return ckpt.config, out_dtype, state
