"""Deployment sizing (``mla-backends kv-cache --gpu``): weights per rank, workspace, cache tokens, DCP."""

from __future__ import annotations

import json

import pytest

from mla_backends.cli import main, reports
from mla_backends.core.dims import MLADims
from mla_backends.core.gpus import gpu_spec
from mla_backends.planning import costs, deployment, reserve
from mla_backends.step.plan import plan_step

V3 = MLADims.deepseek_v3()


def test_gpu_table_holds_what_the_driver_reports():
    assert gpu_spec("H200").memory_bytes == 143_771 * 2**20  # nvidia-smi's total, not the data sheet's 141e9
    for name in ("a100", "h100", "h200", "b200"):
        g = gpu_spec(name)
        assert g.sms > 0 and g.bandwidth_bytes_per_s > 1e12 and g.compute_capability[0] >= 8
    with pytest.raises(ValueError, match="gpu name: got 'tpu'"):
        gpu_spec("tpu")


@pytest.mark.parametrize(("text", "nbytes"), [("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("80", 80 * 2**30),
                                              ("512MiB", 512 * 2**20), ("1.5TB", 1_500 * 10**9)])
def test_parse_memory(text, nbytes):
    assert deployment.parse_memory(text) == nbytes


@pytest.mark.parametrize("bad", ["0", "-3GB", "12XB", ""])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="--gpu-memory: got"):
        deployment.parse_memory(bad)


def test_v3_weights_as_published():
    shape = deployment.model_shape(V3)
    bf16 = deployment.weight_bytes_per_rank(V3, shape, weights_dtype="bfloat16")
    assert 670e9 < bf16 / 2 < 672e9  # 671B parameters without the MTP module
    fp8 = deployment.weight_bytes_per_rank(V3, shape, weights_dtype="fp8_e4m3", tp=8)
    assert 84e9 < fp8 < 86e9  # one byte a parameter, block scales, bf16 embedding and head, split 8 ways
    dp = deployment.weight_bytes_per_rank(V3, shape, weights_dtype="fp8_e4m3", tp=8, dp_attention=True)
    assert dp > fp8  # whole attention on every rank


def test_dcp_multiplies_cluster_tokens_and_costs_communication():
    base = reports.deployment_report(V3, gpu_memory_bytes=141 * 10**9, tp=8, dcp=1)
    for d in (2, 4, 8):
        rep = reports.deployment_report(V3, gpu_memory_bytes=141 * 10**9, tp=8, dcp=d)
        # the same rows per rank, less the DCP group's own NCCL communicator buffers
        assert rep["reserve_bytes"] == base["reserve_bytes"] + reserve.NCCL_BYTES_PER_COMMUNICATOR
        assert rep["tokens_per_rank"] == (base["cache_bytes_per_rank"] - reserve.NCCL_BYTES_PER_COMMUNICATOR) // (
            costs.cache_bytes_per_token(V3, 2))
        assert rep["cluster_tokens"] == d * rep["tokens_per_rank"]
        comm = rep["dcp_comm_bytes_per_token_per_layer"]
        assert comm["decode_query_all_gather"] == (d - 1) * 16 * 576 * 2
        assert comm["decode_output_reduce_scatter"] == (d - 1) * 16 * 512 * 2
        assert comm["tp_all_reduce"] == base["dcp_comm_bytes_per_token_per_layer"]["tp_all_reduce"]
    assert all(v == 0 for k, v in base["dcp_comm_bytes_per_token_per_layer"].items() if k != "tp_all_reduce")
    left = 141 * 10**9 * 9 // 10 - base["weights_bytes_per_rank"] - base["workspace_bytes"] - base["reserve_bytes"]
    assert base["tokens_per_rank"] == left // costs.cache_bytes_per_token(V3, 2)


def test_dp_attention_counts_every_rank_as_a_group():
    rep = reports.deployment_report(V3, gpu_memory_bytes=141 * 10**9, tp=8, dp_attention=True)
    assert rep["data_parallel_groups"] == 8 and rep["cluster_tokens"] == 8 * rep["tokens_per_rank"]
    with pytest.raises(ValueError, match="--dcp: got 2 with --dp-attention"):
        reports.deployment_report(V3, gpu_memory_bytes=141 * 10**9, tp=8, dcp=2, dp_attention=True)


