"""The suite's criteria (``mla_backends.testing.judge``) and its honest-rounding reference
(``mla_backends.testing.rounding``), each against what it is for: every criterion fails the error it exists to
catch and passes the case's honest rounding; a declared band replaces them; declared precision is emulated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.backends.contract import Capabilities, Precision, Tolerance
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import build_matrix, checks
from mla_backends.testing.inputs import honest, prepare
from mla_backends.testing.rounding import round_toward_zero

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16():
    """A bf16 decode case's inputs, its standard and REF_TORCH's output (float64)."""
    case = next(c for c in build_matrix(RefTorchBackend, True).output if c.name == "ctx-sweep")
    p = prepare(case, CPU)
    out, lse = p.call(checks.make_backend(RefTorchBackend, CPU))
    return p, checks.standard_for(RefTorchBackend, p), out.double(), lse.double()


def test_the_honest_reference_passes_and_so_does_ref_torch(bf16) -> None:
    p, standard, out, lse = bf16
    h_out, h_lse = honest(p, Precision())
    assert standard.judge(h_out).ok and standard.judge_lse(h_lse).ok
    assert standard.judge(out).badness <= 0.5 and standard.judge_lse(lse).badness <= 0.5
    assert standard.judge(standard.ref_out).badness == 0.0


def test_each_criterion_fails_the_error_it_is_for(bf16) -> None:
    _, standard, out, lse = bf16
    one = out.clone()
    one[2, 3, 7] += 0.25  # one element off: the element criterion (its row's too)
    v = standard.judge(one)
    assert not v.ok and v.measures["element"] > 1 and v.index == [2, 3, 7] and v.bad == 1
    row = out.clone()
    row[3, 5] *= 1.007  # one (token, head) row 0.7 % off: within the element criterion, not the row's
    v = standard.judge(row)
    assert not v.ok and v.criterion == "row" and v.measures["element"] < 1.0
    scaled = out.clone()
    scaled[1:] *= 0.9985  # 0.15 % small, rounding-sized per element, but a bias over the case (token 0 sees one
    v = standard.judge(scaled)  # position: its output is exact, and any change of it fails the row criterion)
    assert not v.ok and v.criterion == "bias" and v.measures["element"] < 1.0 and v.measures["row"] < 1.0
    nan = out.clone()
    nan[0, 0, 0] = float("nan")
    assert standard.judge(nan).badness == float("inf")
    shifted = lse + 3e-4  # an LSE offset well within bf16 rounding, but judged at float32
    v = standard.judge_lse(shifted)
    assert not v.ok and v.criterion in ("element", "offset")
    assert standard.judge_lse(lse + 3e-6).ok


def test_a_declared_band_replaces_the_measured_criteria(bf16) -> None:
    p, _, out, lse = bf16
    caps = dataclasses.replace(RefTorchBackend.capabilities, tolerances={"bfloat16": Tolerance(0.05, 0.05)})
    banded = type("Banded", (RefTorchBackend,), {"name": "TEST_BANDED", "capabilities": caps})
    standard = checks.standard_for(banded, p)
    assert standard.key == "bfloat16" and standard.band == Tolerance(0.05, 0.05)
    assert standard.judge(out * 0.9985).ok  # a bias the measured criteria fail, inside the band
    v = standard.judge(out + 0.2)
    assert not v.ok and v.criterion == "band"
    assert standard.judge_lse(lse + 1e-5).ok and not standard.judge_lse(lse + 0.1).ok  # float32's band at least


def test_scaled_and_rebased_standards(bf16) -> None:
    _, standard, out, _ = bf16
    bad = standard.judge(out).badness
    assert standard.scaled(0.5).judge(out).badness == pytest.approx(2 * bad)
    rebased = standard.rebased(out)
    assert rebased.judge(out).badness == 0.0 and not rebased.judge(standard.ref_out * 1.01).ok


def test_round_toward_zero_truncates_every_dtype() -> None:
    x = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -12, -(1.0 + 2.0 ** -8 + 2.0 ** -12), 3.0, 0.0, -1e-3],
                     dtype=torch.float64)
    got = round_toward_zero(x, torch.bfloat16)
    assert got.tolist()[:4] == [1.0, -1.0, 3.0, 0.0]  # nearest would round 1 + 2**-8 + 2**-12 up to 1 + 2**-7
    assert (got.abs() <= x.abs()).all()
    assert (round_toward_zero(x, torch.float16).abs() <= x.abs()).all()
    assert torch.equal(round_toward_zero(x, torch.float64), x)


class TruncatingBackend(RefTorchBackend):
    """REF_TORCH whose output is converted to its dtype by truncation (as vLLM's C++ CPU op does in bf16)."""

    name = "TEST_TRUNCATING"

    def forward_mqa_kernel(self, *args, out: torch.Tensor, **kw) -> None:  # type: ignore[override]
        inner = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        super().forward_mqa_kernel(*args, out=inner, **kw)
        out.copy_(round_toward_zero(inner.double(), out.dtype).to(out.dtype))


def test_truncating_the_output_is_a_bias_unless_declared() -> None:
    case = next(c for c in build_matrix(RefTorchBackend, True).output if c.name == "ctx-sweep")
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(TruncatingBackend, case, CPU)
    assert info.value.criterion == "bias" and info.value.hint == ""
    caps = dataclasses.replace(TruncatingBackend.capabilities,
                               precision={"bfloat16": Precision(rounding="toward_zero")})
    declared = type("Declared", (TruncatingBackend,), {"name": "TEST_TRUNCATING_DECLARED", "capabilities": caps})
    checks.check_output(declared, case, CPU)


def test_precision_declarations_are_validated() -> None:
    with pytest.raises(ValueError, match="Precision.rounding: got 'up'; supported 'nearest', 'toward_zero'"):
        Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}),
                     precision={"bfloat16": Precision(rounding="up")})


def test_the_reference_is_unchanged_by_the_latent_shortcut() -> None:
    """The reference maps the value rows back to the latent space once (``probs @ (values @ w_uv.T)``); it equals
    the expanded output mapped back (``(probs @ values) @ w_uv.T``) to float64 rounding."""
    from mla_backends.testing.reference import ReferenceMQA

    p = prepare(next(c for c in build_matrix(RefTorchBackend, True).output if c.name == "heads"), CPU)
    rows, vis = p.rows[0], p.visible[0]
    q_caller = p.meta.to_caller_order(p.q_latent)[:1]
    qr_caller = p.meta.to_caller_order(p.q_rope)[:1]
    ref = ReferenceMQA(q_caller, qr_caller, rows, vis)
    o_expanded, lse = ref.attention(p.scale)
    direct, lse2 = ref(p.scale)
    assert torch.allclose(direct, o_expanded @ ref.proj.w_uv.T, rtol=0, atol=1e-12) and torch.equal(lse, lse2)
