"""The suite's one hint policy (``mla_backends.testing.hints``) and its tolerance policy
(``mla_backends.testing.tolerances``): a hint only when the suspected mistake explains the output far better than
rounding, a named factor only when that exact factor reproduces the output, the same diagnosis for float32 and
float64 queries, and mixed query/cache dtypes judged at the lower precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_backends.backends.contract import DEFAULT_TOLERANCES, Capabilities, MLABackend, QueryLenSupport, Tolerance
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import broken, build_matrix, checks, hints
from mla_backends.testing.inputs import expected, prepare
from mla_backends.testing.tolerances import judged_dtype, rounding_eps, tolerance_for

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


class RoundsInDtypeBackend(MLABackend):
    """A correct kernel that rounds where 16-bit kernels do: each token's raw scores ``q . k`` stored in the
    query dtype (as a kernel multiplying in the dtype leaves them), the probabilities rounded to the dtype
    before the value product, the output stored in the dtype. Its errors are rounding and nothing else."""

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


def _needed(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The smallest atol = rtol the output passes with."""
    return float(((got.double() - ref).abs() / (1 + ref.abs())).max())


def _rounding_cases() -> list:
    return [c for c in build_matrix(RoundsInDtypeBackend, True).output if not c.rejected]


def test_a_correct_16_bit_kernel_passes_the_default_tolerances() -> None:
    cases = _rounding_cases()
    assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16}
    assert any(c.num_heads == 1 for c in cases) and any(c.name.startswith("prop") for c in cases)
    for case in cases:
        checks.check_output(RoundsInDtypeBackend, case, CPU)


def _false_hints(cases: list) -> tuple[list[str], int]:
    """Run every case against a tolerance just below the kernel's own error (so every comparison fails on
    rounding alone) and collect the hints given."""
    given, failed = [], 0
    for case in cases:
        p = prepare(case, CPU)
        out, _ = p.call(checks.make_backend(RoundsInDtypeBackend, CPU))
        ref = expected(p)[0]
        need = _needed(out, ref)
        tol = Tolerance(0.7 * need, 0.7 * need)
        try:
            checks.assert_close("output (latent space)", out, ref, tol, "test", case.id, p.meta,
                                hint=lambda g, p=p, tol=tol, ref=ref: hints.scale_hint(p, g, tol, ref=ref))
        except checks.ComparisonFailure as exc:
            failed += 1
            if exc.hint:
                given.append(f"{case.id}: {exc.hint}")
    return given, failed


def test_rounding_failures_of_a_correct_16_bit_kernel_get_no_hint() -> None:
    cases = [c for c in _rounding_cases() if sum(c.seq_lens) * c.num_heads <= 16 * 200][:8]
    assert len(cases) >= 5
    given, failed = _false_hints(cases)
    assert failed == len(cases)
    assert not given, given


