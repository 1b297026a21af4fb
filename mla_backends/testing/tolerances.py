"""The suite's tolerance policy, in one place: which precision a case is judged at and the tolerance it gets.

A case is judged at the **lower precision** of its query dtype and its cache's storage dtype
(:func:`judged_dtype`): a float32 query over a bfloat16 cache is judged as bfloat16. An fp8 cache counts as
its query dtype: the reference reads the stored fp8 values exactly (dequantised in float64 with the cache's
scale), so what is left to judge is the kernel's dequantisation into, and arithmetic in, the query dtype.

The tolerance is looked up in the backend's declared ``Capabilities.tolerances`` (:func:`tolerance_for`), and
falls back to :data:`~mla_backends.backends.capabilities.DEFAULT_TOLERANCES` for the judged dtype. The defaults and
where each comes from are in ``docs/conformance.md`` ("Declaring tolerances"); :func:`rounding_eps` is the
epsilon the hints measure "within rounding" by (:mod:`.hints`).
"""

from __future__ import annotations

import torch

from ..backends.contract import DEFAULT_TOLERANCES, MLABackend, Tolerance
from ..core.dtypes import FP8_CACHE_DTYPES, dtype_name, kv_cache_torch_dtype, lse_dtype

__all__ = ["judged_dtype", "rounding_eps", "tolerance_for", "lse_tolerance"]


def judged_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The precision a case of ``dtype`` queries over a ``kv_cache_dtype`` cache is judged at: the lower of the
    two (larger epsilon), an fp8 cache counting as ``dtype``."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        return dtype
    storage = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    return storage if torch.finfo(storage).eps > torch.finfo(dtype).eps else dtype


def rounding_eps(dtype: torch.dtype, kv_cache_dtype: str) -> float:
    """Machine epsilon of :func:`judged_dtype` (``2 ** -7`` for bfloat16, ``2 ** -10`` for float16, ...)."""
    return float(torch.finfo(judged_dtype(dtype, kv_cache_dtype)).eps)


def tolerance_for(cls: type[MLABackend], dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, Tolerance]:
    """The tolerance of a case and the key it came from. Looked up in ``capabilities.tolerances`` in this
    order: ``"<dtype>/<cache>"``, ``"<cache>"`` (fp8 only), ``"<judged dtype>"``, then the package default of
    the judged dtype (``"<judged dtype> (default)"``)."""
    tols = cls.capabilities.tolerances or {}
    name = dtype_name(dtype)
    judged = dtype_name(judged_dtype(dtype, kv_cache_dtype))
    keys = [f"{name}/{kv_cache_dtype}"] + ([kv_cache_dtype] if kv_cache_dtype in FP8_CACHE_DTYPES else []) + [judged]
    for key in keys:
        if key in tols:
            return key, tols[key]
    if judged in DEFAULT_TOLERANCES:
        return f"{judged} (default)", DEFAULT_TOLERANCES[judged]
    raise ValueError(
        f"capabilities.tolerances: got no entry for {', '.join(keys)}; supported one per declared dtype"
    )


def lse_tolerance(tol: Tolerance, dtype: torch.dtype = torch.float32) -> Tolerance:
    """The LSE of ``dtype`` queries is ``dtypes.lse_dtype(dtype)`` by contract (float32, float64 for float64):
    its tolerance is the declared one, but never tighter than that dtype's."""
    floor = DEFAULT_TOLERANCES[dtype_name(lse_dtype(dtype))]
    return Tolerance(max(tol.atol, floor.atol), max(tol.rtol, floor.rtol))
