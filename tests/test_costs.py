"""The cost model reproduces every figure the seed derives from the DeepSeek-V3 shapes.

Each expected value is the seed's published number; where the seed rounds (68.6 KiB, 71x, 242, ~4.7, ~171),
the test pins the exact value and checks that it rounds to the seed's figure.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mla_backends.cli import reports
from mla_backends.core.dims import IndexerDims, MLADims
from mla_backends.core.gpus import gpu_spec
from mla_backends.planning import costs
from mla_backends.planning.roofline import model_decode_roofline


@pytest.fixture(scope="module")
def v3() -> MLADims:
    return MLADims.deepseek_v3()


@pytest.fixture(scope="module")
def v32() -> MLADims:
    return MLADims.deepseek_v32()


# ---- cache bytes -----------------------------------------------------------------------------------------
def test_latent_bytes(v3):
    assert costs.latent_bytes_per_token_per_layer(v3, 2) == 1_152
    assert costs.latent_bytes_per_token(v3, 2) == 70_272
    assert costs.latent_bytes_per_token(v3, 2) / costs.KiB == 68.625
    assert costs.latent_bytes_per_token(v3, 1) == 35_136  # fp8
    assert costs.latent_bytes_per_token(v3, 2, num_layers=1) == 1_152


def test_expanded_bytes_and_ratio(v3):
    assert costs.expanded_bytes_per_token_per_layer(v3, 2) == 81_920
    assert costs.expanded_bytes_per_token(v3, 2) == 4_997_120
    assert costs.expanded_bytes_per_token(v3, 2) / costs.MiB == 4.765625
    assert costs.expanded_ratio(v3) == pytest.approx(4_997_120 / 70_272)
    assert round(costs.expanded_ratio(v3), 2) == 71.11
    # per rank the expanded cache shards with the heads, the latent does not
    assert costs.expanded_ratio(v3, tp=8) == pytest.approx(71.11111 / 8, rel=1e-5)
    # K-nope and V never cached: 65,536 bytes, 57x the cached row
    assert costs.uncached_kv_bytes_per_token_per_layer(v3) == 65_536
    assert round(costs.uncached_kv_bytes_per_token_per_layer(v3) / costs.latent_bytes_per_token_per_layer(v3)) == 57


def test_element_bytes():
    assert costs.element_bytes("auto", "bfloat16") == 2
    assert costs.element_bytes("auto", "float32") == 4
    assert costs.element_bytes("fp8") == 1
    assert costs.element_bytes("fp8_e5m2") == 1
    assert costs.element_bytes("float16") == 2
    with pytest.raises(ValueError, match="kv_cache_dtype: got 'int4'"):
        costs.element_bytes("int4")


def test_gqa_comparison_and_tp_break_even(v3):
    assert costs.LLAMA3_70B.num_kv_heads == 8
    assert costs.gqa_bytes_per_token(costs.LLAMA3_70B, 2) == 327_680 == 320 * costs.KiB
    # sharded: per rank shrinks, cluster total stays until TP exceeds the 8 KV heads
    assert costs.gqa_bytes_per_token(costs.LLAMA3_70B, 2, tp=8) == 40 * costs.KiB
    assert costs.gqa_cluster_bytes_per_token(costs.LLAMA3_70B, 2, tp=8) == 327_680
    assert costs.gqa_cluster_bytes_per_token(costs.LLAMA3_70B, 2, tp=16) == 2 * 327_680
    # replicated: the MLA cluster total grows with TP
    assert costs.mla_cluster_bytes_per_token(v3, 2, tp=4) == 4 * 70_272
    be = costs.tp_break_even(v3)
    assert be == pytest.approx(327_680 / 70_272)
    assert round(be, 1) == 4.7
    assert (
        costs.mla_cluster_bytes_per_token(v3, 2, tp=4)
        < 327_680
        < costs.mla_cluster_bytes_per_token(v3, 2, tp=5)
    )


def test_v32_indexer_counts_in_the_cluster_bytes_and_break_even(v3, v32):
    assert costs.cache_bytes_per_token(v3) == costs.latent_bytes_per_token(v3) == 70_272
    assert costs.cache_bytes_per_token(v32) == 70_272 + 8_052 == 78_324
    assert costs.mla_cluster_bytes_per_token(v32, 2, tp=4) == 4 * 78_324
    be = costs.tp_break_even(v32)
    assert be == pytest.approx(327_680 / 78_324) and round(be, 1) == 4.2  # "drops to 4.2"
    rep = reports.kv_cache_report(v32, tp=4)
    assert rep["tp_break_even"] == be
    assert rep["cluster_bytes_per_token"] == costs.mla_cluster_bytes_per_token(v32, 2, tp=4)
    assert rep["indexer_overhead"] == costs.indexer_overhead(v32)


def test_decode_arithmetic_intensity(v3):
    i1 = costs.decode_arithmetic_intensity(v3, 2, tp=1)
    i8 = costs.decode_arithmetic_intensity(v3, 2, tp=8)
    assert i1 == 278_528 / 1_152 and round(i1) == 242
    assert i8 == 34_816 / 1_152 and round(i8) == 30
    assert i1 / i8 == pytest.approx(8)  # decays as 1/TP
    assert costs.gqa_decode_arithmetic_intensity(costs.LLAMA3_70B, 2) == 8
    ridge = gpu_spec("h100").ridge_flop_per_byte()
    assert round(ridge) == 295
    assert round(100 * round(i1) / round(ridge)) == 82  # "82 % of the H100's ridge"


# ---- FLOPs -----------------------------------------------------------------------------------------------
def test_flops_per_token(v3):
    assert costs.up_projection_flops_per_context_token(v3) == 33_554_432
    assert costs.fold_flops_per_query_token(v3) == 33_554_432  # folds cost exactly the up-projection
    assert costs.absorbed_core_flops_per_context_token(v3) == 278_528
    assert costs.expanded_core_flops_per_context_token(v3) == 81_920
    assert costs.core_cost_factor(v3) == pytest.approx(3.4)
    assert costs.up_projection_flops_per_context_token(v3, tp=8) == 33_554_432 // 8


def test_decode_roofline_at_4096(v3):
    r1 = model_decode_roofline(v3, 4096)  # the one roofline model, peaks from the GPU table (H100 SXM)
    assert round(r1.flops / 1e9, 1) == 69.6
    assert round(r1.bytes / 1e6, 1) == 287.8
    assert round(r1.compute_us) == 70 and round(r1.memory_us) == 86
    assert r1.bound == "memory" and r1.roofline_us == r1.memory_us
    r8 = model_decode_roofline(v3, 4096, tp=8)
    assert round(r8.compute_us, 1) == 8.8 and r8.bytes == r1.bytes
    assert model_decode_roofline(v3, 4096, gpu="h200").memory_us < r1.memory_us  # 4.8 TB/s against 3.35
    with pytest.raises(ValueError, match="context_len: got 0"):
        model_decode_roofline(v3, 0)
    # "33.55 MFLOP together, under 3 % of the 1.14 GFLOP attention core" (one layer, S=4096)
    core = 4096 * costs.absorbed_core_flops_per_context_token(v3)
    assert round(core / 1e9, 2) == 1.14 and costs.fold_flops_per_query_token(v3) / core < 0.03


def test_path_comparison(v3):
    q, s = 7, 300
    assert costs.absorbed_path_flops(v3, q, s) == q * 33_554_432 + q * s * 278_528
    assert costs.expanded_path_flops(v3, q, s) == s * 33_554_432 + q * s * 81_920
    # one query: absorption wins from context 2
    assert costs.cheaper_path(v3, 1, 1) == "expanded"
    assert costs.cheaper_path(v3, 1, 2) == "absorbed"
    assert costs.min_context_for_absorption(v3, 1) == 2
    # the condition from the seed: 33,554,432 (Q/S) + 196,608 Q < 33,554,432
    for qq, ss in [(100, 1000), (170, 10**6), (171, 10**6), (128, 512), (129, 512)]:
        expect = 33_554_432 * qq / ss + 196_608 * qq < 33_554_432
        assert (costs.cheaper_path(v3, qq, ss) == "absorbed") == expect


def test_asymptotic_threshold_and_crossover(v3):
    t = costs.asymptotic_query_threshold(v3)
    assert t == 33_554_432 / 196_608 and round(t) == 171
    # independent of TP (heads cancel) and approached from below by the finite-S crossover
    assert costs.asymptotic_query_threshold(MLADims.kimi_k2()) == t
    prev = 0.0
    for s in (512, 4096, 32768, 1 << 20):
        c = costs.crossover_query_len(v3, s)
        assert prev < c < t
        below, above = math.ceil(c) - 1, math.floor(c) + 1
        assert costs.absorbed_path_flops(v3, below, s) < costs.expanded_path_flops(v3, below, s)
        assert costs.absorbed_path_flops(v3, above, s) > costs.expanded_path_flops(v3, above, s)
        prev = c
    assert costs.crossover_query_len(v3, 512) == 128.0  # a tie: equal FLOPs at Q=128, S=512
    assert costs.absorbed_path_flops(v3, 128, 512) == costs.expanded_path_flops(v3, 128, 512)
    assert costs.cheaper_path(v3, 128, 512) == "expanded"  # ties go to expanded
    assert costs.min_context_for_absorption(v3, 171) is None
    assert costs.min_context_for_absorption(v3, 170) is not None


def test_documented_crossovers(v3):
    # docs/cost-model.md: rectangular 163.8 at 4,096, 169.8 at 32,768, 170.4 at 131,072; causal 167.2 at 4,096
    rect = {s: round(costs.crossover_query_len(v3, s), 1) for s in (4096, 32768, 131072)}
    assert rect == {4096: 163.8, 32768: 169.8, 131072: 170.4}
    assert round(costs.crossover_query_len(v3, 4096, causal=True), 1) == 167.2


def test_causal_pairs_and_crossover(v3):
    assert costs.attention_pairs(3, 5, causal=True) == 21  # the seed's prefix P=5, Q=3 check
    assert costs.attention_pairs(3, 5) == 15
    s = 4096
    c = costs.crossover_query_len(v3, s, causal=True)
    lo, hi = math.ceil(c) - 1, math.floor(c) + 1
    assert costs.cheaper_path(v3, lo, s, causal=True) == "absorbed"
    assert costs.cheaper_path(v3, hi, s, causal=True) == "expanded"
    assert c < costs.asymptotic_query_threshold(v3)


# ---- workspace -------------------------------------------------------------------------------------------
def test_workspace(v3):
    assert costs.workspace_rows(163_840, 256, 16) == 65_536  # capped
    assert costs.workspace_rows(2048, 256, 16) == 16_384  # 8 full-length requests
    assert costs.workspace_rows(1024, 1024, 16) == 65_536  # 4 pages per seq = 65,536
    assert costs.workspace_rows(1024, 512, 16) == 32_768
    from mla_backends.layer.workspace import MAX_WORKSPACE_ROWS

    assert costs.WORKSPACE_MAX_ROWS == MAX_WORKSPACE_ROWS == 65_536
    assert costs.workspace_latent_bytes(v3, 65_536) == 75_497_472 == 72 * costs.MiB
    assert costs.workspace_upprojected_bytes(v3, 65_536) == 3_221_225_472 == 3 * costs.GiB
    assert costs.workspace_upprojected_bytes(v3, 65_536, include_values=True) == 65_536 * 128 * 320 * 2
    # forward_mha's own workspace: per-head K-nope and V (256 wide), 4 GiB, 57x the latent chunk
    kv = 65_536 * costs.uncached_kv_bytes_per_token_per_layer(v3)
    assert kv == 4 * costs.GiB and round(kv / costs.workspace_latent_bytes(v3, 65_536)) == 57


# ---- V3.2 indexer ----------------------------------------------------------------------------------------
def test_indexer(v3, v32):
    assert costs.indexer_bytes_per_token_per_layer(v32) == 132
    assert costs.indexing_layers(v32) == 61
    assert costs.indexer_bytes_per_token(v32) == 8_052
    assert round(costs.indexer_bytes_per_token(v32) / costs.KiB, 2) == 7.86
    assert round(100 * costs.indexer_overhead(v32), 1) == 11.5
    assert costs.indexer_bytes_per_token(v3) == 0  # dense model: no indexer


def test_indexer_skip_layers(v32):
    skipping = replace(v32, indexer=IndexerDims(skip_layers=frozenset(range(1, 61, 2))))  # every odd layer
    assert costs.indexing_layers(skipping) == 31
    assert costs.indexer_bytes_per_token(skipping) == 31 * 132
    out_of_range = replace(v32, indexer=IndexerDims(skip_layers=frozenset({0, 99})))
    assert costs.indexing_layers(out_of_range) == 60


# ---- reports and validation ------------------------------------------------------------------------------
def test_kv_cache_report(v3, v32):
    rep = reports.kv_cache_report(v32, context_len=4096, gpu_memory_gib=10)
    assert rep["bytes_per_token_per_layer"] == 1_152
    assert rep["bytes_per_token"] == 70_272
    assert rep["indexer_bytes_per_token"] == 8_052
    assert rep["total_bytes_per_token"] == 78_324
    assert rep["tokens_that_fit"] == 10 * costs.GiB // 78_324
    assert rep["sequences_that_fit"] == 10 * costs.GiB // (4096 * 78_324)
    assert rep["gqa_tokens_that_fit"] == 10 * costs.GiB // 327_680
    fp8 = reports.kv_cache_report(v3, kv_cache_dtype="fp8", tp=8)
    assert fp8["bytes_per_token"] == 35_136 and fp8["expanded_bytes_per_token"] == 4_997_120 // 2 // 8
    assert fp8["kv_cache_dtype"] == "fp8_e4m3"
    # "auto" is reported as the dtype actually stored
    assert reports.kv_cache_report(v3, model_dtype="float16")["kv_cache_dtype"] == "float16"


def test_crossover_report(v3):
    rep = reports.crossover_report(v3, query_lens=[1, 200], contexts=[4096])
    assert rep["asymptotic_query_threshold"] == pytest.approx(170.6667, abs=1e-4)
    cells = rep["contexts"][0]["paths"]
    assert [c["cheaper"] for c in cells] == ["absorbed", "expanded"]
    # a tie (Q=128, S=512: equal FLOPs) goes to expanded, as in cheaper_path; the TP size changes no verdict
    tie = reports.crossover_report(v3, query_lens=[128], contexts=[512], tp=8)["contexts"][0]["paths"][0]
    assert tie["absorbed_flops"] == tie["expanded_flops"] and tie["cheaper"] == "expanded"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: costs.latent_bytes_per_token(d, 0), "dtype_bytes: got 0"),
        (lambda d: costs.latent_bytes_per_token("v3"), "dims: got str"),
        (lambda d: costs.expanded_bytes_per_token(d, tp=3), "tp: got 3; supported a divisor"),
        (lambda d: costs.absorbed_path_flops(d, 0, 10), "query_len: got 0"),
        (lambda d: costs.workspace_rows(0, 1, 16), "max_model_len: got 0"),
        (lambda d: reports.kv_cache_report(d, gpu_memory_gib=-1.0), "gpu_memory_gib: got -1.0"),
        (lambda d: costs.gqa_bytes_per_token("llama"), "gqa: got str"),
        (lambda d: costs.latent_bytes_per_token(d, 2.0), "dtype_bytes: got float"),
    ],
)
def test_validation(v3, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(v3)


def test_up_projection_and_fold_use_d_nope_and_d_v_separately(v3):
    # DeepSeek's d_nope == d_v == 128 hides a mix-up; give V a different width
    d = replace(v3, v_head_dim=64)
    assert costs.up_projection_flops_per_context_token(d) == 2 * 512 * 128 * (128 + 64)  # 25,165,824
    assert costs.fold_flops_per_query_token(d) == 2 * 128 * 128 * 512 + 2 * 128 * 512 * 64
    assert costs.expanded_core_flops_per_context_token(d) == 2 * 128 * (192 + 64)


def test_causal_crossover_is_the_root_of_the_flop_balance(v3):
    # solve diff * (Q S + Q (Q + 1) / 2) = S * up by bisection, with V3's figures written out
    diff, up = 278_528 - 81_920, 33_554_432
    for s in (0, 1, 512, 4096):
        lo, hi = 0.0, 1000.0
        for _ in range(200):
            mid = (lo + hi) / 2
            if diff * (mid * s + mid * (mid + 1) / 2) < s * up:
                lo = mid
            else:
                hi = mid
        assert costs.crossover_query_len(v3, s, causal=True) == pytest.approx(lo, rel=1e-9, abs=1e-9)


def test_per_rank_dims_give_per_rank_figures():
    """Cost functions given a tensor-parallel view count that rank's heads, not the whole model's."""
    v3 = MLADims.deepseek_v3()
    rank = v3.tensor_parallel(8)
    assert costs.expanded_bytes_per_token(rank) == costs.expanded_bytes_per_token(v3, tp=8) == 624_640
    assert costs.expanded_bytes_per_token(v3) == 8 * 624_640
    for fn in (costs.absorbed_path_flops, costs.expanded_path_flops):
        assert fn(rank, 16, 4096, causal=True) == fn(v3, 16, 4096, tp=8, causal=True)
        assert 8 * fn(rank, 16, 4096) == fn(v3, 16, 4096)
    assert costs.absorbed_path_flops(rank, 1, 256, tp=8) == costs.absorbed_path_flops(rank, 1, 256)
    with pytest.raises(ValueError, match="tp: got 2 for per-rank dims"):
        costs.expanded_bytes_per_token(rank, tp=2)
