"""The suite's own machinery: the expanded float64 reference, the case generator and the prepared inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_backends.backends.contract import Capabilities, MLABackend, QueryLenSupport
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import build_matrix
from mla_backends.testing.cases import declared_reasons
from mla_backends.testing.inputs import TRAILING, expected, prepare
from mla_backends.testing.reference import random_orthogonal, reference_mqa, up_projections
from mla_backends.testing.tolerances import precision_for, tolerance_for


def test_up_projections_are_orthogonal_and_dense() -> None:
    proj = up_projections(64)
    eye = torch.eye(64, dtype=torch.float64)
    for w in (proj.w_uk, proj.w_uv):
        assert torch.allclose(w @ w.T, eye, atol=1e-12)
        assert (w.abs() > 1e-6).float().mean() > 0.9  # not a permutation in disguise
    w2 = random_orthogonal(64, torch.Generator().manual_seed(1))
    assert not torch.allclose(w2, proj.w_uk)


def test_reference_equals_plain_absorbed_attention() -> None:
    """Derived from the expanded computation, the latent output and LSE match the absorbed formula."""
    g = torch.Generator().manual_seed(0)
    n, heads, r, rope, S = 3, 4, 64, 16, 11
    q = torch.randn(n, heads, r, generator=g, dtype=torch.float64)
    qr = torch.randn(n, heads, rope, generator=g, dtype=torch.float64)
    rows = torch.randn(S, r + rope, generator=g, dtype=torch.float64)
    visible = torch.ones(n, S, dtype=torch.bool)
    visible[0, 5:] = False
    visible[1, ::2] = False
    scale = 0.1
    out, lse = reference_mqa(q, qr, rows, visible, scale)
    for t in range(n):
        for h in range(heads):
            s = [
                scale * (float(q[t, h] @ rows[i, :r]) + float(qr[t, h] @ rows[i, r:]))
                if visible[t, i]
                else -math.inf
                for i in range(S)
            ]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            total = sum(w)
            assert lse[t, h].item() == pytest.approx(m + math.log(total), abs=1e-10)
            o = sum(wi / total * rows[i, :r] for i, wi in enumerate(w))
            assert torch.allclose(out[t, h], o, atol=1e-10)


def test_prepared_inputs_use_scattered_tables_with_trailing_entries() -> None:
    matrix = build_matrix(RefTorchBackend, True)
    case = next(c for c in matrix.output if c.name == "ctx-sweep")
    p = prepare(case, torch.device("cpu"))
    P = case.block_size
    bt = p.meta.block_table[torch.argsort(p.meta.order)]  # back to caller order
    used = [-(-s // P) for s in case.seq_lens]
    assert bt.shape[1] == max(used) + TRAILING
    ids = torch.cat([bt[b, :n] for b, n in enumerate(used)])
    assert len(set(ids.tolist())) == len(ids) and not torch.equal(ids, torch.sort(ids).values)
    assert (bt[0, used[0] :] == -1).all() and (bt[1, used[1] :] >= 0).all()
    assert p.cache.num_blocks > sum(used)
    for b, s in enumerate(case.seq_lens):  # the rows the reference sees are the stored rows, by position
        pos = s - 1
        stored = p.cache.data[bt[b, pos // P], pos % P].to(torch.float64)
        assert torch.equal(p.rows[b][pos], stored)


def test_fp8_reference_rows_apply_the_scale() -> None:
    matrix = build_matrix(RefTorchBackend, True)
    case = next(c for c in matrix.output if c.kv_cache_dtype == "fp8_e4m3")
    assert case.fp8_scale != 1.0
    p = prepare(case, torch.device("cpu"))
    bt = p.meta.block_table[torch.argsort(p.meta.order)]
    stored = p.cache.data[bt[0, 0], 0].to(torch.float64)
    assert torch.allclose(p.rows[0][0], stored * case.fp8_scale, rtol=1e-6)
    out, lse = expected(p)
    assert out.shape == (sum(case.query_lens), case.num_heads, case.kv_lora_rank)


def _backend(**caps: object) -> type[MLABackend]:
    base = dict(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}), cpu=True)
    base.update(caps)
    return type("Fake", (RefTorchBackend,), {"name": "FAKE", "capabilities": Capabilities(**base)})


def test_cases_follow_declarations() -> None:
    single = build_matrix(
        _backend(
            query_len=QueryLenSupport.SINGLE,
            page_sizes=(32,),
            preferred_page_size=32,
            num_heads=frozenset({16, 128}),
        ),
        False,
    )
    assert all(max(c.query_lens) == 1 and c.topk is None for c in single.output)
    assert {c.block_size for c in single.output} == {32}
    assert {c.num_heads for c in single.output} == {16, 128}
    labels = {p.label for p in single.unsupported}
    assert {"query-len-2", "sparse", "page3", "heads3", "dtype-float16", "kv-float16"} <= labels
    sparse_only = build_matrix(_backend(dense=False, sparse=True), True)
    assert all(c.topk is not None for c in sparse_only.output + sparse_only.guard)
    assert "dense" in {p.label for p in sparse_only.unsupported}


def test_quick_matrix_is_small_and_full_covers_every_declared_value() -> None:
    caps = dataclasses.replace(RefTorchBackend.capabilities, cpu=False, min_compute_capability=(8, 0))
    triton_like = type("TritonLike", (RefTorchBackend,), {"name": "TRITON_LIKE", "capabilities": caps})
    quick = build_matrix(triton_like, True)
    assert 12 <= quick.count_kernel_calls() <= 25
    full = build_matrix(RefTorchBackend, False)
    assert len(full.output) > len(quick.output)
    for probe in full.declared:
        assert not probe.case.rejected and not declared_reasons(RefTorchBackend, probe.case.spec())
    lens = {s for c in full.output if c.block_size == 16 for s in c.seq_lens}
    assert {1, 15, 16, 17} <= lens and max(lens) > 1000


def test_build_plan_is_a_deprecated_alias_of_build_matrix() -> None:
    import mla_backends.testing as testing

    with pytest.warns(DeprecationWarning, match="build_matrix"):
        old = testing.build_plan
    assert old is build_matrix
    assert "build_plan" not in testing.__all__


def test_tolerance_lookup_order() -> None:
    """Declared bands are looked up "<dtype>/<cache>", "<cache>" (fp8), "<judged dtype>"; without one (or with
    an entry equal to 0.4's default of the same key, which declares nothing) the case is measured."""
    from mla_backends.backends.contract import DEFAULT_TOLERANCES, Precision, Tolerance

    tols = {
        "bfloat16": Tolerance(1e-2, 1e-2),
        "fp8_e4m3": Tolerance(5e-2, 5e-2),
        "bfloat16/fp8_e5m2": Tolerance(7e-2, 7e-2),
        "float16": DEFAULT_TOLERANCES["float16"],
    }
    cls = _backend(tolerances=tols, precision={"float16": Precision(torch.float16, torch.float16)})
    assert tolerance_for(cls, torch.bfloat16, "bfloat16")[1].atol == 1e-2
    assert tolerance_for(cls, torch.bfloat16, "fp8_e4m3")[1].atol == 5e-2
    assert tolerance_for(cls, torch.bfloat16, "fp8_e5m2")[1].atol == 7e-2
    assert tolerance_for(cls, torch.float16, "float16") == ("float16 (measured)", None)
    assert tolerance_for(RefTorchBackend, torch.float32, "bfloat16") == ("bfloat16 (measured)", None)
    assert precision_for(cls, torch.float16, "fp8_e4m3") == ("float16", Precision(torch.float16, torch.float16))
    assert precision_for(cls, torch.float64, "float64") == ("default", Precision(torch.float64, torch.float64))


def test_reference_and_checks_import_without_pytest_or_kernels() -> None:
    import subprocess
    import sys

    code = (
        "import sys, mla_backends.testing, mla_backends.testing.checks, mla_backends.testing.broken; "
        "bad = [m for m in ('pytest', 'triton', 'flashinfer') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
