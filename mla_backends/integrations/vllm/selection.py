"""``select_backend()`` from vLLM's configuration, and what the chosen backend declares, in vLLM's terms.

Nothing here imports vLLM: the configuration is read by attribute (``vllm_config.model_config`` ...), so the
mapping is unit-tested without vLLM. :mod:`.backend` calls it at start-up (every MLA layer's impl, and vLLM's
backend validation on CUDA).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...backends.contract import Capabilities
from ...core.dims import MLADims
from ...core.dtypes import FP8_CACHE_DTYPES
from ...core.env_switches import VLLM_SWITCH
from ..engine_core import FP8_STORAGE, EngineAdapterError, EngineInfo, EngineRequest, engine_kv_cache_dtype
from ..engine_core import startup_line as core_startup_line

__all__ = ["ENGINE", "Declarations", "VLLMSelectionError", "vllm_kv_cache_dtype", "request_from_vllm",
           "select_for_vllm", "declarations", "startup_line", "VLLM_KV_NAMES", "VLLMPath", "vllm_path",
           "path_reasons", "intersect", "select_at_startup", "fp8_cache_view_dtype"]

#: vLLM cache dtype names -> mla-backends' canonical names (``auto`` stays ``auto``: the model dtype)
_FROM_VLLM = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "fp8": "fp8_e4m3",
              "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: mla-backends' canonical names -> the vLLM names that mean them
VLLM_KV_NAMES = {"bfloat16": ("bfloat16",), "float16": ("float16",), "fp8_e4m3": ("fp8", "fp8_e4m3"),
                 "fp8_e5m2": ("fp8_e5m2",)}


class VLLMSelectionError(EngineAdapterError):
    """mla-backends cannot run this vLLM configuration (raised at vLLM start-up, with the selection's
    reasons)."""


#: vLLM as the engine-neutral adapter core knows it
ENGINE = EngineInfo(name="vLLM", switch=VLLM_SWITCH, error=VLLMSelectionError, kv_names=_FROM_VLLM,
                    page_word="block size", runs="MLA decode")


def __getattr__(name: str) -> Any:
    """``VLLMRequest``, the 0.3/0.4 name of a vLLM model's request: now the engine-neutral
    :class:`~mla_backends.integrations.engine_core.EngineRequest` (kept, with a warning, until 0.6)."""
    if name == "VLLMRequest":
        warnings.warn("mla_backends.integrations.vllm.selection.VLLMRequest is deprecated and removed in 0.6; use "
                      "mla_backends.integrations.engine_core.EngineRequest (the same class)", DeprecationWarning,
                      stacklevel=2)
        return EngineRequest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vllm_kv_cache_dtype(name: object) -> str:
    """mla-backends' cache dtype name for vLLM's ``cache_config.cache_dtype`` ``name``."""
    return engine_kv_cache_dtype(ENGINE, name)


def request_from_vllm(vllm_config: Any, *, device: str, num_heads: int | None = None) -> EngineRequest:
    """The request of ``vllm_config``'s MLA layers: ``MLADims`` from the model's HF text config with this rank's
    heads (``num_heads``, default heads / tensor-parallel size; the kernel sees them times the DCP group size under
    decode context parallelism), the model dtype, vLLM's cache dtype and block size (None when vLLM has not
    fixed it yet), and an LSE when decode context parallelism is on."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dims = MLADims.from_hf_config(model.hf_text_config)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    heads = num_heads if num_heads is not None else dims.num_heads // tp
    dims = replace(dims, num_heads=heads * dcp, tp_size=max(1, tp // dcp))
    block = getattr(cache, "block_size", None)
    return EngineRequest(ENGINE, dims=dims, dtype=model.dtype, kv_cache_dtype=vllm_kv_cache_dtype(cache.cache_dtype),
                         block_size=int(block) if block else None, need_lse=dcp > 1, device=device)


def select_for_vllm(vllm_config: Any, *, device: str, num_heads: int | None = None) -> Any:
    """``select_backend()``'s :class:`~selector.select.Selection` for ``vllm_config`` (cached by the selector)."""
    return request_from_vllm(vllm_config, device=device, num_heads=num_heads).select()


def startup_line(member: str, selection: Any, *, model: str | None = None, num_heads: int | None = None) -> str:
    """The one start-up log line: the model, this rank's query heads, the vLLM member taken and the selection's
    ``Chosen:`` line (two models in one process, or two head counts, each get their own line)."""
    return core_startup_line(ENGINE, member, selection, model=model, num_heads=num_heads)


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


def fp8_cache_view_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 dtype a layer cache of vLLM's ``kv_cache_dtype`` (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) holds,
    whatever view vLLM hands over (0.32 views every fp8 cache as its platform's e4m3 type before decode); None
    for a non-fp8 cache."""
    return FP8_STORAGE.get(vllm_kv_cache_dtype(kv_cache_dtype))


@dataclass(frozen=True)
class VLLMPath:
    """What vLLM's own MLA code around the backend takes on one platform (its metadata, prefill, cache
    writes), in mla-backends' names: ``block_sizes`` empty means any; ``kv_cache_dtypes`` canonical names plus
    ``auto``. ``why`` says, per field, which part of vLLM sets the limit."""

    platform: str
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    kv_cache_dtypes: tuple[str, ...]
    why: dict[str, str]


def vllm_path(platform: str, *, head_sizes: tuple[int, ...], fp8_dtype: torch.dtype = torch.float8_e4m3fn
              ) -> VLLMPath:
    """vLLM's path on ``platform`` (``"CPU"`` or a GPU platform's name): ``head_sizes`` is what vLLM's
    ``MLACommonMetadata`` accepts (``MLACommonBackend.get_supported_head_sizes()``, read from vLLM by the
    caller), ``fp8_dtype`` the platform's ``current_platform.fp8_dtype()``.

    CPU: block size 16 (the CPU platform forces it for MLA models), float16/bfloat16/float32 (vLLM's CPU MLA
    impl, whose SDPA prefill the plugin keeps), caches ``auto``/bfloat16/float16 and both fp8 formats (the
    plugin quantises fp8 rows itself, as ``LatentKVCache.write`` does; vLLM's CPU write cannot). GPU: any block
    size, float16/bfloat16 (vLLM's MLA prefill kernels), caches ``auto``/bfloat16/float16, ``fp8_e5m2`` and
    ``fp8_e4m3`` only where the platform's fp8 type is ``float8_e4m3fn`` (what mla-backends reads: ROCm's
    ``float8_e4m3fnuz`` would be misread).
    """
    heads = tuple(sorted(int(h) for h in head_sizes))
    why = {"head size": "vLLM's MLACommonMetadata"}
    if platform.upper() == "CPU":
        why.update({"block size": "vLLM's CPU platform forces 16 for MLA models",
                    "dtype": "vLLM's CPU MLA impl (SDPA prefill)",
                    "kv cache dtype": "vLLM's CPU MLA cache write, fp8 rows written by the plugin"})
        return VLLMPath("CPU", heads, (16,), (torch.float16, torch.bfloat16, torch.float32),
                        ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"), why)
    kv = ["auto", "bfloat16", "float16", "fp8_e5m2"]
    note = "vLLM's MLA cache write"
    if fp8_dtype == torch.float8_e4m3fn:
        kv.insert(3, "fp8_e4m3")
    else:
        note += (f"; fp8_e4m3 caches are {str(fp8_dtype).removeprefix('torch.')} on this platform, which "
                 "mla-backends does not read")
    why.update({"dtype": "vLLM's MLA prefill kernels", "kv cache dtype": note})
    return VLLMPath(platform, heads, (), (torch.float16, torch.bfloat16), tuple(kv), why)


def _names(values: tuple[Any, ...]) -> str:
    return ", ".join(str(v).removeprefix("torch.") for v in values) if values else "any"


def _fields(request: EngineRequest) -> list[tuple[str, Any, str]]:
    """(field, value, text) of the request for :func:`path_reasons`."""
    d = request.dims
    width = d.kv_lora_rank + d.qk_rope_head_dim
    out = [("head size", width, f"{width} (kv_lora_rank {d.kv_lora_rank} + rope {d.qk_rope_head_dim})"),
           ("dtype", request.dtype, str(request.dtype).removeprefix("torch.")),
           ("kv cache dtype", request.kv_cache_dtype, request.kv_cache_dtype)]
    if request.block_size is not None:
        out.insert(1, ("block size", request.block_size, str(request.block_size)))
    return out


def _path_values(path: VLLMPath, field: str) -> tuple[Any, ...]:
    return {"head size": path.head_sizes, "block size": path.block_sizes, "dtype": path.dtypes,
            "kv cache dtype": path.kv_cache_dtypes}[field]


def _backend_values(decl: Declarations, field: str) -> tuple[Any, ...]:
    if field == "block size":
        return decl.block_sizes
    if field == "kv cache dtype":  # back to canonical names
        return tuple(dict.fromkeys(vllm_kv_cache_dtype(n) for n in decl.kv_cache_dtypes))
    return {"head size": decl.head_sizes, "dtype": decl.dtypes}[field]


def path_reasons(request: EngineRequest, path: VLLMPath, decl: Declarations | None = None,
                 backend: str | None = None) -> list[str]:
    """Every field of ``request`` vLLM's ``path`` cannot take, as "<field>: got X; supported A by vLLM's MLA
    path on P (why)[, B by backend]" (``decl``: the selected backend's declarations, for the second part)."""
    out = []
    for field, value, text in _fields(request):
        allowed = _path_values(path, field)
        if not allowed or value in allowed:
            continue
        msg = (f"{field}: got {text}; supported {_names(allowed)} by vLLM's MLA path on {path.platform} "
               f"({path.why.get(field, 'vLLM')})")
        if decl is not None:
            msg += f", {_names(_backend_values(decl, field))} by {backend or 'the selected backend'}"
        out.append(msg)
    return out


def intersect(decl: Declarations, path: VLLMPath) -> Declarations:
    """``decl`` narrowed to what vLLM's ``path`` also takes: what the backend tells vLLM is what can run."""
    def both(mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> tuple[Any, ...]:
        if not theirs:
            return mine
        if not mine:
            return theirs
        return tuple(v for v in mine if v in theirs)

    kv = tuple(n for n in decl.kv_cache_dtypes if vllm_kv_cache_dtype(n) in path.kv_cache_dtypes)
    blocks, multiple = decl.block_sizes, decl.block_size_multiple
    if path.block_sizes:
        if multiple is not None:
            blocks = tuple(b for b in path.block_sizes if b % multiple == 0)
        else:
            blocks = both(decl.block_sizes, path.block_sizes)
        multiple = None
    return replace(decl, dtypes=both(decl.dtypes, path.dtypes), kv_cache_dtypes=kv,
                   head_sizes=both(decl.head_sizes, path.head_sizes), block_sizes=blocks,
                   block_size_multiple=multiple)


def select_at_startup(request: EngineRequest, path: VLLMPath) -> Any:
    """``request.select()`` where vLLM's ``path`` also takes the request; otherwise
    :class:`VLLMSelectionError` with both sides' reasons (the selection's, and every field vLLM's path
    refuses, with what each side supports)."""
    try:
        sel = request.select()
    except VLLMSelectionError as exc:
        reasons = path_reasons(request, path)
        if reasons:
            raise VLLMSelectionError(f"{exc}\nvLLM's own MLA path on {path.platform} refuses it too: "
                                     + "; ".join(reasons)) from exc
        raise
    reasons = path_reasons(request, path, declarations(sel.backend.capabilities), sel.name)
    if reasons:
        raise VLLMSelectionError(
            f"mla-backends cannot run this vLLM MLA model ({request.describe()}): the selected backend "
            f"{sel.name} takes it, but vLLM's own MLA path on {path.platform} around it does not: "
            + "; ".join(reasons))
    return sel
