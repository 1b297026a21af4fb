"""Model and KV-cache dtype names: one place that maps user-facing strings to torch dtypes."""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "accumulate_dtype",
    "lse_dtype",
    "KV_CACHE_DTYPES",
    "FP8_CACHE_DTYPES",
    "RECORD_CACHE_DTYPES",
    "MODEL_DTYPES",
    "canonical_kv_cache_dtype",
    "kv_cache_torch_dtype",
    "parse_model_dtype",
    "dtype_name",
    "resolve_kv_cache_dtype",
]

# cache dtype name -> storage dtype ("auto" follows the model dtype)
_KV_STORAGE: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,  # what "auto" resolves to for a float64 model (reference and conformance runs)
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_KV_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp64": "float64", "double": "float64",
    "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}
KV_CACHE_DTYPES: tuple[str, ...] = tuple(_KV_STORAGE)
FP8_CACHE_DTYPES: frozenset[str] = frozenset({"fp8_e4m3", "fp8_e5m2"})
#: cache dtypes stored as DeepSeek's fp8 records (fp8 values with per-group scales and a bf16 rotary tail, bytes,
#: ``mla_backends.step.records``), not as one element dtype: canonical names that ``KV_CACHE_DTYPES`` (the
#: element dtypes a ``LatentKVCache`` allocates) does not list
RECORD_CACHE_DTYPES: frozenset[str] = frozenset({"fp8_ds_mla"})

_MODEL_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def canonical_kv_cache_dtype(name: str | torch.dtype) -> str:
    """Normalise a cache dtype (``"fp8"``, ``torch.float8_e4m3fn``, ``"bf16"`` ...) to its canonical name."""
    if isinstance(name, torch.dtype):
        for k, v in _KV_STORAGE.items():
            if v == name:
                return k
        raise ValueError(f"kv_cache_dtype: got {name}; supported {', '.join(KV_CACHE_DTYPES)}")
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype: got {type(name).__name__}; supported a str or torch.dtype")
    key = name.strip().lower()
    key = _KV_ALIASES.get(key, key)
    if key in RECORD_CACHE_DTYPES:
        return key
    if key not in _KV_STORAGE:
        raise ValueError(f"kv_cache_dtype: got {name!r}; supported {', '.join(KV_CACHE_DTYPES)}")
    return key


def kv_cache_torch_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a cache: the model dtype for ``auto``, otherwise the named one. Record layouts
    (:data:`RECORD_CACHE_DTYPES`) have no element dtype: ValueError."""
    key = canonical_kv_cache_dtype(name)
    if key in RECORD_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: got {key!r}, a record layout (fp8 values, scales and a bf16 tail in bytes); "
                         f"supported element dtypes {', '.join(KV_CACHE_DTYPES)} here (records: RecordCache)")
    dt = _KV_STORAGE[key]
    return model_dtype if dt is None else dt


def resolve_kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> str:
    """Canonical cache dtype name with ``auto`` replaced by the model dtype's name (record names as they are)."""
    if not isinstance(name, torch.dtype) and canonical_kv_cache_dtype(name) in RECORD_CACHE_DTYPES:
        return canonical_kv_cache_dtype(name)
    return canonical_kv_cache_dtype(kv_cache_torch_dtype(name, model_dtype))


def parse_model_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """Parse a model dtype given as a string or a torch dtype."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: got {dtype}; supported bfloat16, float16, float32, float64")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _MODEL_DTYPES:
        return _MODEL_DTYPES[dtype.lower()]
    raise ValueError(f"dtype: got {dtype!r}; supported bfloat16, float16, float32, float64")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where softmax, norms and products of ``dtype`` inputs accumulate: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the LSE ``forward_mqa`` returns for ``query_dtype`` queries: float64 for float64 queries
    (so that merging partials by LSE, as decode context parallelism does, keeps float64 accuracy), else
    float32."""
    return accumulate_dtype(query_dtype)


#: largest finite float8 e4m3fn value (448): the divisor of amax-based fp8 scales
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