def test_cli_json_and_warning(capsys):
    rc = main(["kv-cache", "--gpu", "h200", "--tp", "8", "--dcp", "4", "--kv-cache-dtype", "fp8_e4m3",
               "--context", "200000", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["cluster_tokens"] == 4 * rep["tokens_per_rank"]
    assert rep["weights_dtype"] == "fp8_e4m3" and "MTP module not counted" in rep["weights_rule"]
    assert any("max_position_embeddings" in w for w in rep["warnings"])
    rc = main(["kv-cache", "--gpu-memory", "141GB", "--tp", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "(fp8_e4m3)" in out and "141.0 GB" in out and "TP=8, DCP=1" in out
    rc = main(["kv-cache", "--gpu-memory", "80GiB", "--tp", "8", "--weights-dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert rc == 2 and "(169.6 GB per rank, bfloat16)" in err and "85.9 GB x 0.9" in err


# ---- one prefill-workspace figure: what forward_mha allocates, in both kv-cache reports --------------------
SMALL = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                q_lora_rank=24, hidden_size=48, num_layers=2, max_position_embeddings=512)


def test_deployment_workspace_is_what_forward_mha_allocates():
    """Both reports count the workspace with the one formula forward_mha allocates with (latent R + P plus
    H (N + V) per row); the deployment report once counted 192-wide keys and 128-wide values instead."""
    import torch

    from mla_backends.layer.attention import MLAAttention
    from mla_backends.layer.workspace import PrefillWorkspace
    from mla_backends.loading.hf import random_hf_state_dict
    from mla_backends.step.metadata import BatchMetadata

    own = PrefillWorkspace(16)
    layer = MLAAttention(SMALL, backend="REF_TORCH", dtype=torch.float32, workspace=own)
    layer.load_hf_state_dict(random_hf_state_dict(SMALL, dtype=torch.float32, seed=0, std=0.1))
    cache = layer.allocate_cache(8, 8)
    bt = torch.arange(8, dtype=torch.int32).view(1, 8)
    with torch.inference_mode():
        for q, c in ((24, 0), (4, 24)):  # fill the cache, then prefill over 24 cached rows (chunks of 16)
            meta = BatchMetadata.build([q], [c], bt, 8, decode_threshold=layer.decode_threshold)
            layer(torch.randn(q, SMALL.hidden_size), None, cache, plan_step(meta, [layer]))
    assert own.kv is not None and own.kv.shape[0] == 16
    allocated = own.nbytes
    assert reports.prefill_workspace_figures(SMALL, "float32", rows=16)["prefill_workspace_bytes"] == allocated
    per_row = (32 + 8 + 4 * (16 + 16)) * 4  # latent row + every head's K-nope and V, float32
    assert allocated == 16 * per_row
    for dp, heads in ((False, 16), (True, 128)):  # DP-attention: every head on every rank
        rep = reports.deployment_report(V3, gpu_memory_bytes=141 * 10**9, tp=8, dp_attention=dp)
        figures = reports.prefill_workspace_figures(V3, "bfloat16", 1 if dp else 8,
                                                    rows=rep["workspace_rows"])
        assert rep["workspace_bytes"] == figures["prefill_workspace_bytes"]
        assert rep["workspace_bytes"] == rep["workspace_rows"] * (512 + 64 + heads * (128 + 128)) * 2


def test_v3_deployment_workspace_matches_the_kv_cache_report(capsys):
    assert main(["kv-cache", "--tp", "8", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--json"]) == 0
    sized = json.loads(capsys.readouterr().out)
    assert sized["workspace_rows"] == plain["prefill_workspace_rows"] == 65_536
    assert sized["workspace_bytes"] == plain["prefill_workspace_bytes"] == 65_536 * (576 + 16 * 256) * 2  # 584 MiB


def _worked_table() -> list[list[str]]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "cost-model.md").read_text()
    start = text.index("| layout | cache | weights GB/rank |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_cost_model_worked_table_matches_deployment_report():
    """docs/cost-model.md's V3-on-8-H200 table (the driver's 143,771 MiB, the modelled reserve) is what
    deployment_report gives for each row."""
    h200 = gpu_spec("h200")
    rows = _worked_table()
    assert len(rows) == 10
    for layout, cache, weights, workspace, held, left, per_rank, cluster, decode in rows:
        dp = layout == "DP-attention"
        dcp = 1 if dp else int(layout.split("DCP=")[1])
        rep = reports.deployment_report(V3, gpu_memory_bytes=h200.memory_bytes, tp=8, dcp=dcp, dp_attention=dp,
                                        kv_cache_dtype={"bf16": "bfloat16"}.get(cache, cache))
        comm = rep["dcp_comm_bytes_per_token_per_layer"]
        sent = comm["decode_query_all_gather"] + comm["decode_lse_all_gather"] + comm["decode_output_reduce_scatter"]
        shown = [f"{rep['weights_bytes_per_rank'] / 1e9:.2f}", f"{rep['workspace_bytes'] / 1e9:.2f}",
                 f"{rep['reserve_bytes'] / 1e9:.2f}", f"{rep['cache_bytes_per_rank'] / 1e9:.2f}",
                 f"{rep['tokens_per_rank']:,}", f"{rep['cluster_tokens']:,}", f"{sent:,}"]
        assert [weights, workspace, held, left, per_rank, cluster, decode] == shown, layout
