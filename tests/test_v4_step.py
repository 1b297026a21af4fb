"""The DeepSeek-V4 step plan: compressed entries, their slots, the tokens they pool and what each token sees,
made once per step for every V4 layer (``plan_step`` through ``PlanRequest.preparers``), frozen."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from mla_backends import BatchMetadata, plan_step
from mla_backends.core.v4dims import CSA, HCA, SLIDING, V4Dims
from mla_backends.layer.v4 import V4Attention
from mla_backends.step.plan import StepPlanError
from mla_backends.step.v4 import V4Planner, check_page_ratio, compressed_table, entries_per_page

QUERY, CONTEXT = [1, 7, 4, 0], [10, 0, 13, 5]  # a decode, a prefill, an extend, an idle request


def _meta(block_size=4):
    seq = [q + c for q, c in zip(QUERY, CONTEXT, strict=True)]
    pages = [-(-s // block_size) for s in seq]
    table = [[100 + 10 * b + j for j in range(n)] for b, n in enumerate(pages)]
    return BatchMetadata.build(QUERY, CONTEXT, table, block_size)


@pytest.mark.parametrize(("kind", "ratio", "block_size"), [(CSA, 4, 4), (CSA, 4, 8), (HCA, 8, 4), (HCA, 2, 8)])
def test_entry_plan_matches_a_plain_count(kind, ratio, block_size):
    meta = _meta(block_size)
    st = V4Planner(8, {kind: ratio}).prepare(meta).for_kind(kind)
    span = 2 * ratio if kind == CSA else ratio
    epp = entries_per_page(block_size, ratio)
    table = meta.block_table.long()
    want_slots, want_pos, want_src = [], [], []
    for b in range(meta.num_requests):
        c, s = meta.context_lens_list[b], meta.seq_lens_list[b]
        for w in range(c // ratio, s // ratio):  # completed by this step
            page = table[b, (w * ratio) // block_size]  # the token page holding the entry's first position
            want_slots.append(int(page) * epp + w % epp)
            want_pos.append(w * ratio)
            src = []
            for p in range((w + 1) * ratio - span, (w + 1) * ratio):
                src.append(-1 if p < 0 else int(table[b, p // block_size]) * block_size + p % block_size)
            want_src.append(src)
    assert st.new_slots.tolist() == want_slots and st.new_positions.tolist() == want_pos
    assert st.source_slots.tolist() == want_src and st.num_new == len(want_slots) and st.span == span
    for t, p in enumerate(meta.token_positions.tolist()):
        vis = (p + 1) // ratio  # an entry is seen once its last token is there
        assert int(st.visible[t]) == vis
        assert st.seen[t].tolist() == list(range(vis)) + [-1] * (st.seen.shape[1] - vis)
    assert st.max_visible == max(s // ratio for s in meta.seq_lens_list)


def test_compressed_tables_share_the_token_pages():
    table = torch.arange(12).view(2, 6)
    assert torch.equal(compressed_table(table, 8, 4), table)  # 2 entries a page, page j of both
    assert torch.equal(compressed_table(table, 4, 8), table[:, ::2])  # one entry every second token page
    check_page_ratio(4, 8)
    check_page_ratio(16, 4)
    with pytest.raises(ValueError, match="block_size: got 6"):
        check_page_ratio(6, 4)
    with pytest.raises(ValueError, match="block_size: got 6"):
        V4Planner(8, {CSA: 4}).prepare(_meta(6))


def _layers(block_size=4):
    dims = V4Dims(num_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16, hidden_size=32, num_layers=4,
                  layer_types=(SLIDING, CSA, HCA, CSA), csa_ratio=4, hca_ratio=8, sliding_window=4, index_n_heads=2,
                  index_head_dim=16, index_topk=2, o_groups=2, o_lora_rank=8)
    layers = [V4Attention(dims, layer_idx=i, dtype=torch.float64, backend="REF_TORCH") for i in range(4)]
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        layer.load_hf_state_dict({k: 0.2 * torch.randn(v.shape, generator=g, dtype=torch.float64) + (
            1.0 if "norm" in k else 0.0) for k, v in layer.state_dict().items()})
    return layers


def test_one_v4_state_per_step_for_every_layer_frozen():
    layers = _layers()
    meta = _meta()
    plan = plan_step(meta, layers)
    states = {k: v for k, v in plan.states.items() if k[0] == layers[0].planner.prepare_key()}
    assert len(states) == 1  # four layers, one planned V4 state
    st = plan.state(layers[2].planner, meta)
    assert isinstance(st.entries, MappingProxyType) and set(st.entries) == {CSA, HCA}
    with pytest.raises(TypeError):
        st.entries[CSA] = None  # frozen
    with pytest.raises(AttributeError):
        st.window = 3


def test_a_plan_made_without_the_v4_layers_is_refused_before_anything_is_written():
    layers = _layers()
    meta = _meta()
    cache = layers[1].allocate_cache(140, 4)
    for store in cache.stores.values():
        store.data.fill_(7.0)
    x = torch.zeros(meta.num_tokens, 32, dtype=torch.float64)
    with pytest.raises(StepPlanError, match="without"):
        layers[1](x, None, cache, plan_step(meta, []))
    with pytest.raises(TypeError, match="plan: got BatchMetadata"):
        layers[1](x, None, cache, meta)
    assert all(bool((s.data == 7.0).all()) for s in cache.stores.values())  # untouched


def test_the_layer_step_reads_nothing_back_from_the_device():
    from mla_backends.testing import no_host_sync

    layers = _layers()
    meta = _meta()
    caches = [layer.allocate_cache(140, 4) for layer in layers]
    x = torch.randn(meta.num_tokens, 32, dtype=torch.float64)
    plan = plan_step(meta, layers)
    with no_host_sync():  # after planning, a V4 step of every kind never waits for the device
        for layer, cache in zip(layers, caches, strict=True):
            x = x + layer(x, None, cache, plan)
    assert torch.isfinite(x).all()


def test_cache_and_block_size_checks():
    layers = _layers()
    with pytest.raises(ValueError, match="block_size: got 6"):
        layers[1].allocate_cache(8, 6)
    meta = _meta()
    csa, small = layers[1].allocate_cache(140, 4), layers[1].allocate_cache(8, 4)  # configured before planning
    plan = plan_step(meta, layers)
    x = torch.zeros(meta.num_tokens, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache: got a compressed_sparse_attention cache"):
        layers[2](x, None, csa, plan)
    with pytest.raises(ValueError, match="block id 131"):
        layers[1](x, None, small, plan)  # the table names pages up to 131
