"""``select_backend()`` from vLLM's configuration, and what the chosen backend declares, in vLLM's terms.

Nothing here imports vLLM: the configuration is read by attribute (``vllm_config.model_config`` ...), so the
mapping is unit-tested without vLLM. :mod:`.backend` calls it at start-up (every MLA layer's impl, and vLLM's
backend validation on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...backends.contract import Capabilities
from ...core.dims import MLADims
from ...core.dtypes import FP8_CACHE_DTYPES

__all__ = ["VLLMRequest", "Declarations", "VLLMSelectionError", "vllm_kv_cache_dtype", "request_from_vllm",
           "select_for_vllm", "declarations", "startup_line", "VLLM_KV_NAMES"]

#: vLLM cache dtype names -> mla-backends' canonical names (``auto`` stays ``auto``: the model dtype)
_FROM_VLLM = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "fp8": "fp8_e4m3",
              "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: mla-backends' canonical names -> the vLLM names that mean them
VLLM_KV_NAMES = {"bfloat16": ("bfloat16",), "float16": ("float16",), "fp8_e4m3": ("fp8", "fp8_e4m3"),
                 "fp8_e5m2": ("fp8_e5m2",)}


class VLLMSelectionError(RuntimeError):
    """mla-backends cannot run this vLLM configuration (raised at vLLM start-up, with the selection's
    reasons)."""


def vllm_kv_cache_dtype(name: object) -> str:
    """mla-backends' cache dtype name for vLLM's ``cache_config.cache_dtype`` ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype: got {type(name).__name__}; supported a vLLM cache dtype name")
    key = _FROM_VLLM.get(name.strip().lower())
    if key is None:
        raise VLLMSelectionError(f"kv cache dtype: got vLLM's {name!r}; supported {', '.join(_FROM_VLLM)} "
                                 "(mla-backends' paged latent cache formats)")
    return key


@dataclass(frozen=True)
class VLLMRequest:
    """What one vLLM MLA layer asks of ``select_backend()`` (per-rank heads; the kernel sees ``dims.num_heads``
    query heads, times the DCP group size under decode context parallelism)."""

    dims: MLADims
    dtype: torch.dtype
    kv_cache_dtype: str
    block_size: int | None
    need_lse: bool
    device: str

    def select(self) -> Any:
        """``select_backend()`` for this request; :class:`VLLMSelectionError` with its reasons on refusal."""
        from selector import select_backend
        from selector.select import SelectionError

        from ...plugins.registry import UnknownBackendError

        try:
            return select_backend(self.dims, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                                  block_size=self.block_size, device=self.device, need_lse=self.need_lse)
        except (SelectionError, UnknownBackendError, ValueError, TypeError) as exc:
            raise VLLMSelectionError(f"mla-backends cannot run this vLLM MLA model ({self.describe()}): "
                                     f"{exc}") from exc

    def describe(self) -> str:
        bs = "vLLM's choice" if self.block_size is None else str(self.block_size)
        return (f"{self.dims.num_heads} heads, kv_lora_rank {self.dims.kv_lora_rank}, rope "
                f"{self.dims.qk_rope_head_dim}, dtype {str(self.dtype).removeprefix('torch.')}, kv cache "
                f"{self.kv_cache_dtype}, block size {bs}, device {self.device}")


def request_from_vllm(vllm_config: Any, *, device: str, num_heads: int | None = None) -> VLLMRequest:
    """The request of ``vllm_config``'s MLA layers: ``MLADims`` from the model's HF text config with this rank's
    heads (``num_heads``, default heads / tensor-parallel size), the model dtype, vLLM's cache dtype and block
    size (None when vLLM has not fixed it yet), and an LSE when decode context parallelism is on."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dims = MLADims.from_hf_config(model.hf_text_config)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    heads = num_heads if num_heads is not None else dims.num_heads // tp
    dims = replace(dims, num_heads=heads * dcp, tp_size=max(1, tp // dcp))
    block = getattr(cache, "block_size", None)
    return VLLMRequest(dims=dims, dtype=model.dtype, kv_cache_dtype=vllm_kv_cache_dtype(cache.cache_dtype),
                       block_size=int(block) if block else None, need_lse=dcp > 1, device=device)


def select_for_vllm(vllm_config: Any, *, device: str, num_heads: int | None = None) -> Any:
    """``select_backend()``'s :class:`~selector.select.Selection` for ``vllm_config`` (cached by the selector)."""
    return request_from_vllm(vllm_config, device=device, num_heads=num_heads).select()


def startup_line(member: str, selection: Any) -> str:
    """The one start-up log line: the vLLM member taken and the selection's ``Chosen:`` line."""
    chosen = next((ln.strip() for ln in selection.explain().splitlines() if ln.strip().startswith("Chosen:")),
                  f"Chosen: {selection.name}")
    return f"mla-backends: vLLM attention backend {member} runs MLA decode on mla-backends. {chosen}"


@dataclass(frozen=True)
class Declarations:
    """A backend's :class:`~mla_backends.backends.contract.Capabilities` as vLLM's attention backend reads them.

    ``head_sizes`` empty and ``block_size_multiple`` 1 mean "any"; ``block_sizes`` lists explicit page sizes
    (the preferred one first); ``kv_cache_dtypes`` uses vLLM's names (``auto`` whenever one of the model
    dtypes can be cached as itself).
    """

    dtypes: tuple[torch.dtype, ...]
    kv_cache_dtypes: tuple[str, ...]
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    block_size_multiple: int | None
    returns_lse: bool
    cuda_graphs: bool


def declarations(caps: Capabilities) -> Declarations:
    """What vLLM is told for ``caps`` (supported dtypes, cache dtypes, head sizes, kernel block sizes, LSE,
    CUDA graphs: the last only when ``caps.cuda_graphs``)."""
    if not isinstance(caps, Capabilities):
        raise TypeError(f"caps: got {type(caps).__name__}; supported Capabilities")
    order = (torch.float16, torch.bfloat16, torch.float32)
    dtypes = tuple(d for d in order if d in caps.dtypes)
    kv: list[str] = []
    if any(str(d).removeprefix("torch.") in caps.kv_cache_dtypes for d in dtypes):
        kv.append("auto")
    for name in ("bfloat16", "float16", *sorted(FP8_CACHE_DTYPES)):
        if name in caps.kv_cache_dtypes:
            kv += [n for n in VLLM_KV_NAMES.get(name, ()) if n not in kv]
    heads = tuple(sorted(a + b for a, b in caps.dims)) if caps.dims is not None else ()
    if caps.page_sizes is not None:
        pref = caps.preferred_page_size
        sizes = (pref, *sorted(p for p in caps.page_sizes if p != pref))
        multiple = None
    else:
        sizes, multiple = (), caps.page_size_multiple or 1
    return Declarations(dtypes=dtypes, kv_cache_dtypes=tuple(kv), head_sizes=heads, block_sizes=sizes,
                        block_size_multiple=multiple, returns_lse=caps.returns_lse, cuda_graphs=caps.cuda_graphs)
