"""FlashInfer's fa2/fa3 MLA plan limits, as ``FLASHINFER_MLA`` declares them (CPU only).

* selection refuses causal multi-token batches whose query tiles end inside a token (20, 40, 48, 96 heads)
  and requests with more work items than a plan holds (a 16k-token absorbed extend at 128 heads), each
  with a reason of its own kind; what FlashInfer accepts stays accepted;
* the declaration covers FlashInfer's own refusals: for a grid of batches, whenever the installed FlashInfer's
  plan checks refuse one, the spec that batch describes is refused (needs flashinfer installed);
* a batch over the work-item cap is split into request groups, each planned and run on its own wrapper with
  its own CSR metadata and its own rows of the output (recording stand-in for the wrapper), and every group
  fits FlashInfer's own work count.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from flashinfer_fakes import RecordingWrapper, use_wrapper

from mla_backends.backends.contract import AttentionSpec, configure_backend, release_configured_backends
from mla_backends.backends.reasons import ReasonKind
from mla_backends.core.device import DeviceInfo
from mla_backends.core.dims import MLADims
from mla_backends.flashinfer_mla import FlashInferMLABackend, fa_limits
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from selector import select_backend

H200 = DeviceInfo(kind="cuda", name="NVIDIA H200", compute_capability=(9, 0), sm_count=132, simulated=True)


def fa_reasons(heads: int, max_query_len: int, uniform: bool = True, device: DeviceInfo = H200):
    spec = AttentionSpec(num_heads=heads, max_query_len=max_query_len, uniform_query_len=uniform,
                         block_size=64, device=device)
    return [r for r in FlashInferMLABackend.not_supported_reasons(spec) if r.kind != ReasonKind.PACKAGE
            and r.kind != ReasonKind.VERSION]


# ---- the declaration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [20, 40, 48, 96])
def test_multi_token_causal_batches_at_heads_not_dividing_the_tile_are_refused(heads):
    (reason,) = fa_reasons(heads, 8)
    assert reason.kind == ReasonKind.NUM_HEADS
    assert f"{heads} heads x 8 tokens per request" in str(reason)
    assert "heads dividing 64, or 128 heads" in str(reason) and "FlashInfer" in str(reason)
    (varlen,) = fa_reasons(heads, 8, uniform=False)
    assert varlen.kind == ReasonKind.NUM_HEADS


@pytest.mark.parametrize("heads", [20, 40, 48, 96])
def test_single_token_decode_at_those_heads_stays_accepted(heads):
    assert fa_reasons(heads, 1) == []
    assert fa_reasons(heads, 1, uniform=False) == []


@pytest.mark.parametrize("heads", [1, 8, 16, 32, 64, 128])
def test_heads_dividing_the_tile_keep_multi_token_support(heads):
    for q in (1, 2, 8, 512):
        assert fa_reasons(heads, q) == [] and fa_reasons(heads, q, uniform=False) == []


def test_few_packed_rows_never_cross_a_tile():
    assert fa_reasons(20, 3) == []  # 60 rows: one 64-row tile
    assert fa_reasons(20, 6) == []  # uniform 120 rows: the tile is 128 rows
    assert fa_reasons(20, 6, uniform=False)  # a shorter request can drop the average: 64-row tiles
    assert fa_reasons(256, 1)  # more than 128 heads: even one token spans two tiles


def test_a_16k_token_absorbed_extend_at_128_heads_is_refused_by_its_work_items():
    (reason,) = fa_reasons(128, 16384)
    assert reason.kind == ReasonKind.QUERY_LEN
    assert "16384 at 128 heads (up to 16516 work items with 132 SMs)" in str(reason)
    assert f"at most {16384 - 132} (FlashInfer's fa2/fa3 MLA plan holds 16384 work items" in str(reason)
    assert fa_reasons(128, 16384 - 132) == []
    assert fa_reasons(128, 16384 - 131)  # one more 128-row tile
    # an unknown SM count assumes the bound, so a simulated device is never more permissive than a real one
    assert fa_limits.fa_work_items_reason(128, 16384 - 200, 0) is not None


def test_the_selector_explains_the_refusal_and_picks_another_backend():
    dims = dataclasses.replace(MLADims.preset("deepseek_v3"), num_heads=40)
    sel = select_backend(dims, device=H200, max_query_len=8, backend=None)
    assert sel.name != FlashInferMLABackend.name
    (verdict,) = [v for v in sel.verdicts if v.name == FlashInferMLABackend.name]
    assert any(r.kind == ReasonKind.NUM_HEADS for r in verdict.reasons), verdict.reasons
    ok = select_backend(dataclasses.replace(dims, num_heads=32), device=H200, max_query_len=8)
    (verdict,) = [v for v in ok.verdicts if v.name == FlashInferMLABackend.name]
    assert not any(r.kind == ReasonKind.NUM_HEADS for r in verdict.reasons)


# ---- against FlashInfer's own plan checks ------------------------------------------------------------------
def _fi_checks():
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    mod = importlib.import_module("flashinfer.mla._batch_mla._backends._fa_common")
    count = getattr(mod, "_fa_plan_work_count", None)
    bound = getattr(mod, "_validate_fa_causal_tile_bound", None)
    if count is None or bound is None:
        pytest.skip("this flashinfer has no _fa_plan_work_count/_validate_fa_causal_tile_bound to compare with")
    return count, bound, getattr(mod, "_FA_MAX_WORK_ITEMS", fa_limits.FA_MAX_WORK_ITEMS)


def batches(heads: int) -> list[tuple[list[int], list[int]]]:
    """Random small causal batches plus, for uniform lengths, ones whose first tile end lands its token's
    key on a KV-tile start (the case FlashInfer refuses when the tile ends inside a token)."""
    gen = torch.Generator().manual_seed(heads)
    out = []
    for _ in range(300):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        q = torch.randint(1, 24, (n,), generator=gen).tolist()
        ctx = torch.randint(0, 400, (n,), generator=gen).tolist()
        out.append((q, ctx))
    for q in (1, 2, 3, 4, 8, 16, 33):
        tile = fa_limits.fa_tile_rows([q], heads)
        query = tile // heads
        if query < q:
            out.append(([q, q], [64 - query, 128 - query]))
    return out


@pytest.mark.parametrize("heads", [1, 8, 16, 20, 32, 40, 48, 64, 96, 128, 160, 256])
def test_every_batch_flashinfer_refuses_is_refused_by_the_declaration(heads):
    _, tile_bound, _ = _fi_checks()
    refused_by_fi = 0
    for q_lens, ctx in batches(heads):
        kv = [q + c for q, c in zip(q_lens, ctx, strict=True)]
        try:
            tile_bound(list(q_lens), kv, heads, "fa3", torch.bfloat16, None)
        except ValueError:
            refused_by_fi += 1
            uniform = len(set(q_lens)) == 1
            assert fa_limits.fa_tile_boundary_reason(heads, max(q_lens), uniform) is not None, (heads, q_lens)
    if heads in (20, 40, 48, 96):
        assert refused_by_fi, "the grid should contain batches FlashInfer refuses at these heads"


def test_split_groups_fit_flashinfer_s_own_work_count():
    work_count, _, cap = _fi_checks()
    q_lens = [4096] * 6 + [1] * 50 + [0, 3000]  # 24,000+ query tiles at 128 heads
    kv = [q + 100 for q in q_lens]
    with pytest.raises(ValueError, match="work items"):
        work_count(q_lens, kv, 128, 132, True)
    groups = fa_limits.fa_request_groups(q_lens, 128, 132)
    assert len(groups) > 1
    assert sorted(b for g in groups for b in g) == [b for b, q in enumerate(q_lens) if q]  # zero-token left out
    for g in groups:  # consecutive requests (only zero-token ones skipped), so their tokens are contiguous
        assert all(q_lens[b] == 0 for b in range(g[0], g[-1] + 1) if b not in g)
        sub_q, sub_kv = [q_lens[b] for b in g], [kv[b] for b in g]
        assert work_count(sub_q, sub_kv, 128, 132, True) <= cap


# ---- the split call (recording stand-in) -----------------------------------------------------------------
class Recorder(RecordingWrapper):
    """Each row's output is its own query's first columns; the LSE is the number of wrappers made so far."""

    def write(self, query, out, lse):
        out.copy_(query[0][..., :out.shape[-1]])  # each row's own query: shows which rows a group wrote
        lse.fill_(float(len(Recorder.instances)))


def test_an_over_capacity_batch_is_planned_and_run_per_request_group(monkeypatch):
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (MLAPlanMetadata)")
    from mla_backends.flashinfer_mla import _common, paged

    monkeypatch.setattr(_common, "_WORKSPACES", {})
    monkeypatch.setattr(_common, "WORKSPACE_BYTES", 1 << 16)
    use_wrapper(monkeypatch, Recorder)
    monkeypatch.setattr(fa_limits, "FA_MAX_WORK_ITEMS", 1)  # 16 heads x 8 tokens: one 128-row tile
    q_lens, ctx = [8, 0, 8, 8], [5, 9, 20, 0]
    cache = LatentKVCache(12, 16, model_dtype=torch.bfloat16)
    table = [[0, 1, -1], [2, -1, -1], [3, 4, 5], [6, -1, -1]]
    meta = BatchMetadata.build(q_lens, ctx, table, 16, num_blocks=12, decode_threshold=1)
    T = meta.num_tokens
    q = torch.randn(T, 16, 512).to(torch.bfloat16)
    qr = torch.randn(T, 16, 64).to(torch.bfloat16)
    monkeypatch.setattr(paged, "fa_backend_for", lambda device: "fa3")
    release_configured_backends()  # a fresh pool: its wrappers are this test's stand-ins
    spec = AttentionSpec(num_heads=16, dtype=torch.bfloat16, block_size=16)
    backend = configure_backend(FlashInferMLABackend, spec, 0.1)
    state = backend.prepare(meta)  # the step's state, as plan_step makes it: every group planned here
    assert all(len(w.plans) == 1 and not w.runs for w in Recorder.instances)
    for _ in range(2):  # two layers of one step: each group planned once
        out, lse = backend._launch(q, qr, cache, meta, scale=0.1, out=None, lse_out=None, fi_backend="fa3",
                                   state=state)
    assert len(Recorder.instances) == 3  # three groups, one wrapper each
    assert all(len(w.plans) == 1 and len(w.runs) == 2 for w in Recorder.instances)
    assert torch.equal(out, q)  # every group wrote its own rows, in place
    starts = meta.query_starts_list
    planned = []
    for w in Recorder.instances:
        md = w.plans[0]["metadata"]
        assert md.qo_indptr.tolist() == [0, 8]  # one 8-token request per group (one tile each; no SMs on the CPU)
        planned.append(int(md.kv_len_arr[0]))
        run = w.runs[-1]  # the second call, which returned `out`
        assert run["out"].shape[0] == 8 and run["out"].data_ptr() in {
            out[starts[b]:].data_ptr() for b in range(meta.num_requests)}
    # the zero-token request (context 9) is in no plan; the others each in one
    assert sorted(planned) == sorted(s for s, n in zip(meta.seq_lens_list, meta.query_lens_list, strict=True)
                                     if n)


# ---- the fp8 scale FlashInfer's fa kernels apply (rounded to bf16) ----------------------------------------
def test_the_applied_fp8_scale_is_the_bf16_rounding_and_its_bias_is_bounded():
    assert fa_limits.fa_applied_fp8_scale(0.37) == 0.369140625  # 0.37 is not a bf16 value
    assert fa_limits.fa_applied_fp8_scale(0.5) == 0.5 and fa_limits.fa_applied_fp8_scale(3.0) == 3.0
    bias = abs(fa_limits.fa_applied_fp8_scale(0.37) / 0.37 - 1)
    assert 2 ** -9 < bias <= fa_limits.FA_FP8_SCALE_MAX_BIAS  # above 2**-9: the bound is half a bf16 ulp, 2**-8
    worst = max(abs(fa_limits.fa_applied_fp8_scale(x) / x - 1) for x in torch.linspace(0.01, 8.0, 4001).tolist())
    assert worst <= fa_limits.FA_FP8_SCALE_MAX_BIAS


def test_the_declared_fp8_tolerance_covers_the_scale_rounding_on_the_conformance_cases():
    """The conformance reference dequantises with the exact scale: the bias of the bf16-rounded scale alone
    (the reference recomputed with the applied scale) must fit the room the fp8 tolerance adds over bf16's."""
    from mla_backends.backends.contract import DEFAULT_TOLERANCES, Tolerance
    from mla_backends.testing.checks import tolerance_for
    from mla_backends.testing.inputs import expected, prepare
    from mla_backends.testing.matrix import build_matrix

    key, declared = tolerance_for(FlashInferMLABackend, torch.bfloat16, "fp8_e4m3")
    base = DEFAULT_TOLERANCES["bfloat16"]
    assert key == "bfloat16/fp8_e4m3"
    room = Tolerance(declared.atol - base.atol, declared.rtol - base.rtol)
    cases = [c for c in build_matrix(FlashInferMLABackend).output if c.kv_cache_dtype == "fp8_e4m3"]
    assert {c.fp8_scale for c in cases} >= {0.37}
    for case in cases:
        p = prepare(case, torch.device("cpu"))
        exact_o, exact_lse = expected(p)
        stored = float(p.cache.scale.item())  # the rows were dequantised with it
        p.rows = [r * (fa_limits.fa_applied_fp8_scale(stored) / stored) for r in p.rows]
        o, lse = expected(p)
        assert not torch.equal(o, exact_o)  # the rounding does move the result
        for got, ref, what in ((o, exact_o, "out"), (lse, exact_lse, "lse")):
            excess = (got - ref).abs() - (room.atol + room.rtol * ref.abs())
            assert float(excess.max()) <= 0, f"{case.name} {what}: the bias exceeds the fp8 room by {excess.max()}"
