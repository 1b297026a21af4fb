"""Other projects' names for our backends, as data: vLLM's and SGLang's spellings accepted as aliases.

A user coming from vLLM (``VLLM_ATTENTION_BACKEND=CUTLASS_MLA``) or SGLang (``--attention-backend
trtllm_mla``) may type the name they know wherever this package takes a backend name (``backend=``,
``MLA_BACKEND``, ``--backend``, ``get_backend``, ``mla-backends conformance``). An alias is listed only where
both names run the same kernel. Resolution is case-insensitive and a *registered* backend's own name always
wins over an alias (a plugin may register ``CUTLASS_MLA`` and get it).

One name means different kernels here and in vLLM: vLLM's ``FLASHINFER_MLA`` is FlashInfer's trtllm-gen
decode (SM100), ours is FlashInfer's fa2/fa3 paged wrapper (SM80-SM90). Ours wins; :func:`name_clash_note`
gives the hint the selector adds when it is forced on SM100.

``docs/selection.md`` renders :data:`BACKEND_ALIASES` and :data:`NOT_PROVIDED` as its table of
correspondences. This module imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackendAlias", "NameClash", "BACKEND_ALIASES", "NAME_CLASHES", "NOT_PROVIDED", "alias_target",
           "alias_names", "alias_note", "name_clash_note", "not_provided_note"]


@dataclass(frozen=True)
class BackendAlias:
    """One of our backends and the names vLLM and SGLang give the same kernel.

    Attributes:
        ours: our registered name (``"FLASHINFER_MLA_CUTLASS"``).
        vllm: vLLM's ``AttentionBackendEnum`` names accepted as aliases (empty: none, or a clash).
        sglang: SGLang's ``--attention-backend`` values accepted as aliases.
        note: what the correspondence means where a word is needed (shown in docs/selection.md).
    """

    ours: str
    vllm: tuple[str, ...] = ()
    sglang: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class NameClash:
    """A name that is ours *and* another project's for a different kernel (ours wins; this explains it).

    ``compute_capability_majors``: the architectures where the other project's meaning applies (the hint is
    shown only there). ``theirs``: our backend that runs what the other project means.
    """

    name: str
    project: str
    theirs: str
    compute_capability_majors: tuple[int, ...]
    text: str


#: our backends and their names elsewhere; the ladder order of docs/selection.md
BACKEND_ALIASES: tuple[BackendAlias, ...] = (
    BackendAlias("CPU_FUSED", ("CPU_MLA",), (),
                 "a compiled C++ CPU MLA decode in each project (different source and design, same role); "
                 "forcing it needs the kernel built here (`mla-backends build`)"),
    BackendAlias("REF_TORCH", (), ("torch_native",),
                 "plain PyTorch in both; SGLang's is its own code, not this reference"),
    BackendAlias("TRITON_MLA", ("TRITON_MLA",), ("triton",),
                 "a Triton split-KV decode in each project (different source, same design)"),
    BackendAlias("FLASHINFER_MLA", (), ("flashinfer",),
                 "FlashInfer's BatchMLAPagedAttentionWrapper (fa2/fa3); vLLM's FLASHINFER_MLA is another "
                 "kernel, see FLASHINFER_MLA_TRTLLM"),
    BackendAlias("FLASHINFER_MLA_CUTLASS", ("CUTLASS_MLA",), ("cutlass_mla",),
                 "CUTLASS's SM100 MLA decode (vLLM and SGLang build their own copy of it)"),
    BackendAlias("FLASHINFER_MLA_TRTLLM", (), ("trtllm_mla",),
                 "FlashInfer's trtllm-gen MLA decode"),
    BackendAlias("FLASHINFER_MLA_XQA", (), (), "FlashInfer's XQA MLA decode for SM120/SM121"),
)

NAME_CLASHES: tuple[NameClash, ...] = (
    NameClash("FLASHINFER_MLA", "vLLM", "FLASHINFER_MLA_TRTLLM", (10,),
              "vLLM's FLASHINFER_MLA is FlashInfer's trtllm-gen kernel on SM100, which is "
              "FLASHINFER_MLA_TRTLLM here; our FLASHINFER_MLA is the fa2/fa3 wrapper (SM80-SM90)"),
)

#: other projects' MLA backend names with no counterpart here: name -> what it is
NOT_PROVIDED: dict[str, str] = {
    "FLASHMLA": "vLLM's DeepSeek FlashMLA kernel",
    "FLASHMLA_SPARSE": "vLLM's DeepSeek FlashMLA sparse kernel",
    "FLASH_ATTN_MLA": "vLLM's FlashAttention-3 MLA kernel",
    "ROCM_AITER_MLA": "vLLM's AMD AITER kernel",
    "flashmla": "SGLang's DeepSeek FlashMLA kernel",
    "fa3": "SGLang's FlashAttention-3 backend",
    "nsa": "SGLang's native sparse attention backend for DeepSeek-V3.2",
    "FLASHMLA_SPARSE_DSV4": "vLLM's DeepSeek-V4 FlashMLA sparse kernel (SM90, SM100; named by the V4 ladders)",
    "FLASHINFER_MLA_SPARSE_DSV4": "vLLM's DeepSeek-V4 FlashInfer sparse MLA kernel (SM100, SM120; named by the "
                                  "V4 ladders)",
    "ROCM_FLASHMLA_SPARSE_DSV4": "vLLM's DeepSeek-V4 AITER sparse kernel for AMD GPUs",
    "aiter": "SGLang's AMD AITER backend",
}


def _key(name: object) -> str:
    """The normalised form of a backend name (upper case, ``-`` as ``_``); a non-string is a ``TypeError``
    naming ``name`` (every helper below takes its name through here)."""
    if not isinstance(name, str):
        raise TypeError(f"name: got {type(name).__name__} {name!r}; supported a backend name (str)")
    return name.strip().upper().replace("-", "_")


_TARGETS: dict[str, str] = {_key(n): a.ours for a in BACKEND_ALIASES for n in (*a.vllm, *a.sglang)
                            if _key(n) != a.ours}


def alias_target(name: str) -> str | None:
    """Our name for another project's spelling (``"cutlass_mla"`` -> ``"FLASHINFER_MLA_CUTLASS"``), else None.

    Case-insensitive; ``-`` reads as ``_``. Callers look up registered names first: an alias never shadows a
    registered backend.
    """
    return _TARGETS.get(_key(name))


def alias_note(name: str) -> str | None:
    """``"'cutlass_mla' is SGLang's name for FLASHINFER_MLA_CUTLASS"`` for an alias, else None."""
    key = _key(name)
    for a in BACKEND_ALIASES:
        projects = [p for p, names in (("vLLM", a.vllm), ("SGLang", a.sglang)) if key in map(_key, names)]
        if projects and key != a.ours:
            return f"{name.strip()!r} is {' and '.join(projects)}'s name for {a.ours}"
    return None


def alias_names() -> tuple[str, ...]:
    """Every accepted alias, normalised (upper case), for suggestions in "did you mean" messages."""
    return tuple(sorted(_TARGETS))


def name_clash_note(name: str, compute_capability: tuple[int, int] | None) -> str | None:
    """The hint for a name that means another kernel elsewhere on this architecture, else None."""
    key = _key(name)
    for clash in NAME_CLASHES:
        if clash.name == key and compute_capability is not None and \
                compute_capability[0] in clash.compute_capability_majors:
            return clash.text
    return None


def not_provided_note(name: str) -> str | None:
    """``"FLASHMLA is vLLM's DeepSeek FlashMLA kernel, which this package does not provide"`` or None."""
    key = _key(name)
    for other, what in NOT_PROVIDED.items():
        if _key(other) == key:
            return f"{other} is {what}, which this package does not provide"
    return None
