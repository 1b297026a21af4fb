"""The per-architecture priority ladders, as data.

One :class:`Ladder` per architecture family, with four orderings: dense or sparse attention, times a
16-bit/32-bit cache or an fp8 cache. The selector walks the ordering top-down and takes the first backend
whose declared capabilities accept the request. An entry that can never win on its family is a bug (noise
in every error message); ``tests/test_selector_ladders.py`` proves each entry wins in at least one
configuration.

Plugins enter a ladder only where they ask (``before=``/``after=`` a built-in); built-ins keep their order.
The facts behind each ordering are in ``docs/selection.md`` (generated from this module).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_backends.core.device import DeviceInfo
from mla_backends.plugins.registry import BackendName, Registry

__all__ = ["Ladder", "LADDERS", "ladder_for", "candidates"]

REF = BackendName.REF_TORCH.value
CPU_FUSED = BackendName.CPU_FUSED.value
TRITON = BackendName.TRITON_MLA.value
FI = BackendName.FLASHINFER_MLA.value
CUTLASS = BackendName.FLASHINFER_MLA_CUTLASS.value
TRTLLM = BackendName.FLASHINFER_MLA_TRTLLM.value
XQA = BackendName.FLASHINFER_MLA_XQA.value
#: vLLM's DeepSeek-V4 attention backends (vLLM's names; none is part of this library: the V4 orderings name them,
#: and they are refused by name until a plugin registers a backend under it; vLLM's ROCm one,
#: ROCM_FLASHMLA_SPARSE_DSV4, has no family here: the device model knows CUDA GPUs only)
FLASHMLA_DSV4 = "FLASHMLA_SPARSE_DSV4"
FLASHINFER_DSV4 = "FLASHINFER_MLA_SPARSE_DSV4"


@dataclass(frozen=True)
class Ladder:
    """Priority orderings for one architecture family.

    Attributes:
        family: ``"sm80"``, ``"sm90"`` ... or ``"cpu"``; plugins name it in ``archs=``.
        archs: compute capabilities the family covers (documentation, and the dead-entry test).
        dense / dense_fp8 / sparse / sparse_fp8: backend names, best first.
        why: the kernel facts that justify the order (rendered into ``docs/selection.md``).
        v4: DeepSeek-V4 attention (sinks, window, compressed keys), best first: the kernels engines run V4 on,
            by their engine's names, then TRITON_MLA's V4 kernel (SM80+), then the reference.
    """

    family: str
    archs: tuple[tuple[int, int], ...]
    dense: tuple[str, ...]
    dense_fp8: tuple[str, ...]
    sparse: tuple[str, ...]
    sparse_fp8: tuple[str, ...]
    why: str
    v4: tuple[str, ...] = (REF,)

    def variant(self, *, fp8: bool, sparse: bool) -> tuple[str, ...]:
        if sparse:
            return self.sparse_fp8 if fp8 else self.sparse
        return self.dense_fp8 if fp8 else self.dense

    def variants(self) -> dict[str, tuple[str, ...]]:
        return {"dense": self.dense, "dense, fp8 cache": self.dense_fp8,
                "sparse": self.sparse, "sparse, fp8 cache": self.sparse_fp8}


LADDERS: tuple[Ladder, ...] = (
    Ladder(
        family="sm80",
        archs=((8, 0), (8, 6), (8, 9)),
        # FlashInfer's fa2 MLA kernel is the tuned decode path on Ampere/Ada; Triton is the portable fallback;
        # the reference runs anywhere torch does and takes what both refuse (float64, ...).
        dense=(FI, TRITON, REF),
        # fa2 reads no fp8 cache. Triton dequantises fp8 on load but needs native fp8 conversion (SM89, Ada),
        # so on SM80/86 an fp8 cache falls to the reference.
        dense_fp8=(TRITON, REF),
        # only Triton and the reference implement top-k sparse attention
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="FlashInfer fa2 first (tuned paged MLA decode); Triton is the portable fallback; fp8 caches need "
            "Triton on SM89 (native fp8 conversion) or the reference; the reference is last.",
        v4=(TRITON, REF),  # TRITON_MLA's V4 kernel (window, compressed entries, sinks; fp8_ds_mla records)
    ),
    Ladder(
        family="sm90",
        archs=((9, 0),),
        # Hopper: FlashInfer's fa3 path (TMA/wgmma) is the fastest MLA decode we ship, and it is also the
        # only FlashInfer path that reads an fp8_e4m3 cache (bf16 query, 512/64 dims).
        dense=(FI, TRITON, REF),
        dense_fp8=(FI, TRITON, REF),
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="FlashInfer fa3 first (Hopper kernel, also reads fp8_e4m3 with a bf16 query); Triton fallback; "
            "the reference last.",
        # vLLM runs V4 on Hopper with FlashMLA's sparse kernel (SM90, SM100)
        v4=(FLASHMLA_DSV4, TRITON, REF),
    ),
    Ladder(
        family="sm100",
        archs=((10, 0), (10, 3)),
        # Blackwell datacenter: trtllm-gen (page 32/64, bf16 or fp8) is the fastest decode; cutlass
        # (128 heads, padded; page sizes dividing 128; no LSE) covers what it refuses. FlashInfer's fa2 runs
        # on SM100 but slowly (flashinfer#3400, "auto" silently fell back to it): FLASHINFER_MLA declares
        # SM80-SM90 only, so it is not an entry here and Triton is the fallback.
        dense=(TRTLLM, CUTLASS, TRITON, REF),
        # cutlass reads no fp8 cache
        dense_fp8=(TRTLLM, TRITON, REF),
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="trtllm-gen first, cutlass second (SM100 kernels); Triton is the fallback (FlashInfer fa2 is "
            "slow on SM100+ and not declared there); fp8 caches: trtllm-gen, Triton; the reference last.",
        # vLLM: FlashMLA's sparse kernel (SM90/SM100) first, FlashInfer's sparse MLA (SM100/SM120) second
        v4=(FLASHMLA_DSV4, FLASHINFER_DSV4, TRITON, REF),
    ),
    Ladder(
        family="sm110",
        archs=((11, 0),),
        # Thor: FlashInfer ships the cutlass MLA kernel for SM110 but not trtllm-gen.
        dense=(CUTLASS, TRITON, REF),
        dense_fp8=(TRITON, REF),
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="cutlass first (no trtllm-gen on SM110); Triton fallback and the only fp8 path; the reference "
            "last.",
        v4=(TRITON, REF),
    ),
    Ladder(
        family="sm120",
        archs=((12, 0), (12, 1)),
        # Blackwell consumer/workstation: FlashInfer's xqa MLA decode (single-token, page 16/32/64/128, bf16 or
        # fp8) is the only vendor kernel; it also gives SM120 an fp8 cache path (vllm#35577 had none).
        dense=(XQA, TRITON, REF),
        dense_fp8=(XQA, TRITON, REF),
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="xqa first (single-token decode, bf16 or fp8); Triton for what xqa refuses (prefill-sized "
            "queries, other page sizes, fp16); the reference last.",
        v4=(FLASHINFER_DSV4, TRITON, REF),  # vLLM's FlashInfer sparse MLA for V4 (SM100, SM120), then Triton
    ),
    Ladder(
        family="sm70",
        archs=((7, 0), (7, 5)),
        # Volta/Turing: no shipped kernel targets them (FlashInfer MLA and Triton MLA need SM80).
        dense=(REF,),
        dense_fp8=(REF,),
        sparse=(REF,),
        sparse_fp8=(REF,),
        why="only the reference: the vendor and Triton MLA kernels need SM80+.",
    ),
    Ladder(
        family="newer",
        archs=((13, 0),),
        # An architecture this release does not know: Triton compiles for it, vendor kernels are unverified.
        dense=(TRITON, REF),
        dense_fp8=(TRITON, REF),
        sparse=(TRITON, REF),
        sparse_fp8=(TRITON, REF),
        why="an architecture newer than this release: Triton (compiled for it at run time), then the "
            "reference.",
        v4=(TRITON, REF),
    ),
    Ladder(
        family="cpu",
        archs=(),
        # The compiled kernel reads each cached row once and fuses score, softmax and value sum: it wins
        # wherever it is built for this machine (docs/performance.md); where it is not (no compiler, or
        # `mla-backends build` not run) it gives a package reason and the reference serves, as it does for what
        # the kernel refuses (float64, sparse, dims that are not multiples of 16). Triton runs on the CPU only
        # under TRITON_INTERPRET=1 (a testing aid, orders of magnitude slower) and could never win behind the
        # reference, so it is not a ladder entry: force it with backend="TRITON_MLA" when testing Triton
        # kernels on a CPU.
        dense=(CPU_FUSED, REF),
        dense_fp8=(CPU_FUSED, REF),
        sparse=(REF,),
        sparse_fp8=(REF,),
        why="the compiled CPU kernel first where it is built for this machine (`mla-backends build`); the "
            "reference for everything else (not built, float64, sparse); TRITON_MLA under TRITON_INTERPRET=1 "
            "is a testing aid, selectable by override.",
    ),
)

_BY_FAMILY = {lad.family: lad for lad in LADDERS}


def ladder_for(device: DeviceInfo) -> Ladder:
    """The family ladder for ``device`` (unknown future architectures get the ``newer`` ladder)."""
    if not device.is_cuda:
        return _BY_FAMILY["cpu"]
    major = device.compute_capability[0]  # type: ignore[index]
    family = {7: "sm70", 8: "sm80", 9: "sm90", 10: "sm100", 11: "sm110", 12: "sm120"}.get(major)
    if family is None:
        family = "sm70" if major < 7 else "newer"
    return _BY_FAMILY[family]


def candidates(device: DeviceInfo, *, fp8: bool, sparse: bool,
               registry: Registry | None = None, v4: bool = False) -> tuple[str, ...]:
    """Backend names to try on ``device``, best first: the built-in ordering (``v4``: the DeepSeek-V4 one)
    plus placed plugin backends.

    A plugin backend placed ``before``/``after`` a built-in enters every applicable ordering that contains
    that built-in; several plugins at the same anchor keep their registration order.
    """
    ladder = ladder_for(device)
    base = ladder.v4 if v4 else ladder.variant(fp8=fp8, sparse=sparse)
    if registry is None:
        return base
    before: dict[str, list[str]] = {}
    after: dict[str, list[str]] = {}
    for entry in registry.entries():
        p = entry.placement
        if p is None or p.anchor not in base or not p.applies_to(ladder.family, device.arch_label):
            continue
        (before if p.before else after).setdefault(p.anchor, []).append(entry.name)
    if not before and not after:
        return base
    out: list[str] = []
    for name in base:
        out += before.get(name, [])
        out.append(name)
        out += after.get(name, [])
    return tuple(out)
