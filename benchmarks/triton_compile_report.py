"""Compile every ``TRITON_MLA`` attention configuration the configuration table can choose, without a GPU.

    python benchmarks/triton_compile_report.py --arch sm90a --json FILE
    python benchmarks/triton_compile_report.py --arch sm80 --json FILE
    python benchmarks/triton_compile_report.py --arch sm90a --v4 --json FILE   # the DeepSeek-V4 kernel

For the architecture, every (heads, query dtype, cache dtype, dense/sparse, ``fp8_qk``) point of
:data:`POINTS` goes through :func:`mla_backends.triton_mla.configs.fitting_configs` with that architecture's
shared memory: the configuration the table chooses (``"chosen": true``) and the fallbacks it can take
(``--chosen-only`` skips those), the chosen one at split counts 1, 2 and 16 (Triton specialises the
split count and the partials' strides on ``== 1`` and ``% 16``; ``--all-splits-at 128`` only at 128 heads, the
others at 2, as the tests compile it), the fallbacks at 2; each distinct launch (same constexprs and
integer specialisation) is compiled once. The launches come from
:func:`mla_backends.triton_mla.launch.build_launches` on example CPU tensors of the real dims (576-wide
rows, page 64), and Triton's own argument binder turns them into the signature a real launch compiles
(int32 strides, 16-divisibility and ``== 1`` specialisation). PTX and cubin come from the installed Triton
and the ptxas in its wheel; ``ptxas -v`` gives registers and spills.

FILE gets ``{"arch": ..., "triton": ..., "configs": [...]}``, one entry per compiled kernel with ``kernel``,
``config``, ``chosen``, ``splits``, ``arch``, ``heads``, ``dtype``, ``kv_cache_dtype``, ``sparse``,
``heads_per_program`` (rows a program holds: heads x query tokens), ``uses_wgmma`` (``wgmma`` instructions
in the PTX), ``registers`` (per thread), ``spills`` (spill store + load bytes; 0 = none), ``shared_bytes``
and ``shared_limit``, ``compile_s`` (wall) and ``compile_cpu_s`` (CPU seconds, ptxas included: the cost
without waiting for a shared core; run with an empty ``TRITON_CACHE_DIR`` so that nothing comes from the
cache), ``mma_instructions`` (the SASS's tensor-core instructions per role, score / output /
merge, by opcode and shape: ``{"score": {"HGMMA.64x16x16": 72}, ...}``) and ``mma_tiles`` (per role, the
dots' result tiles and the rows x columns each warpgroup computes, from the TTGIR's ``warpsPerCTA``;
``copies`` > 1 means every warpgroup computes the whole tile); ``benchmarks/mma_roles.py`` reads them.
A few minutes on 2 cores. Triton's private ``JITFunction._pack_args`` is used
(same in 3.6 and 3.9).

``--v4`` compiles the DeepSeek-V4 kernel instead (``kernels_v4.v4_attention_stage1`` and its merge; the
configuration :func:`~mla_backends.triton_mla.configs.choose_v4_config` takes) over :data:`V4_POINTS`: 512-wide
rows as bf16 or float32 rows, DeepSeek-V4's 584-byte records (window, compressed entries and sinks) and V3.2's
656-byte records (dense and sparse calls), at 16 and 128 heads (64 heads compile as 128: the same tiles), two
splits; its reports are committed as ``v4-triton-compile-<arch>-<triton>.json`` (``kv_cache_dtype`` names the
layout: ``bfloat16``, ``float32``, ``fp8_ds_mla`` (V4) or ``fp8_ds_mla-v32``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter: before any triton import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):  # the package, and mma_roles next to this script
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: architecture name -> (compute capability, opt-in shared memory per block in bytes)
ARCHS = {
    "sm80": (80, 166_912),
    "sm86": (86, 101_376),
    "sm89": (89, 101_376),
    "sm90a": (90, 232_448),
    "sm120": (120, 101_376),
}
#: (heads, query dtype, cache dtype, sparse, fp8_qk) points the table is asked about
POINTS = [
    (h, q, kv, sparse, fp8_qk)
    for h in (128, 64, 16)
    for q, kv in (("bfloat16", "bfloat16"), ("bfloat16", "fp8_e4m3"), ("float32", "float32"))
    for sparse in (False, True)
    for fp8_qk in (False, True)
    if not (fp8_qk and (kv != "fp8_e4m3" or sparse)) and not (sparse and q == "float32")
]
#: DeepSeek-V4 kernel points: (heads, query dtype, cache layout, sparse)
V4_POINTS = [(h, q, kv, sparse) for h in (128, 16)
             for q, kv, sparse in (("bfloat16", "bfloat16", False), ("bfloat16", "fp8_ds_mla", False),
                                   ("bfloat16", "fp8_ds_mla-v32", False), ("bfloat16", "fp8_ds_mla-v32", True),
                                   ("float32", "float32", False))
             if not (q == "float32" and h != 16)]
PAGE = 64
RANK, ROPE = 512, 64
#: split counts compiled for the chosen configuration (Triton's integer classes: == 1, % 16 == 0, other);
#: fallbacks are compiled at the middle one
SPLIT_VARIANTS = (1, 2, 16)


def _example(heads: int, q_name: str, kv_name: str, sparse: bool):
    """CPU tensors shaped like a real call (2 requests, query lengths 1 and 4, context 200)."""
    import torch

    from mla_backends.core.dtypes import parse_model_dtype as torch_dtype
    from mla_backends.step.cache import LatentKVCache
    from mla_backends.step.metadata import BatchMetadata

    q_dtype = torch_dtype(q_name)
    cache = LatentKVCache(16, PAGE, RANK, ROPE, kv_cache_dtype=kv_name, model_dtype=q_dtype, device="cpu")
    bt = torch.arange(16, dtype=torch.int32).view(2, 8)
    meta = BatchMetadata.build([1, 4], [200, 200], bt, PAGE, num_blocks=16)
    T = meta.num_tokens
    ql = torch.zeros(T, heads, RANK, dtype=q_dtype)
    qr = torch.zeros(T, heads, ROPE, dtype=q_dtype)
    out = torch.empty_like(ql)
    lse = torch.empty(T, heads, dtype=torch.float32)
    topk = torch.zeros(T, 128, dtype=torch.int32) if sparse else None
    return ql, qr, cache, meta, out, lse, topk


def _ptxas_usage(ptx: str, cc: int) -> tuple[int, int]:
    """``(registers, spill bytes)`` of the kernel in ``ptx`` from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself uses for this arch

    ptxas = get_ptxas(cc).path
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {res.stderr[-2000:]}")
    log = res.stdout + res.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def _sass(cubin: bytes) -> str:
    """``cuobjdump -sass`` of ``cubin``, with the cuobjdump of the triton wheel (as ``ptxas``)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"cuobjdump failed: {res.stderr[-2000:]}")
    return res.stdout


def _compile(launch, cc: int) -> dict[str, object]:
    """Compile one launch for ``sm_<cc>`` through Triton's binder: shared bytes, PTX, registers, spills,
    the tensor-core instructions per role (SASS) and the warpgroups' tiles (TTGIR)."""
    import importlib

    import triton
    from mma_roles import mma_summary
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(importlib.import_module(f"mla_backends.triton_mla.{launch.module}"), launch.kernel)
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.options)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    regs, spills = _ptxas_usage(ptx, cc)
    instructions, tiles = mma_summary(launch.kernel, compiled.asm["ttgir"], _sass(compiled.asm["cubin"]),
                                      launch.options.get("BLOCK_N"), int(options.num_warps))
    return {"shared_bytes": int(compiled.metadata.shared), "uses_wgmma": "wgmma.mma_async" in ptx,
            "registers": regs, "spills": spills, "mma_instructions": instructions, "mma_tiles": tiles,
            "signature": {k: v for k, v in signature.items() if v != "constexpr"}}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (ptxas, cuobjdump) so far: a compile's cost
    without the wait for a shared core (``compile_s`` is the wall time)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _int_specialization(args: tuple) -> tuple:
    """How Triton specialises a launch's integer arguments (``== 1``, divisible by 16): launches that agree
    here and in their constexprs compile to the same kernel."""
    return tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int) and not isinstance(a, bool))


