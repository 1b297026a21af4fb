"""``select_backend()`` from SGLang's model runner, in SGLang's terms.

Nothing here imports SGLang: the runner's fields (the model's HF config, tensor-parallel size, dtype, cache
dtype name, page size) are passed in as values, so the mapping is unit-tested without SGLang. :mod:`.backend`
calls it once per rank at start-up (the attention backend's constructor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.dims import MLADims
from ...core.validation import require_int
from ..engine_selection import chosen_line, engine_kv_cache_dtype, select_or_raise, startup_who

__all__ = ["SGLangRequest", "SGLangSelectionError", "sglang_kv_cache_dtype", "request_from_runner",
           "startup_line", "SGLANG_KV_NAMES"]

#: SGLang's ``--kv-cache-dtype`` names -> mla-backends' canonical names (``auto``: the model dtype)
SGLANG_KV_NAMES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                   "float16": "float16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


class SGLangSelectionError(RuntimeError):
    """mla-backends cannot run this SGLang configuration (raised at SGLang start-up, with the selection's
    reasons)."""


def sglang_kv_cache_dtype(name: object) -> str:
    """mla-backends' cache dtype name for SGLang's ``server_args.kv_cache_dtype`` ``name``."""
    return engine_kv_cache_dtype(name, SGLANG_KV_NAMES, engine="SGLang", error=SGLangSelectionError,
                                 accepted=f"an SGLang cache dtype name ({', '.join(SGLANG_KV_NAMES)})")


@dataclass(frozen=True)
class SGLangRequest:
    """What one SGLang rank asks of ``select_backend()``: this rank's heads (heads / tensor-parallel size), the
    model dtype, the cache dtype and SGLang's page size (the token-to-KV pool's pages)."""

    dims: MLADims
    dtype: torch.dtype
    kv_cache_dtype: str
    page_size: int
    device: str

    def select(self) -> Any:
        """``select_backend()`` for single-token decode of this request; :class:`SGLangSelectionError` with its
        reasons on refusal (``MLA_BACKEND`` forces a backend: a name, an alias or ``module:Class``)."""
        return select_or_raise(SGLangSelectionError, f"SGLang MLA model ({self.describe()})", dims=self.dims,
                               dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, block_size=self.page_size,
                               device=self.device)

    def describe(self) -> str:
        return (f"{self.dims.num_heads} heads on this rank, kv_lora_rank {self.dims.kv_lora_rank}, rope "
                f"{self.dims.qk_rope_head_dim}, dtype {str(self.dtype).removeprefix('torch.')}, kv cache "
                f"{self.kv_cache_dtype}, page size {self.page_size}, device {self.device}")


def request_from_runner(hf_config: Any, *, tp_size: int, dtype: torch.dtype, kv_cache_dtype: str, page_size: int,
                        device: str) -> SGLangRequest:
    """The request of one SGLang rank: ``MLADims`` from the model's HF config (a config object, dict or path)
    with ``heads // tp_size`` heads, SGLang's ``kv_cache_dtype`` name and ``page_size``."""
    require_int("tp_size", tp_size, minimum=1)
    require_int("page_size", page_size, minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: got {type(dtype).__name__}; supported a torch.dtype (SGLang's model dtype)")
    if not isinstance(device, str) or not device:
        raise TypeError(f"device: got {device!r}; supported a device string such as 'cpu' or 'cuda:0'")
    dims = MLADims.from_hf_config(hf_config)
    dims = dims.tensor_parallel(tp_size)  # ValueError naming tp_size when the heads do not split evenly
    return SGLangRequest(dims=dims, dtype=dtype, kv_cache_dtype=sglang_kv_cache_dtype(kv_cache_dtype),
                         page_size=page_size, device=device)


def startup_line(selection: Any, *, model: str | None = None, num_heads: int | None = None) -> str:
    """The one start-up log line: the model, this rank's heads and the selection's ``Chosen:`` line."""
    return (f"mla-backends: SGLang attention backend mla_backends runs absorbed MLA on mla-backends"
            f"{startup_who(model, num_heads)}. {chosen_line(selection)}")
