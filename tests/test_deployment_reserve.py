"""The capacity answer: the driver's memory, the reserve an engine holds back, the exact byte equation, and
one deployment worked by hand (DeepSeek-V3 on 8 H200, TP=8, fp8 and bf16 cache, DCP 1 and 8)."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest

from mla_backends.cli import main, reports
from mla_backends.core.dims import MLADims
from mla_backends.planning import deployment, reserve

V3 = MLADims.deepseek_v3()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _v3_fp8_weights_per_rank_tp8() -> int:
    """DeepSeek-V3's weights on one of 8 ranks, written out: fp8 linear layers with a float32 scale per 128x128
    block, bf16 norms, router, embedding and lm_head; per-head projections, MLP, experts and vocabulary split
    8 ways; q_a / kv_a and norms replicated; MTP not counted."""
    def fp8(rows: int, cols: int) -> int:  # bytes of one [rows, cols] fp8 matrix with its block scales
        return rows * cols + 4 * _ceil(rows, 128) * _ceil(cols, 128)

    hidden, heads, q_lora, rank, rope, nope, v = 7168, 128, 1536, 512, 64, 128, 128
    attention = (fp8(q_lora, hidden) + fp8(heads * (nope + rope), q_lora) / 8 + 2 * q_lora
                 + fp8(rank + rope, hidden) + fp8(heads * (nope + v), rank) / 8 + fp8(hidden, heads * v) / 8
                 + 2 * rank + 2 * 2 * hidden)
    dense_mlp = 3 * fp8(18432, hidden) / 8
    moe = (256 + 1) * 3 * fp8(2048, hidden) / 8 + 2 * 256 * hidden
    embedding_and_head = 2 * (2 * 129280 * hidden) / 8 + 2 * hidden
    return math.ceil(61 * attention + 3 * dense_mlp + 58 * moe + embedding_and_head)


def _v3_reserve_tp8(dcp: int) -> dict[str, int]:
    """The four reserve terms for V3 at TP=8, bf16 activations, 8,192 batched tokens, 256 sequences."""
    hidden, tokens, seqs = 7168, 8192, 256
    attention = 1536 + 512 + 64 + 16 * (2 * (128 + 64) + 2 * 128)  # latents + 16 heads' q, k, v, output
    dense = 3 * 18432 // 8
    act_per_token = (2 * hidden + max(attention, dense)) * 2  # 53,376 B
    moe_per_token = 8 * (max(2 * 2048 // 8, hidden) + 2048 // 8) * 2  # 8 experts per token: 118,784 B
    nccl_one = 16 * 2 * (4 * 2**20 + 4_915_200 + 524_288)  # channels x connections x (Simple + LL128 + LL)
    return {"activations": tokens * act_per_token + seqs * 129280 * 4,
            "moe_dispatch": tokens * moe_per_token,
            "cuda_graph_pool": 512 * (act_per_token + moe_per_token),
            "nccl": (2 if dcp > 1 else 1) * nccl_one}


# tokens per rank the hand computation gives (and docs/cost-model.md's worked table shows)
EXPECTED_TOKENS_PER_RANK = {("bfloat16", 1): 682_885, ("bfloat16", 8): 678_498,
                            ("fp8_e4m3", 1): 1_365_771, ("fp8_e4m3", 8): 1_356_997}


@pytest.mark.parametrize("cache", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("dcp", [1, 8])
def test_v3_on_8_h200_by_hand(capsys, cache, dcp):
    memory = 143_771 * 2**20  # what nvidia-smi reports for an H200
    usable = memory * 9 // 10  # x 0.9, rounded down to a byte
    weights = _v3_fp8_weights_per_rank_tp8()
    workspace = 65_536 * (512 + 64 + 16 * (128 + 128)) * 2  # 64k rows: latent row + 16 heads' K-nope and V
    terms = _v3_reserve_tp8(dcp)
    held = sum(terms.values())
    cache_bytes = usable - weights - workspace - held
    per_token = 61 * (512 + 64) * (2 if cache == "bfloat16" else 1)
    tokens = cache_bytes // per_token
    assert tokens == EXPECTED_TOKENS_PER_RANK[cache, dcp]

    assert main(["kv-cache", "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--dcp", str(dcp),
                 "--kv-cache-dtype", cache, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["gpu_memory_bytes"] == memory and rep["usable_bytes"] == usable
    assert rep["weights_bytes_per_rank"] == weights and rep["workspace_bytes"] == workspace
    assert rep["reserve_terms"] == terms and rep["reserve_bytes"] == held
    assert rep["cache_bytes_per_rank"] == cache_bytes and rep["cache_bytes_per_token"] == per_token
    assert rep["tokens_per_rank"] == tokens and rep["cluster_tokens"] == tokens * dcp
    assert rep["gpu_memory_confirmed"] is True and "sglang#3196" in rep["gpu_memory_source"]


def _equation_holds(rep: dict) -> None:
    exact = math.floor(rep["gpu_memory_bytes"] * Fraction(str(rep["gpu_memory_utilization"])))
    parts = (rep["weights_bytes_per_rank"], rep["workspace_bytes"], rep["reserve_bytes"], rep["cache_bytes_per_rank"])
    assert all(isinstance(p, int) for p in parts) and isinstance(rep["usable_bytes"], int)
    assert rep["usable_bytes"] == exact == sum(parts)
    assert all(isinstance(v, int) for v in rep["reserve_terms"].values())
    assert sum(rep["reserve_terms"].values()) == rep["reserve_bytes"]


@pytest.mark.parametrize("argv", [
    ["--gpu", "h200", "--tp", "8"],
    ["--model", "deepseek-v2-lite", "--gpu", "h100", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.87"],
    ["--gpu-memory", "141GB", "--tp", "8", "--dcp", "4", "--gpu-memory-utilization", "0.93"],
    ["--gpu", "b200", "--tp", "8", "--dp-attention", "--max-num-batched-tokens", "16384"],
    ["--gpu", "h200", "--tp", "8", "--reserve", "2.5GiB"],
    ["--model", "deepseek-v2-lite", "--gpu-memory", "80GiB", "--tp", "1", "--reserve", "0"],
    # 100 GiB x 0.57 is 61,203,283,968 exactly; the binary float product falls just short of it
    ["--model", "deepseek-v2-lite", "--gpu-memory", "100", "--gpu-memory-utilization", "0.57"],
])
def test_json_byte_equation_is_exact(capsys, argv):
    """usable_bytes = floor(memory x utilization) = weights + workspace + reserve + cache, in integers, and
    the reserve_terms add up to reserve_bytes."""
    assert main(["kv-cache", *argv, "--json"]) == 0
    _equation_holds(json.loads(capsys.readouterr().out))


def test_gpu_memory_overrides_the_table(capsys):
    assert main(["kv-cache", "--gpu", "h200", "--gpu-memory", "141GB", "--tp", "8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["gpu_memory_bytes"] == 141 * 10**9 and rep["usable_bytes"] == 141 * 10**9 * 9 // 10
    assert rep["gpu"] == "NVIDIA H200 SXM" and "gpu_memory_source" not in rep  # the table's figure was not used
    _equation_holds(rep)


def test_reserve_override_replaces_the_modelled_total(capsys):
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--json"]) == 0
    modelled = json.loads(capsys.readouterr().out)
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--reserve", "2.5GiB", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert modelled["reserve_source"] == "model" and set(modelled["reserve_terms"]) == set(reserve.RESERVE_TERMS)
    assert given["reserve_source"] == "--reserve" and given["reserve_terms"] == {"reserve_override": 5 * 2**29}
    assert given["reserve_bytes"] == 5 * 2**29 and given["reserve_modelled_terms"] == modelled["reserve_terms"]
    assert given["cache_bytes_per_rank"] == modelled["cache_bytes_per_rank"] + modelled["reserve_bytes"] - 5 * 2**29
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--reserve", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reserve_bytes"] == 0


def test_text_report_shows_every_term(capsys):
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--dcp", "8"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 SXM (150.8 GB = 140.4 GiB, utilization 0.9)" in out
    for line in ("usable                135.68 GB", "reserve                 2.25 GB per rank held back",
                 "activations           0.57 GB (8,192 batched tokens", "MoE dispatch          0.97 GB",
                 "CUDA-graph pool       0.09 GB (decode batches up to 512)", "NCCL                  0.62 GB (2 "
                 "communicators)", "tokens per rank 678,498"):
        assert line in out, line
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--reserve", "3GB"]) == 0
    out = capsys.readouterr().out
    assert "reserve                 3.00 GB per rank (--reserve)" in out and "MoE dispatch" not in out
    assert main(["kv-cache", "--model", "deepseek-v2-lite", "--gpu", "h100-pcie"]) == 0
    assert "memory is not confirmed" in capsys.readouterr().out  # a flagged row says so


def test_max_num_batched_tokens_scales_the_activation_terms():
    shape = deployment.model_shape(V3)
    base = reserve.reserve_terms(V3, shape, tp=8)
    big = reserve.reserve_terms(V3, shape, tp=8, max_num_batched_tokens=16384)
    logits = 256 * 129280 * 4
    assert big["activations"] - logits == 2 * (base["activations"] - logits)
    assert big["moe_dispatch"] == 2 * base["moe_dispatch"]
    assert (big["cuda_graph_pool"], big["nccl"]) == (base["cuda_graph_pool"], base["nccl"])
    assert reserve.reserve_terms(V3, shape, tp=1)["nccl"] == 0  # one rank: no communicator
    dense = MLADims.deepseek_v2_lite()
    assert reserve.reserve_terms(dense, deployment.ModelShape(102400, 10944, 0, 0, 0, 10**9), tp=1)[
        "moe_dispatch"] == 0
    with pytest.raises(ValueError, match="num_experts_per_tok: got 0 for a model with 256 routed experts"):
        reserve.reserve_terms(V3, deployment.ModelShape(129280, 18432, 2048, 256, 1, 3), tp=8)


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu", "h200", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: got '0'"),
    (["--gpu", "h200", "--max-num-batched-tokens", "many"], "--max-num-batched-tokens: got 'many'"),
    (["--gpu", "h200", "--reserve=-1GB"], "--reserve: got '-1GB'; supported a non-negative size"),
    (["--gpu", "h200", "--reserve", "lots"], "--reserve: got 'lots'"),
    (["--max-num-batched-tokens", "4096"], "--max-num-batched-tokens: got 4096 without --gpu"),
    (["--reserve", "1GB"], "--reserve: got 1GB without --gpu"),
    (["--gpu", "h200", "--tp", "8", "--reserve", "60GB"], "--reserve: got 60.00 GB (60,000,000,000 B) per rank"),
])
def test_new_flags_are_validated(capsys, argv, message):
    assert main(["kv-cache", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_deployment_report_checks_its_arguments():
    with pytest.raises(ValueError, match="--max-num-batched-tokens: got 0"):
        reports.deployment_report(V3, gpu_memory_bytes=10**12, tp=8, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="--reserve: got -1"):
        reports.deployment_report(V3, gpu_memory_bytes=10**12, tp=8, reserve_bytes=-1)
    with pytest.raises(TypeError, match="--gpu-memory: got float"):
        reports.deployment_report(V3, gpu_memory_bytes=1.5e11, tp=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--gpu-memory-utilization: got nan"):
        reports.deployment_report(V3, gpu_memory_bytes=10**12, tp=8, gpu_memory_utilization=float("nan"))


@pytest.mark.parametrize("spelling", ["deepseek-r1", "r1", "DeepSeek_R1"])
def test_r1_keeps_its_name(capsys, spelling):
    """--model deepseek-r1 has V3's dims but every report calls it deepseek-r1."""
    for argv in (["kv-cache"], ["kv-cache", "--gpu", "h200", "--tp", "8"], ["crossover"]):
        assert main([*argv, "--model", spelling]) == 0
        assert capsys.readouterr().out.startswith("deepseek-r1")
        assert main([*argv, "--model", spelling, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == "deepseek-r1"
    assert main(["kv-cache", "--model", "v3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "deepseek-v3"