def _record(configs: list, seen: dict, launch, cfg, chosen: bool, arch: str, cc: int, smem: int, heads: int,
            q_name: str, kv_name: str, sparse: bool, splits: int) -> None:
    """Compile ``launch`` unless an identical kernel was compiled already, and append its entry."""
    from mla_backends.triton_mla.configs import rows_layout

    consts = tuple(sorted((k, str(v)) for k, v in launch.options.items()))
    key = (launch.kernel, consts, _int_specialization(launch.args), q_name, kv_name)
    if key in seen:  # the same compiled kernel serves this head count (or configuration) too
        if heads not in seen[key]["also_heads"] and heads != seen[key]["heads"]:
            seen[key]["also_heads"].append(heads)
        seen[key]["chosen"] = seen[key]["chosen"] or chosen
        return
    t0, cpu0 = time.time(), _cpu_seconds()
    res = _compile(launch, cc)
    merge = launch.kernel in ("mla_decode_stage2", "mla_decode_merge")
    if launch.kernel == "mla_decode_rows":
        rows = rows_layout(heads)[0] * rows_layout(heads)[1]
    elif launch.kernel in ("mla_decode_stage1", "v4_attention_stage1"):
        rows = cfg.block_h
    else:
        rows = launch.options["BLOCK_H"]
    configs.append({
        "kernel": launch.kernel, "config": "merge" if merge else cfg.name, "chosen": chosen, "splits": splits,
        "arch": arch, "heads": heads, "dtype": q_name, "kv_cache_dtype": kv_name, "sparse": sparse,
        "fp8_qk": cfg.qk_fp8, "heads_per_program": rows, "block_n": launch.options.get("BLOCK_N"),
        "num_warps": launch.options.get("num_warps"), "num_stages": launch.options.get("num_stages"),
        "shared_limit": smem, "compile_s": round(time.time() - t0, 1),
        "compile_cpu_s": round(_cpu_seconds() - cpu0, 2), "also_heads": [], **res,
    })
    seen[key] = configs[-1]
    print(f"{arch} {launch.kernel:18s} {configs[-1]['config']:24s} H={heads:<3d} {q_name}/{kv_name}"
          f"{' sparse' if sparse else ''} splits={splits}{'' if chosen else ' (fallback)'}: "
          f"regs {res['registers']} spills {res['spills']} smem {res['shared_bytes']} "
          f"wgmma {res['uses_wgmma']} mma {res['mma_instructions']} ({configs[-1]['compile_s']} s)",
          flush=True)


