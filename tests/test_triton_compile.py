"""The ``TRITON_MLA`` kernels compile for real GPU targets, without a GPU.

The interpreter runs the kernels' arithmetic but skips everything the GPU compiler checks (``tl.dot``
shape and dtype rules, fp8 conversions, register and shared-memory budgets). This test compiles stage 1 and
stage 2 to cubins for SM80/SM89/SM90/SM120 with the ``ptxas`` shipped in the triton wheel, in a subprocess
where ``TRITON_INTERPRET`` is unset, using the launch configuration the backend would choose on that device,
and checks the shared memory fits the device and the registers do not spill (ptxas's stack frame).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    r"""
    import json, os, subprocess, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mla_backends.triton_mla import backend as B
    from mla_backends.triton_mla import kernels as K

    assert not K.INTERPRET
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    S1 = ["QL", "QR", "KV", "KV_SCALE", "BT", "TOK_REQ", "TOK_POS", "TOPK", "PART_O", "PART_LSE",
          "sm_scale_log2", "num_heads", "topk_width", "num_splits"]
    S1_STRIDES = ["s_ql_t", "s_ql_h", "s_qr_t", "s_qr_h", "s_kv_b", "s_kv_p", "s_bt_b", "s_topk_t",
                  "s_topk_k", "s_po_t", "s_po_h", "s_po_s", "s_pl_t", "s_pl_h"]
    SMEM = {80: 166912, 89: 101376, 90: 232448, 120: 101376}
    TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}

    def build(fn, sig, consts, cc, warps, stages):
        full = dict(sig)
        full.update({k: "constexpr" for k in consts})
        names = list(full)
        src = ASTSource(fn=fn, signature=full, constexprs={(names.index(k),): v for k, v in consts.items()})
        opts = dict(num_warps=warps, num_stages=stages)
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
        path = f"/tmp/_mla_triton_{os.getpid()}.cubin"
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
        os.unlink(path)
        line = next(l for l in res.splitlines() if "REG:" in l)
        fields = dict(x.split(":") for x in line.split() if ":" in x)
        return {"shared": k.metadata.shared, "regs": int(fields["REG"]), "stack": int(fields["STACK"])}

    out = []
    for cc, q, kv, sparse, rank, rope, heads in json.loads(sys.argv[1]):
        B._smem_bytes = lambda device, cc=cc: SMEM[cc]
        rp, pp = max(16, B.next_pow2(rank)), max(16, B.next_pow2(rope))
        cfg = B.TritonMLABackend._launch_config(TORCH[q], TORCH[kv], rp, pp, heads, torch.device("cuda"), K)
        sig = dict(zip(S1, [f"*{q}", f"*{q}", f"*{kv}", "*fp32", "*i32", "*i64", "*i64", "*i32", "*fp32",
                            "*fp32", "fp32", "i32", "i32", "i32"]))
        sig.update({s: "i64" for s in S1_STRIDES})
        consts = dict(PAGE_SIZE=64, RANK=rank, RANK_PAD=rp, ROPE=rope, ROPE_PAD=pp, BLOCK_H=cfg.block_h,
                      BLOCK_N=cfg.block_n, SPARSE=sparse, IS_FP8=kv.startswith("fp8"),
                      DOT_DTYPE=cfg.dot_dtype, DOT_PRECISION=cfg.precision)
        r = build(K.mla_decode_stage1, sig, consts, cc, cfg.num_warps, cfg.num_stages)
        out.append({"case": [cc, q, kv, sparse, rank, rope, heads, cfg.block_h], "smem_limit": SMEM[cc], **r})
    s2 = dict(zip(["PART_O", "PART_LSE", "OUT", "LSE", "num_heads", "num_splits"],
                  ["*fp32", "*fp32", "*bf16", "*fp32", "i32", "i32"]))
    s2.update({s: "i64" for s in ["s_po_t", "s_po_h", "s_po_s", "s_pl_t", "s_pl_h", "s_o_t", "s_o_h",
                                  "s_lse_t", "s_lse_h"]})
    r = build(K.mla_decode_stage2, s2, dict(RANK=512, RANK_PAD=512, BLOCK_H=B.BLOCK_H), 90, 4, 2)
    out.append({"case": ["stage2", 90], "smem_limit": SMEM[90], **r})
    print("RESULT " + json.dumps(out))
    """
)

#: (SM, query dtype, cache dtype, sparse, kv_lora_rank, qk_rope_head_dim, heads)
CASES = [
    (90, "bf16", "bf16", False, 512, 64, 128),
    (90, "bf16", "fp8e4nv", True, 512, 64, 16),
    (80, "bf16", "bf16", False, 512, 64, 128),
    (80, "fp32", "fp32", False, 512, 64, 128),
    (89, "fp16", "fp8e5", False, 256, 64, 32),
    (120, "bf16", "bf16", False, 160, 48, 128),
]


def _toolchain_reason() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the installed triton
        return f"triton's compiler API is not importable here ({exc})"
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(bindir, tool)):
            return f"the triton wheel ships no {tool} (needed to compile cubins without a GPU)"
    return None


@pytest.mark.skipif(_toolchain_reason() is not None, reason=str(_toolchain_reason()))
def test_kernels_compile_for_gpu_targets_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    assert len(results) == len(CASES) + 1
    for r in results:
        assert 0 < r["shared"] <= r["smem_limit"], r
        # a few bytes of stack can hold conversion temporaries; the spilling configurations this guards
        # against (4 warps, or 64 heads a program) need 40-1400 bytes
        assert r["stack"] <= 16, f"register spills (stack frame {r['stack']} bytes): {r}"
        assert r["regs"] <= 255, r
