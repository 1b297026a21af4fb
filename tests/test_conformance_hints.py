"""The suite's one hint policy (``mla_backends.testing.hints``) and its declarations (``mla_backends.testing.
tolerances``): a hint only when the suspected mistake is detectable and explains the result far better than
rounding, a named factor only when that exact factor reproduces it, the same diagnosis for float32 and float64
queries; a 16-bit-accumulating kernel judged by its declaration; mixed query/cache dtypes judged at the lower
precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_backends.backends.contract import DEFAULT_TOLERANCES, Capabilities, MLABackend, Precision, QueryLenSupport
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import broken, build_matrix, checks, hints
from mla_backends.testing.inputs import expected, expected_at, prepare
from mla_backends.testing.tolerances import judged_dtype, rounding_eps, tolerance_for

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


class RoundsInDtypeBackend(MLABackend):
    """A correct kernel that keeps its sums in 16 bits: each token's raw scores ``q . k`` stored in the query
    dtype, the probabilities rounded to it before the value product, the output stored in it. Its errors are
    rounding and nothing else, but more of it than a float32-accumulating kernel's."""

    name = "TEST_ROUNDS_IN_DTYPE"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}), kv_cache_dtypes=frozenset({"float16", "bfloat16"}),
        cpu=True, page_sizes=(16, 64), preferred_page_size=16, dims=frozenset({(512, 64)}),
        num_heads=frozenset({1, 16}), query_len=QueryLenSupport.VARLEN, returns_lse=True)

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, scale, topk_indices, out, lse_out, state):
        dt, r = q_latent.dtype, cache.kv_lora_rank
        q = torch.cat((q_latent, q_rope), -1).float()
        for t in range(q.shape[0]):
            b, pos = int(meta.token_request[t]), int(meta.token_positions[t])
            rows = cache.gather(meta.block_table[b], pos + 1, torch.float32)  # [S, r + rope]
            raw = (q[t] @ rows.T).to(dt).float()  # [H, S], rounded like a product taken in the dtype
            s = raw * scale
            m = s.max(-1, keepdim=True).values
            w = torch.exp(s - m)
            total = w.sum(-1, keepdim=True)
            p = (w / total).to(dt).float()
            out[t] = (p @ rows[:, :r]).to(dt)
            lse_out[t] = (m + total.log()).squeeze(-1)


class DeclaresSixteenBit(RoundsInDtypeBackend):
    """The same kernel, declaring its 16-bit accumulation (and a 16-bit-rounded LSE, more than it needs)."""

    name = "TEST_DECLARES_16_BIT"
    capabilities = dataclasses.replace(RoundsInDtypeBackend.capabilities, precision={
        "float16": Precision(torch.float16, torch.float16), "bfloat16": Precision(torch.bfloat16, torch.bfloat16)})


def _rounding_cases() -> list:
    return [c for c in build_matrix(DeclaresSixteenBit, True).output
            if not c.rejected and sum(c.seq_lens) * c.num_heads <= 16 * 300]


def test_a_16_bit_accumulating_kernel_passes_by_its_declaration_only() -> None:
    cases = _rounding_cases()
    assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16} and any(c.num_heads == 1 for c in cases)
    for case in cases:
        checks.check_output(DeclaresSixteenBit, case, CPU)
    undeclared = []
    for case in cases:
        try:
            checks.check_output(RoundsInDtypeBackend, case, CPU)
        except checks.ComparisonFailure as exc:
            undeclared.append((case.id, exc.criterion, exc.hint))
    # judged as a float32-accumulating kernel, its rounding is beyond what such a kernel rounds: it fails, and
    # no failure gets a hint (nothing but rounding explains it)
    assert len(undeclared) >= len(cases) // 2, undeclared
    assert all(hint == "" for _, _, hint in undeclared), undeclared


def _hints_below_rounding(cases: list, factor: float = 0.7) -> tuple[list[str], int]:
    """Judge the declared kernel's output by allowances shrunk to ``factor`` of what it needs (so every
    comparison fails on rounding alone) and collect the hints given."""
    given, failed = [], 0
    for case in cases:
        p = prepare(case, CPU)
        out, _ = p.call(checks.make_backend(DeclaresSixteenBit, CPU))
        standard = checks.standard_for(DeclaresSixteenBit, p)
        need = standard.judge(out.double()).badness
        tight = standard.scaled(factor * need)
        try:
            checks.assert_judged("output (latent space)", out, tight, case.id, p.meta,
                                 hint=lambda g, p=p, tight=tight: hints.scale_hint(p, g, tight)
                                 or hints.output_scale_hint(g, tight))
        except checks.ComparisonFailure as exc:
            failed += 1
            if exc.hint:
                given.append(f"{case.id}: {exc.hint}")
    return given, failed


def test_rounding_failures_get_no_hint() -> None:
    cases = _rounding_cases()[:6]
    given, failed = _hints_below_rounding(cases)
    assert failed == len(cases) >= 5
    assert not given, given


