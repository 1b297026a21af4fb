"""The ``TRITON_MLA`` kernels compile for real GPU targets, without a GPU.

The interpreter runs the kernels' arithmetic but skips everything the GPU compiler checks (``tl.dot`` shape
and dtype rules, fp8 conversions, register and shared-memory budgets). ``benchmarks/triton_compile_report.py``
compiles every configuration the configuration table can choose for an architecture, through Triton's own
argument binder on the arguments ``launch.build_launches`` passes (so int32 strides with 16-divisibility and
``== 1`` specialisation, as a real launch compiles), with the ptxas in the triton wheel. This test runs it for
SM90a and SM80 (and SM89, a 99 KiB part) and checks shared memory, spills and ``wgmma``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "triton_compile_report.py")


def _toolchain_reason() -> str | None:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401

        if not os.path.exists(get_ptxas(90).path):
            return "the triton wheel ships no ptxas (needed to compile without a GPU)"
    except Exception as exc:  # pragma: no cover - depends on the installed triton
        return f"triton's compiler API is not importable here ({exc})"
    return None


def _report(arch: str, tmp_path, *extra: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    path = tmp_path / f"{arch}.json"
    res = subprocess.run([sys.executable, REPORT, "--arch", arch, "--json", str(path), *extra], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["arch"] == arch and doc["configs"]
    return doc["configs"]


def _check(configs: list[dict]) -> None:
    for c in configs:
        assert 0 < c["shared_bytes"] <= c["shared_limit"], c
        assert c["registers"] <= 255, c
        # every stride that a real launch passes as int32 is int32 here too (not the i64 of a hand signature)
        assert all(v != "i64" for k, v in c["signature"].items() if k.startswith("s_")), c["signature"]


pytestmark = pytest.mark.skipif(_toolchain_reason() is not None, reason=str(_toolchain_reason()))


def test_sm90a_report(tmp_path):
    configs = _report("sm90a", tmp_path)
    _check(configs)
    kernels = {c["kernel"] for c in configs}
    assert {"mla_decode_rows", "mla_decode_merge", "mla_decode_stage1", "mla_decode_stage2"} <= kernels
    rows128 = [c for c in configs if c["kernel"] == "mla_decode_rows" and 128 in [c["heads"], *c["also_heads"]]
               and c["kv_cache_dtype"] == "bfloat16"]
    assert rows128 and all(c["uses_wgmma"] and c["heads_per_program"] >= 64 for c in rows128), rows128
    portable = [c for c in configs if c["kernel"] != "mla_decode_rows"]
    assert all(c["spills"] == 0 for c in portable), [c for c in portable if c["spills"]]


_TRITON = __import__("triton").__version__ if _toolchain_reason() is None else ""


@pytest.mark.xfail(_TRITON.startswith("3.9"), strict=True,
                   reason="Triton 3.9: the rows kernel's two [64, 256] fp32 accumulators plus four 16-row tile "
                   "stages still spill 32 bytes on SM90 (0 under Triton 3.6, the device image's); see docs/triton.md")
def test_sm90a_rows_kernel_does_not_spill(tmp_path):
    configs = _report("sm90a", tmp_path, "--heads", "128", "--kv-cache-dtype", "bfloat16")
    assert all(c["spills"] == 0 for c in configs if c["kernel"] == "mla_decode_rows"), configs


@pytest.mark.parametrize("arch", ["sm80", "sm89"])
def test_portable_archs_report(arch, tmp_path):
    configs = _report(arch, tmp_path)
    _check(configs)
    assert {c["kernel"] for c in configs} == {"mla_decode_stage1", "mla_decode_stage2"}  # no rows off SM90
    assert not any(c["uses_wgmma"] for c in configs)
    # SM80: none. SM89: the sparse fp8 16-head stage 1 spills 8 bytes (as before this change; <= 16 allowed)
    limit = 0 if arch == "sm80" else 16
    assert all(c["spills"] <= limit for c in configs), [c for c in configs if c["spills"]]
    if arch == "sm89":  # 99 KiB: float32 at > 16 heads falls back to 16 heads a program
        assert {c["heads_per_program"] for c in configs if c["dtype"] == "float32" and c["heads"] > 16} == {16}
