"""What a case is judged against, looked up in the backend's declarations, in one place.

By default nothing: the suite measures each case's honest rounding (:mod:`.rounding`) and judges by multiples
of it (:mod:`.judge`). A backend changes that in two ways, both keyed like ``"<dtype>/<cache dtype>"``
(e.g. ``"bfloat16/fp8_e4m3"``), then the cache dtype alone for fp8 caches (``"fp8_e4m3"``), then the judged
dtype (``"bfloat16"``), the first key found winning:

- ``Capabilities.precision`` (:func:`precision_for`): it accumulates, or stores its LSE, in 16 bits; the honest
  reference is computed that way and the multiples stay;
- ``Capabilities.tolerances`` (:func:`tolerance_for`): an explicit element-wise band, judged instead of the
  measured criteria (for arithmetic the suite cannot emulate: fp8 query products, TF32 dots). An entry equal to
  the entry of the same key in :data:`~mla_backends.backends.capabilities.DEFAULT_TOLERANCES` (the 0.4 bands)
  declares nothing.

A case's *judged* dtype (:func:`judged_dtype`) is the lower precision of its query dtype and its cache's storage
dtype, an fp8 cache counting as its query dtype (its values are exact in any 16-bit dtype): the probabilities of
the honest reference are rounded to it before the value product, and the key lookup ends with it.
"""

from __future__ import annotations

import torch

from ..backends.capabilities import DEFAULT_TOLERANCES, Precision
from ..backends.contract import MLABackend, Tolerance
from ..core.dtypes import FP8_CACHE_DTYPES, accumulate_dtype, dtype_name, kv_cache_torch_dtype, lse_dtype

__all__ = ["judged_dtype", "rounding_eps", "tolerance_for", "precision_for", "lse_tolerance", "lookup_keys"]


def judged_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The lower precision (larger epsilon) of ``dtype`` and the ``kv_cache_dtype`` cache's storage dtype, an fp8
    cache counting as ``dtype``."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        return dtype
    storage = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    return storage if torch.finfo(storage).eps > torch.finfo(dtype).eps else dtype


def rounding_eps(dtype: torch.dtype, kv_cache_dtype: str) -> float:
    """Machine epsilon of :func:`judged_dtype` (``2 ** -7`` for bfloat16, ``2 ** -10`` for float16, ...)."""
    return float(torch.finfo(judged_dtype(dtype, kv_cache_dtype)).eps)


def lookup_keys(dtype: torch.dtype, kv_cache_dtype: str) -> list[str]:
    """The declaration keys of a case, in lookup order: ``"<dtype>/<cache>"``, ``"<cache>"`` (fp8 only),
    ``"<judged dtype>"``."""
    judged = dtype_name(judged_dtype(dtype, kv_cache_dtype))
    fp8 = [kv_cache_dtype] if kv_cache_dtype in FP8_CACHE_DTYPES else []
    return [f"{dtype_name(dtype)}/{kv_cache_dtype}", *fp8, judged]


def tolerance_for(cls: type[MLABackend], dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, Tolerance | None]:
    """The band ``cls`` declares for a case and its key, or ``("<judged dtype> (measured)", None)`` when it
    declares none (entries equal to ``DEFAULT_TOLERANCES``' of the same key declare nothing)."""
    tols = cls.capabilities.tolerances or {}
    keys = lookup_keys(dtype, kv_cache_dtype)
    for key in keys:
        if key in tols and tols[key] != DEFAULT_TOLERANCES.get(key):
            return key, tols[key]
    return f"{keys[-1]} (measured)", None


def precision_for(cls: type[MLABackend], dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, Precision]:
    """The :class:`Precision` ``cls`` declares for a case and its key, else the default (float32 accumulation
    and LSE; float64 for float64 queries) under ``"default"``."""
    declared = cls.capabilities.precision or {}
    for key in lookup_keys(dtype, kv_cache_dtype):
        if key in declared:
            return key, declared[key]
    return "default", Precision(accumulate_dtype(dtype), lse_dtype(dtype))


def lse_tolerance(tol: Tolerance, dtype: torch.dtype = torch.float32) -> Tolerance:
    """The LSE of ``dtype`` queries is ``dtypes.lse_dtype(dtype)`` by contract (float32, float64 for float64):
    under a declared band it is judged by the band, but never tighter than 0.4's band of that dtype."""
    floor = DEFAULT_TOLERANCES[dtype_name(lse_dtype(dtype))]
    return Tolerance(max(tol.atol, floor.atol), max(tol.rtol, floor.rtol))
