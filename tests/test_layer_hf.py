"""MLAAttention against transformers' DeepseekV3Attention in float64 (tiny configs, no downloads).

Every schedule (several prefills in one batch, decode steps, a mixed decode/extend step) must reproduce what
transformers computes for the whole sequence at once. transformers runs its softmax and RMSNorm in float32, so
agreement is about 1e-7 relative; we allow 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from layer_cases import (
    SCHEDULE,
    hf_attention,
    hf_full_sequence,
    run_schedule,
    scattered_block_tables,
    tiny_config,
)

from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dispatch import PerBatchPolicy, PerRequestPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-6


def _check_against_hf(cfg, *, dispatch=None, block_size=4, steps=SCHEDULE, decode_threshold=1, seed=0,
                      workspace_rows=None):
    attn = hf_attention(cfg, seed)
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64, dispatch=dispatch,
                                        workspace_rows=workspace_rows)
    layer.load_hf_state_dict(attn.state_dict())
    lengths = [sum(s[b] for s in steps) for b in range(len(steps[0]))]
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64) for n in lengths]
    bt, nb = scattered_block_tables(len(xs), max(lengths), block_size, seed)
    cache = layer.allocate_cache(nb, block_size)
    outs = run_schedule(layer, cache, bt, xs, steps, decode_threshold=decode_threshold)
    for b, x in enumerate(xs):
        ref = hf_full_sequence(attn, cfg, x)
        got = torch.cat(outs[b])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < RTOL, f"request {b}: relative error {err:.2e} against transformers"
    return layer


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("yarn", [False, True], ids=["default_rope", "yarn"])
def test_schedule_matches_transformers(q_lora_rank, interleave, yarn):
    cfg = tiny_config(q_lora_rank=q_lora_rank, interleave=interleave, yarn=yarn)
    _check_against_hf(cfg)


def test_yarn_changes_the_softmax_scale():
    # guards the YaRN cases above from passing vacuously: the mscale^2 factor must be in effect
    plain = MLAAttention.from_hf_config(tiny_config(yarn=False), dtype=torch.float64)
    yarn = MLAAttention.from_hf_config(tiny_config(yarn=True), dtype=torch.float64)
    assert yarn.scale == pytest.approx(plain.scale * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


@pytest.mark.parametrize("dispatch", [
    PerRequestPolicy(threshold=16),  # the extends of the mixed step run absorbed
    PerBatchPolicy(),  # cold prefill expanded, short-prefix extend batch absorbed
    PerBatchPolicy(prefix_threshold=0),  # every extend batch expanded, decode rows included
], ids=["per_request_16", "per_batch_8192", "per_batch_0"])
def test_dispatch_policies_match_transformers(dispatch):
    _check_against_hf(tiny_config(), dispatch=dispatch)


def test_metadata_built_with_the_layer_threshold():
    # metadata ordered by the same threshold as the layer: one cut between the absorbed and expanded parts
    _check_against_hf(tiny_config(interleave=False), dispatch=PerRequestPolicy(threshold=4),
                      decode_threshold=4)


def test_attention_bias_and_page_size_one():
    _check_against_hf(tiny_config(attention_bias=True), block_size=1)


def test_chunked_context_matches_transformers():
    # long prefixes, a workspace of 7 rows: every request's context spans several chunks
    steps = [[20, 17], [1, 6], [8, 1]]
    _check_against_hf(tiny_config(), steps=steps, workspace_rows=7)