def test_without_the_evidence_rules_the_same_failures_get_false_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the test above exercises the hint search (under a looser rule, any mistake that lowers the
    error at all, these rounding failures would blame the softmax scale or the output's scale)."""
    monkeypatch.setattr(hints, "detectable", lambda *a, **k: True)

    def lowers_the_error(got, under, standard, *, lse=False):
        ref = standard.ref_lse if lse else standard.ref_out
        return hints._rms_error(got, under) < hints._rms_error(got, ref)

    monkeypatch.setattr(hints, "explains", lowers_the_error)
    given, _ = _hints_below_rounding(_rounding_cases()[:6])
    assert any("constant factor" in g for g in given), given


class ScaledBackend(RefTorchBackend):
    """A softmax scale off by a constant factor (set per subclass)."""

    name = "TEST_SCALED"
    factor = 1.0

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, scale, **kw):  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale * self.factor, **kw)


def _scaled(factor: float) -> type[ScaledBackend]:
    return type(f"Scaled{factor}", (ScaledBackend,), {"factor": factor, "name": f"TEST_SCALED_{factor}"})


def _case(dtype: torch.dtype):
    base = build_matrix(RefTorchBackend, True).guard[0]
    return dataclasses.replace(base, dtype=dtype, kv_cache_dtype=str(dtype).removeprefix("torch."))


def _hint_of(cls: type[MLABackend], dtype: torch.dtype) -> str:
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(cls, _case(dtype), CPU)
    return info.value.hint


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_factor_near_a_named_one_gets_the_measured_factor_only(dtype: torch.dtype) -> None:
    # 1.416 is not sqrt(2) (1.41421): the reference at exactly sqrt(2) misses the output by far more than the
    # case's criteria allow, so the hint must not name it
    hint = _hint_of(_scaled(1.416), dtype)
    assert "off by a constant factor 1.416 (" in hint, hint
    assert "sqrt(2)" not in hint


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_exact_named_factor_is_named_for_float32_and_float64(dtype: torch.dtype) -> None:
    assert "off by a constant factor 1.443 = log2(e)" in _hint_of(broken.Log2eScaleBackend, dtype)
    assert "off by a constant factor 0.7071 = 1/sqrt(2)" in _hint_of(_scaled(1 / math.sqrt(2.0)), dtype)


def test_a_factor_within_the_cases_rounding_gets_no_hint_but_the_same_factor_beyond_it_does() -> None:
    """A softmax scale 1.0005 moves a bf16 output by far less than bf16 rounding (not detectable from the
    output: no hint), but a float32 output by thousands of float32 epsilons (a hint)."""
    for dtype, want in ((torch.bfloat16, False), (torch.float32, True)):
        p = prepare(_case(dtype), CPU)
        standard = checks.standard_for(RefTorchBackend, p)
        out = expected_at(p)(p.scale * 1.0005)[0].to(dtype).double()
        tight = standard.scaled(0.5 * standard.judge(out).badness)  # make it fail either way
        assert not tight.judge(out).ok
        hint = hints.scale_hint(p, out, tight)
        assert ("constant factor 1.0005 " in hint) is want, (dtype, hint)


def test_the_lse_hints_follow_the_same_policy() -> None:
    p = prepare(_case(torch.float32), CPU)
    standard = checks.standard_for(RefTorchBackend, p)
    ref = standard.ref_lse
    assert "base-2" in hints.lse_hints(ref / math.log(2.0), standard)
    assert "shifted by a constant 0.05" in hints.lse_hints(ref + 0.05, standard)
    assert hints.lse_hints(ref + 1e-7 * torch.randn_like(ref), standard) == ""  # noise is no mistake
    assert hints.lse_hints(ref / math.log(2.0) + 0.3 * torch.randn_like(ref), standard) == ""  # not explained


def test_mixed_dtypes_are_judged_at_the_lower_precision() -> None:
    assert judged_dtype(torch.float32, "bfloat16") == torch.bfloat16
    assert judged_dtype(torch.float16, "float32") == torch.float16
    assert judged_dtype(torch.bfloat16, "float16") == torch.bfloat16
    assert judged_dtype(torch.float32, "fp8_e4m3") == torch.float32  # fp8 values are exact in any 16-bit dtype
    assert judged_dtype(torch.float64, "auto") == torch.float64
    assert rounding_eps(torch.float32, "float16") == 2.0**-10
    assert tolerance_for(RefTorchBackend, torch.float32, "bfloat16") == ("bfloat16 (measured)", None)


def test_0_4_default_bands_are_kept_as_data_and_declare_nothing() -> None:
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        tol = DEFAULT_TOLERANCES[name]
        assert tol.atol == tol.rtol == 8 * torch.finfo(dtype).eps
    copying = dataclasses.replace(RefTorchBackend.capabilities, tolerances=dict(DEFAULT_TOLERANCES))
    cls = type("CopiesDefaults", (RefTorchBackend,), {"name": "TEST_COPIES", "capabilities": copying})
    assert tolerance_for(cls, torch.bfloat16, "bfloat16") == ("bfloat16 (measured)", None)


def test_a_declared_precision_must_name_float_dtypes() -> None:
    with pytest.raises(ValueError, match=r"Precision.accumulate: got torch.int8; supported torch.float16"):
        dataclasses.replace(RefTorchBackend.capabilities, precision={"bfloat16": Precision(torch.int8)})
    with pytest.raises(TypeError, match="precision: got"):
        dataclasses.replace(RefTorchBackend.capabilities, precision={"bfloat16": "float16"})


def test_the_reference_recomputed_at_the_given_scale_is_the_reference() -> None:
    p = prepare(_case(torch.float32), CPU)
    a, b = expected(p), expected_at(p)(p.scale)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
