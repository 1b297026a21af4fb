"""``BatchMetadata``: any caller order, derived offsets and slots, the decode/prefill split, validation."""

from __future__ import annotations

import pytest
import torch

from mla_backends.step.metadata import BatchMetadata

BS = 4
# caller order: prefill, decode, prefill, decode, empty, decode (ragged)
QLENS = [3, 1, 5, 1, 0, 1]
CTXS = [2, 9, 0, 4, 6, 11]


def _block_table(qlens=QLENS, ctxs=CTXS, bs=BS, seed=0):
    """Scattered pages: a random permutation of all pages, padded with -1 past each sequence."""
    pages = [-(-(q + c) // bs) for q, c in zip(qlens, ctxs, strict=True)]
    perm = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed))
    bt = torch.full((len(qlens), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[used: used + n]
        used += n
    return bt, sum(pages) + 3


def test_decodes_first_stable_and_fields_in_processing_order():
    bt, nb = _block_table()
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    assert m.order.tolist() == [1, 3, 5, 0, 2, 4]
    assert m.query_lens.tolist() == [1, 1, 1, 3, 5, 0] and m.query_lens.dtype == torch.int32
    assert m.context_lens.tolist() == [9, 4, 11, 2, 0, 6]
    assert m.seq_lens.tolist() == [10, 5, 12, 5, 5, 6] and m.seq_lens_list == (10, 5, 12, 5, 5, 6)
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 6, 11, 11] and m.query_starts_list == (0, 1, 2, 3, 6, 11, 11)
    assert torch.equal(m.block_table, bt[[1, 3, 5, 0, 2, 4]])
    assert m.num_tokens == 11 and m.max_query_len == 5 and m.max_seq_len == 12
    assert m.token_request.tolist() == [0, 1, 2, 3, 3, 3, 4, 4, 4, 4, 4]
    assert m.token_positions.tolist() == [9, 4, 11, 2, 3, 4, 0, 1, 2, 3, 4]
    # caller token offsets: request 0 -> 0..2, 1 -> 3, 2 -> 4..8, 3 -> 9, 5 -> 10
    assert m.token_order.tolist() == [3, 9, 10, 0, 1, 2, 4, 5, 6, 7, 8]


def test_slot_mapping_matches_block_table():
    bt, nb = _block_table(seed=3)
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    expected = []
    for b in m.order.tolist():  # processing order, computed here from the caller's block table
        for j in range(QLENS[b]):
            pos = CTXS[b] + j
            expected.append(int(bt[b, pos // BS]) * BS + pos % BS)
    assert m.slot_mapping.tolist() == expected and m.slot_mapping.dtype == torch.int64
    assert len(set(expected)) == len(expected)  # no two new tokens share a slot


def test_caller_order_round_trip():
    bt, nb = _block_table()
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    x = torch.randn(m.num_tokens, 3, 2)
    p = m.to_processing_order(x)
    assert not torch.equal(p, x)
    assert torch.equal(m.to_caller_order(p), x)
    # processing token i really is the caller's token token_order[i]
    assert torch.equal(p[0], x[3])
    with pytest.raises(ValueError, match="x"):
        m.to_processing_order(torch.zeros(m.num_tokens + 1))
    with pytest.raises(ValueError, match="y"):
        m.to_caller_order(torch.zeros(2))


def test_decode_threshold_and_sub_batches():
    qlens, ctxs = [4, 1, 9, 2], [10, 10, 0, 3]
    bt, nb = _block_table(qlens, ctxs)
    m = BatchMetadata.build(qlens, ctxs, bt, BS, decode_threshold=4, num_blocks=nb)
    assert m.order.tolist() == [0, 1, 3, 2]
    dec, pre = m.select_requests(0, 3), m.select_requests(3, 4)
    assert dec.query_lens_list == (4, 1, 2) and pre.query_lens_list == (9,)
    assert dec.num_tokens + pre.num_tokens == m.num_tokens
    assert torch.equal(torch.cat([dec.slot_mapping, pre.slot_mapping]), m.slot_mapping)
    assert pre.token_request.tolist() == [0] * 9 and pre.query_start_loc.tolist() == [0, 9]
    mid = m.select_requests(1, 3)
    assert mid.query_start_loc.tolist() == [0, 1, 3] and mid.query_starts_list == (0, 1, 3)
    assert mid.token_positions.tolist() == [10, 3, 4] and mid.token_request.tolist() == [0, 1, 1]
    assert torch.equal(mid.block_table, m.block_table[1:3]) and mid.order.tolist() == [0, 1]
    with pytest.raises(ValueError, match="stop"):
        m.select_requests(2, 5)
    with pytest.raises(ValueError, match="stop"):
        m.select_requests(2, 1)


def test_sub_batches_are_built_once_per_step_by_the_plan():
    """Every layer reads the same sub-batch from the step's plan (built once there); the metadata itself keeps
    nothing: select_requests makes a new, equal sub-batch on each call."""
    from mla_backends.ref_torch import RefTorchBackend
    from mla_backends.step.plan import PlanRequest, Run, plan_step

    class Split:
        def plan_request(self, meta):
            return PlanRequest(runs_key="split", runs=(Run(True, 0, 1), Run(False, 1, 4), Run(True, 4, 6)),
                               backend=RefTorchBackend())

    bt, nb = _block_table()
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    plan = plan_step(m, [Split(), Split()])
    sub = plan.batch(1, 4)
    assert plan.batch(1, 4) is sub and set(plan.batches) == {(0, 6), (0, 1), (1, 4), (4, 6)}
    assert plan.batch(0, 6) is m
    again = m.select_requests(1, 4)
    assert again is not sub and again.query_lens_list == sub.query_lens_list
    assert torch.equal(again.block_table, sub.block_table) and not hasattr(m, "step_plan")


def test_prepare_runs_once_per_step_for_several_layers():
    """The backend hook: one call per backend class and step however many layers (instances) take part, the
    same state for every one; a new step prepares again; a plan for another step is refused."""
    from mla_backends.backends.contract import MLABackend
    from mla_backends.step.plan import StepPlanError, plan_step

    calls: list[BatchMetadata] = []

    class Counting(MLABackend):
        name = "COUNTING"

        def prepare(self, meta):
            calls.append(meta)
            return {"pages": meta.block_table.shape[1]}

    bt, nb = _block_table()
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    layers = [Counting() for _ in range(5)]
    plan = plan_step(m, layers)
    states = [plan.state(b, m) for b in layers]
    assert calls == [m] and all(s is states[0] for s in states)
    assert MLABackend().prepare(m) is None and plan_step(m, [MLABackend()]).state(MLABackend(), m) is None
    m2 = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    plan2 = plan_step(m2, layers[:1])
    assert plan2.state(layers[0], m2) is not states[0] and calls == [m, m2]
    with pytest.raises(TypeError, match="participants: got int"):
        plan_step(m, [3])
    with pytest.raises(TypeError, match="meta: got list"):
        plan_step([1], layers)
    with pytest.raises(StepPlanError, match="made for other metadata"):
        plan.state(layers[0], m2)


def test_keep_caller_order():
    bt, nb = _block_table()
    m = BatchMetadata.build(QLENS, CTXS, bt, BS, reorder=False, num_blocks=nb)
    assert m.order.tolist() == list(range(6)) and m.token_order.tolist() == list(range(11))
    assert m.query_lens_list == tuple(QLENS) and m.query_starts_list == (0, 3, 4, 9, 10, 10, 11)


def test_tensor_and_list_inputs_agree():
    bt, nb = _block_table()
    a = BatchMetadata.build(QLENS, CTXS, bt, BS, num_blocks=nb)
    b = BatchMetadata.build(torch.tensor(QLENS), torch.tensor(CTXS, dtype=torch.int32), bt.tolist(), BS)
    for f in ("order", "query_start_loc", "slot_mapping", "seq_lens", "token_positions"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_empty_batch():
    m = BatchMetadata.build([], [], torch.zeros(0, 1, dtype=torch.int32), 16)
    assert m.num_tokens == 0 and m.num_requests == 0 and m.slot_mapping.numel() == 0


# ---- validation: errors name the argument and the request -----------------------------------------------
def test_block_table_too_short_names_request():
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table") as info:
        BatchMetadata.build([1, 1], [3, 8], bt, 4)  # request 1 needs 9 tokens = 3 pages of 4
    assert "request 1" in str(info.value)


@pytest.mark.parametrize("which", ["query_lens", "context_lens"])
def test_negative_lengths_name_request(which):
    lens = {"query_lens": [1, 1, 1], "context_lens": [5, 5, 5]}
    lens[which][2] = -1
    with pytest.raises(ValueError, match=which) as info:
        BatchMetadata.build(lens["query_lens"], lens["context_lens"], torch.zeros(3, 2, dtype=torch.int32), 4)
    assert "request 2" in str(info.value)


def test_block_ids_out_of_range_name_request():
    bt = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table") as info:
        BatchMetadata.build([1, 1], [3, 6], bt, 4, num_blocks=8)
    assert "request 1" in str(info.value) and "9" in str(info.value)
    bt = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table") as info:
        BatchMetadata.build([1, 1], [4, 6], bt, 4)  # request 0's second page is -1
    assert "request 0" in str(info.value)
    # -1 past a sequence's pages is fine
    BatchMetadata.build([1, 1], [2, 6], bt, 4, num_blocks=8)


def test_shape_and_type_errors():
    bt = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens"):
        BatchMetadata.build([1, 1], [1], bt, 4)
    with pytest.raises(ValueError, match="block_table"):
        BatchMetadata.build([1, 1, 1], [1, 1, 1], bt, 4)  # one row short
    with pytest.raises(ValueError, match="block_table"):
        BatchMetadata.build([1, 1], [1, 1], bt.float(), 4)
    with pytest.raises(TypeError, match="query_lens"):
        BatchMetadata.build([1, 1.5], [1, 1], bt, 4)
    with pytest.raises(TypeError, match="block_size"):
        BatchMetadata.build([1, 1], [1, 1], bt, "4")
    with pytest.raises(ValueError, match="block_size"):
        BatchMetadata.build([1, 1], [1, 1], bt, 0)
    with pytest.raises(ValueError, match="query_lens"):
        BatchMetadata.build(torch.ones(2, 1, dtype=torch.int64), [1, 1], bt, 4)