def test_without_the_rounding_rules_the_same_failures_get_false_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the test above exercises the hint search (the old policy, any factor that fits, blames
    the softmax scale on these rounding failures)."""
    monkeypatch.setattr(hints, "MIN_FACTOR_EPS", 0)
    monkeypatch.setattr(hints, "MAX_RESIDUAL_RATIO", math.inf)
    cases = [c for c in _rounding_cases() if sum(c.seq_lens) * c.num_heads <= 16 * 200][:8]
    given, _ = _false_hints(cases)
    assert any("off by a constant factor" in g for g in given), given


class ScaledBackend(RefTorchBackend):
    """A softmax scale off by a constant factor (set per subclass)."""

    name = "TEST_SCALED"
    factor = 1.0

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, scale, **kw):  # type: ignore[override]
        super().forward_mqa_kernel(q_latent, q_rope, cache, meta, scale=scale * self.factor, **kw)


def _scaled(factor: float) -> type[ScaledBackend]:
    return type(f"Scaled{factor}", (ScaledBackend,), {"factor": factor, "name": f"TEST_SCALED_{factor}"})


def _hint_of(cls: type[MLABackend], dtype: torch.dtype) -> str:
    base = build_matrix(RefTorchBackend, True).guard[0]
    case = dataclasses.replace(base, dtype=dtype, kv_cache_dtype=str(dtype).removeprefix("torch."))
    with pytest.raises(checks.ComparisonFailure) as info:
        checks.check_output(cls, case, CPU)
    return info.value.hint


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_factor_near_a_named_one_gets_the_measured_factor_only(dtype: torch.dtype) -> None:
    # 1.416 is not sqrt(2) (1.41421): at float32 and float64 tolerances the reference at exactly sqrt(2)
    # misses the output by far more than the tolerance, so the hint must not name it
    hint = _hint_of(_scaled(1.416), dtype)
    assert "off by a constant factor 1.416 (" in hint, hint
    assert "sqrt(2)" not in hint


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_exact_named_factor_is_named_for_float32_and_float64(dtype: torch.dtype) -> None:
    assert "off by a constant factor 1.443 = log2(e)" in _hint_of(broken.Log2eScaleBackend, dtype)
    assert "off by a constant factor 0.7071 = 1/sqrt(2)" in _hint_of(_scaled(1 / math.sqrt(2.0)), dtype)


def test_a_factor_within_rounding_gets_no_hint_but_the_same_factor_beyond_it_does() -> None:
    """1.003 is 3 float16 epsilons from 1 (within rounding) but 25,000 float32 ones."""
    base = build_matrix(RefTorchBackend, True).guard[0]
    for dtype, want in ((torch.float16, False), (torch.float32, True)):
        case = dataclasses.replace(base, dtype=dtype, kv_cache_dtype=str(dtype).removeprefix("torch."))
        p = prepare(case, CPU)
        out = expected(dataclasses.replace(p, scale=p.scale * 1.003))[0].to(dtype).double()
        ref = expected(p)[0]
        tol = Tolerance(1e-6, 1e-6)  # tight enough that both fail
        assert not hints._fits(out, ref, tol)
        hint = hints.scale_hint(p, out, tol, ref=ref)
        assert ("constant factor 1.003" in hint) is want, (dtype, hint)


def test_the_base2_lse_hint_follows_the_same_policy() -> None:
    ref = torch.linspace(-3.0, 9.0, 50, dtype=torch.float64).reshape(10, 5)
    tol = DEFAULT_TOLERANCES["float32"]
    assert "base-2" in hints.lse_base_hint(ref / math.log(2.0), ref, tol)
    assert hints.lse_base_hint(ref + 1e-3, ref, tol) == ""  # an LSE off by noise is not base 2
    assert hints.lse_base_hint(ref / math.log(2.0) + 0.01, ref, tol) == ""  # not at rounding level


def test_mixed_dtypes_are_judged_at_the_lower_precision() -> None:
    assert judged_dtype(torch.float32, "bfloat16") == torch.bfloat16
    assert judged_dtype(torch.float16, "float32") == torch.float16
    assert judged_dtype(torch.bfloat16, "float16") == torch.bfloat16
    assert judged_dtype(torch.float32, "fp8_e4m3") == torch.float32  # fp8 values are read exactly
    assert judged_dtype(torch.float64, "auto") == torch.float64
    assert rounding_eps(torch.float32, "float16") == 2.0**-10
    assert tolerance_for(RefTorchBackend, torch.float32, "bfloat16") == ("bfloat16", DEFAULT_TOLERANCES["bfloat16"])
    assert tolerance_for(RefTorchBackend, torch.float32, "float32") == ("float32", DEFAULT_TOLERANCES["float32"])


def test_default_tolerances_are_eight_epsilons_for_16_bit() -> None:
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        tol = DEFAULT_TOLERANCES[name]
        assert tol.atol == tol.rtol == 8 * torch.finfo(dtype).eps