def report(arch: str, heads_filter: tuple[int, ...] | None = None, kv_filter: str | None = None,
           chosen_only: bool = False, all_splits_at: tuple[int, ...] | None = None) -> dict[str, object]:
    """Compile every configuration the table can choose on ``arch`` (``chosen_only``: only the one it
    chooses at the architecture's shared memory); the JSON document described above. ``all_splits_at``: the
    head counts whose chosen configuration gets every split class (default: all); elsewhere split count 2."""
    import torch
    import triton

    from mla_backends.core.dtypes import parse_model_dtype as torch_dtype
    from mla_backends.triton_mla import kernels
    from mla_backends.triton_mla.configs import fitting_configs
    from mla_backends.triton_mla.launch import build_launches

    assert not kernels.INTERPRET, "TRITON_INTERPRET must be unset for compiling"
    cc, smem = ARCHS[arch]
    seen: dict[tuple, dict[str, object]] = {}
    configs: list[dict[str, object]] = []
    for heads, q_name, kv_name, sparse, fp8_qk in POINTS:
        if (heads_filter and heads not in heads_filter) or (kv_filter and kv_name != kv_filter):
            continue
        if kv_name.startswith("fp8") and cc < 89:  # fp8 caches need SM89+ (declared by the backend)
            continue
        ql, qr, cache, meta, out, lse, topk = _example(heads, q_name, kv_name, sparse)
        candidates = fitting_configs((cc // 10, cc % 10), heads, torch_dtype(q_name), cache.data.dtype,
                                     sparse=sparse, rank_pad=RANK, rope_pad=ROPE, smem_limit=smem, fp8_qk=fp8_qk)
        for rank, cfg in enumerate(candidates[:1] if chosen_only else candidates):
            # the split count is an argument (and sets the partials' strides), so Triton specialises on it:
            # 1, a multiple of 16, and anything else compile apart; the chosen configuration gets all three
            every_class = rank == 0 and (not all_splits_at or heads in all_splits_at)
            for splits in SPLIT_VARIANTS if every_class else SPLIT_VARIANTS[1:2]:
                launches = build_launches(ql, qr, cache, meta, scale=0.1, topk_indices=topk, out=out,
                                          lse_out=lse, cfg=cfg, splits=splits, interpret=False)
                for launch in launches:
                    _record(configs, seen, launch, cfg, rank == 0, arch, cc, smem, heads, q_name, kv_name,
                            sparse, splits)
    del torch
    return {"arch": arch, "triton": triton.__version__, "configs": configs}


def _v4_example(heads: int, q_name: str, kv_name: str, sparse: bool):
    """CPU tensors shaped like a V4 call (2 requests, query lengths 1 and 4, context 200, window 128, 64 picked
    compressed entries, sinks) or, for V3.2 records, a dense or sparse call of 512 + 64."""
    import torch

    from mla_backends.backends.v4_inputs import CompressedKeys, V4Keys
    from mla_backends.core.dtypes import parse_model_dtype as torch_dtype
    from mla_backends.step.cache import LatentKVCache
    from mla_backends.step.metadata import BatchMetadata
    from mla_backends.step.records import RecordCache

    q_dtype = torch_dtype(q_name)
    rope = ROPE if kv_name == "fp8_ds_mla-v32" else 0
    if kv_name.startswith("fp8_ds_mla"):
        cache = RecordCache(16, PAGE, RANK, rope, model_dtype=q_dtype)
        ccache = RecordCache(4, 64, RANK, 0, model_dtype=q_dtype)
    else:
        cache = LatentKVCache(16, PAGE, RANK, 0, kv_cache_dtype=kv_name, model_dtype=q_dtype)
        ccache = LatentKVCache(4, 64, RANK, 0, kv_cache_dtype=kv_name, model_dtype=q_dtype)
    bt = torch.arange(16, dtype=torch.int32).view(2, 8)
    meta = BatchMetadata.build([1, 4], [200, 200], bt, PAGE, num_blocks=16)
    T = meta.num_tokens
    ql = torch.zeros(T, heads, RANK, dtype=q_dtype)
    qr = torch.zeros(T, heads, rope, dtype=q_dtype)
    out = torch.empty_like(ql)
    lse = torch.empty(T, heads, dtype=torch.float32)
    keys = topk = None
    if rope:
        topk = torch.zeros(T, 128, dtype=torch.int32) if sparse else None
    else:
        comp = CompressedKeys(ccache, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(T, 64, dtype=torch.long))
        keys = V4Keys(sinks=torch.zeros(heads), window=128, compressed=comp)
    return ql, qr, cache, meta, out, lse, keys, topk


def v4_report(arch: str, heads_filter: tuple[int, ...] | None = None) -> dict[str, object]:
    """The ``--v4`` report: the V4 kernel at every :data:`V4_POINTS` point (two splits) and its merge."""
    import triton

    from mla_backends.triton_mla import kernels
    from mla_backends.triton_mla.configs import choose_v4_config, v4_operand_class
    from mla_backends.triton_mla.launch_v4 import build_v4_launches

    assert not kernels.INTERPRET, "TRITON_INTERPRET must be unset for compiling"
    cc, smem = ARCHS[arch]
    seen: dict[tuple, dict[str, object]] = {}
    configs: list[dict[str, object]] = []
    for heads, q_name, kv_name, sparse in V4_POINTS:
        if heads_filter and heads not in heads_filter:
            continue
        ql, qr, cache, meta, out, lse, keys, topk = _v4_example(heads, q_name, kv_name, sparse)
        records = kv_name.startswith("fp8_ds_mla")
        cfg = choose_v4_config(heads, v4_operand_class(ql.dtype, cache.data.dtype, records), rank_pad=RANK,
                               rope_pad=max(16, qr.shape[-1]), smem_limit=smem)
        launches = build_v4_launches(ql, qr, cache, meta, scale=0.1, keys=keys, topk_indices=topk, out=out,
                                     lse_out=lse, cfg=cfg, splits=2, interpret=False)
        for launch in launches:
            _record(configs, seen, launch, cfg, True, arch, cc, smem, heads, q_name, kv_name, sparse, 2)
    return {"arch": arch, "triton": triton.__version__, "configs": configs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHS), required=True, help="target architecture")
    p.add_argument("--json", metavar="FILE", help="write the report to FILE")
    p.add_argument("--heads", type=int, nargs="*", help="only these head counts (default: 16, 64, 128)")
    p.add_argument("--kv-cache-dtype", help="only this cache dtype")
    p.add_argument("--chosen-only", action="store_true",
                   help="only the configuration the table chooses, not its fallbacks")
    p.add_argument("--all-splits-at", type=int, nargs="+", metavar="HEADS",
                   help="only at these head counts the chosen configuration gets split counts 1, 2 and 16 "
                        "(elsewhere 2 alone; default: at every head count)")
    p.add_argument("--v4", action="store_true", help="the DeepSeek-V4 kernel's points (V4_POINTS) instead")
    args = p.parse_args(argv)
    if args.v4:
        doc = v4_report(args.arch, tuple(args.heads or ()))
    else:
        doc = report(args.arch, tuple(args.heads or ()), args.kv_cache_dtype, args.chosen_only,
                     tuple(args.all_splits_at or ()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
