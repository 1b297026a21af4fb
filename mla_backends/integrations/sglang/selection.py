"""``select_backend()`` from SGLang's model runner, in SGLang's terms.

Nothing here imports SGLang: the runner's fields (the model's HF config, tensor-parallel size, dtype, cache
dtype name, page size) are passed in as values, so the mapping is unit-tested without SGLang. :mod:`.backend`
calls it once per rank at start-up (the attention backend's constructor).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.dims import MLADims
from ...core.env_switches import SGLANG_SWITCH
from ...core.validation import require_int
from ..engine_core import EngineAdapterError, EngineInfo, EngineRequest, engine_kv_cache_dtype
from ..engine_core import startup_line as core_startup_line
from . import BACKEND_NAME

__all__ = ["ENGINE", "SGLangSelectionError", "sglang_kv_cache_dtype", "request_from_runner", "startup_line",
           "SGLANG_KV_NAMES", "BACKEND_NAME"]

#: SGLang's ``--kv-cache-dtype`` names -> mla-backends' canonical names (``auto``: the model dtype)
SGLANG_KV_NAMES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                   "float16": "float16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


class SGLangSelectionError(EngineAdapterError):
    """mla-backends cannot run this SGLang configuration (raised at SGLang start-up, with the selection's
    reasons, or naming the SGLang internal or scale the adapter cannot use)."""


#: SGLang as the engine-neutral adapter core knows it
ENGINE = EngineInfo(name="SGLang", switch=SGLANG_SWITCH, error=SGLangSelectionError, kv_names=SGLANG_KV_NAMES,
                    page_word="page size", runs="absorbed MLA")


def sglang_kv_cache_dtype(name: object) -> str:
    """mla-backends' cache dtype name for SGLang's ``server_args.kv_cache_dtype`` ``name``."""
    return engine_kv_cache_dtype(ENGINE, name)


def request_from_runner(hf_config: Any, *, tp_size: int, dtype: torch.dtype, kv_cache_dtype: str, page_size: int,
                        device: str) -> EngineRequest:
    """The request of one SGLang rank: ``MLADims`` from the model's HF config (a config object, dict or path)
    with ``heads // tp_size`` heads, the model dtype, SGLang's ``kv_cache_dtype`` name and ``page_size`` (the
    token-to-KV pool's pages)."""
    require_int("tp_size", tp_size, minimum=1)
    require_int("page_size", page_size, minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: got {type(dtype).__name__}; supported a torch.dtype (SGLang's model dtype)")
    if not isinstance(device, str) or not device:
        raise TypeError(f"device: got {device!r}; supported a device string such as 'cpu' or 'cuda:0'")
    dims = MLADims.from_hf_config(hf_config)
    dims = dims.tensor_parallel(tp_size)  # ValueError naming tp_size when the heads do not split evenly
    return EngineRequest(ENGINE, dims=dims, dtype=dtype, kv_cache_dtype=sglang_kv_cache_dtype(kv_cache_dtype),
                         block_size=page_size, device=device)


def startup_line(selection: Any, *, model: str | None = None, num_heads: int | None = None, extra: str = "") -> str:
    """The one start-up log line: the model, this rank's heads, the selection's ``Chosen:`` line and ``extra``."""
    return core_startup_line(ENGINE, BACKEND_NAME, selection, model=model, num_heads=num_heads, extra=extra)
