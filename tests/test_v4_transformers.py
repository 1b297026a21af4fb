"""DeepSeek-V4 attention on mla-backends against transformers' ``DeepseekV4Attention`` in float64, its
``generate()`` on a patched model, and V4 checkpoints read by the library's loaders (one tiny model for all).

transformers runs each request alone (prefill, then one token a step; ``v4_models.record``). The library runs the
same tokens through :class:`V4Attention` in other schedules: chunked prefill (extend), decode, and steps mixing
requests at different stages, over scattered block tables, with NaN in every slot of every store that no request
owns. Each token's layer output must agree to 1e-6 relative: transformers computes the rotary angles, RMSNorm, the
compressor's gate softmax and the indexer's scores in float32 even in a float64 model (measured ~1e-7).

Indexer ties: with few heads, ReLU zeroes many scores and the top-k can tie, and a tie may be broken either way.
The seed below was chosen so that none is close: for every CSA token that sees more than ``index_topk`` entries,
the k-th and (k+1)-th best scores (transformers' float32 scores) differ by more than 1e-3 of the largest, which
:func:`test_the_recorded_selections_have_no_near_ties` checks, so a tie fails loudly instead of flipping a pick;
the library's picks must equal transformers' for every token.
"""

from __future__ import annotations

import pytest
import torch
from v4_models import RATIOS, TOPK, record, tiny_v4, topk_gaps

from mla_backends import BatchMetadata, plan_step
from mla_backends.layer.v4 import V4Attention

pytest.importorskip("transformers")

#: (prompt, decoded) per request: up to 26 tokens, 6 CSA entries, 3 HCA entries, windows of 8
REQUESTS = [(13, 5), (22, 4), (9, 6)]
GAP = 1e-3
TOL = 1e-6


@pytest.fixture(scope="module")
def model():
    return tiny_v4(seed=1)


@pytest.fixture(scope="module")
def recorded(model):
    g = torch.Generator().manual_seed(7)
    out = []
    for prompt, new in REQUESTS:
        ids = torch.randint(1, 97, (prompt + new,), generator=g)
        out.append(record(model, ids, prompt))
    return out


def _layers(model):
    layers = []
    for i, mod in enumerate(model.model.layers):
        layer = V4Attention.from_hf_config(model.config, layer_idx=i, dtype=torch.float64, backend="REF_TORCH")
        layer.load_hf_state_dict(mod.self_attn.state_dict())
        layers.append(layer)
    return layers


def _run(layers, recorded, schedule, block_size, seed=0):
    """Run ``schedule`` (steps of ``{request: new tokens}``) through ``layers``; returns each request's outputs
    per layer ``{b: {layer: [tokens, hidden]}}`` and the CSA picks per request and token."""
    g = torch.Generator().manual_seed(seed)
    lengths = [len(r.ids) for r in recorded]
    pages = [-(-n // block_size) for n in lengths]
    nb = sum(pages) + 5
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(recorded), max(pages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[k:k + n]
        k += n
    caches = []
    for layer in layers:
        c = layer.allocate_cache(nb, block_size, indexer_storage="float64")
        for store in c.stores.values():
            store.data.fill_(float("nan"))  # no slot is owned until a step writes it
        caches.append(c)
    done = [0] * len(recorded)
    outs = {b: {i: [] for i in range(len(layers))} for b in range(len(recorded))}
    picks: dict[int, list] = {b: [] for b in range(len(recorded))}
    for step in schedule:
        reqs = sorted(step)
        q = [step[b] for b in reqs]
        ctx = [done[b] for b in reqs]
        meta = BatchMetadata.build(q, ctx, table[reqs], block_size, num_blocks=nb)
        plan = plan_step(meta, layers)
        for i, layer in enumerate(layers):
            x = torch.cat([recorded[b].x[i][done[b]:done[b] + step[b]] for b in reqs])
            y = layer(x, None, caches[i], plan)
            t = 0
            for b in reqs:
                outs[b][i].append(y[t:t + step[b]])
                if layer.kind == "compressed_sparse_attention":
                    picks[b] += [{int(v) for v in row if v >= 0} for row in layer.last_topk_indices[t:t + step[b]]]
                t += step[b]
        for b in reqs:
            done[b] += step[b]
    assert done == lengths
    return {b: {i: torch.cat(v) for i, v in d.items()} for b, d in outs.items()}, picks


def _check(model, recorded, outs, picks):
    worst = 0.0
    for b, rec in enumerate(recorded):
        for i in range(len(model.model.layers)):
            want, got = rec.y[i], outs[b][i]
            err = float((got - want).abs().max() / want.abs().max())
            worst = max(worst, err)
            assert err < TOL, (b, i, err)
        assert picks[b] == rec.picks, b  # the same entries, token by token
    return worst


def test_the_recorded_selections_have_no_near_ties(recorded):
    gaps = [g for rec in recorded for g in topk_gaps(rec, RATIOS["compressed_sparse_attention"], TOPK)]
    assert len(gaps) >= 12  # the top-k chooses (a token sees more entries than it keeps) many times
    assert min(gaps) > GAP


def test_prefill_extend_and_decode_one_request_at_a_time(model, recorded):
    layers = _layers(model)
    schedule = []
    for b, (prompt, new) in enumerate(REQUESTS):
        half = prompt // 2 + 1
        schedule += [{b: half}, {b: prompt - half}] + [{b: 1}] * new  # prefill, extend, decodes
    outs, picks = _run(layers, recorded, schedule, block_size=4)
    _check(model, recorded, outs, picks)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches_over_scattered_pages(model, recorded, block_size):
    layers = _layers(model)
    # steps mixing a prefill, an extend and decodes of other requests (requests are at different stages)
    schedule = [{0: 13}, {0: 1, 1: 10}, {0: 1, 1: 12, 2: 5}, {0: 1, 1: 1, 2: 4}, {0: 1, 1: 1, 2: 1},
                {0: 1, 1: 1, 2: 1}, {1: 1, 2: 1}, {2: 1}, {2: 1}, {2: 1}]
    outs, picks = _run(layers, recorded, schedule, block_size)
    worst = _check(model, recorded, outs, picks)
    assert worst > 0  # float32 angles and norms in transformers: not bit-equal, and the test would see a change


def test_the_oracle_sees_a_wrong_window(model, recorded):
    """The comparison means something: a layer whose window is one position short is caught."""
    import dataclasses

    layers = _layers(model)
    bad = V4Attention(dataclasses.replace(layers[0].dims, sliding_window=7), layer_idx=0, dtype=torch.float64,
                      backend="REF_TORCH")
    bad.load_hf_state_dict(model.model.layers[0].self_attn.state_dict())
    layers[0] = bad
    outs, picks = _run(layers, recorded, [{0: 18, 1: 26, 2: 15}], block_size=4)
    with pytest.raises(AssertionError):
        _check(model, recorded, outs, picks)


# ---- generate() on a patched model ---------------------------------------------------------------------------
def test_generate_is_token_identical_to_transformers_prompt_by_prompt(model):
    from mla_backends.integrations.transformers import patch_model, unpatch_model

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (11, 19)]
    new = 5
    with torch.no_grad():
        alone = [model.generate(p[None], max_new_tokens=new, do_sample=False)[0, len(p):] for p in prompts]
        L = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):], mask[b, L - len(p):] = p, 1
        hf_batched = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)[:, L:]
        patch_model(model, backend="REF_TORCH")
        try:
            ours = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)[:, L:]
            ours_alone = [model.generate(p[None], max_new_tokens=new, do_sample=False)[0, len(p):] for p in prompts]
        finally:
            unpatch_model(model)
    for b in range(len(prompts)):
        assert torch.equal(ours[b], alone[b]) and torch.equal(ours_alone[b], alone[b]), b
    # transformers' own left-padded batch counts the padding in its compressor windows, so some row differs
    # from that prompt alone; the library must not (rows above equal the prompts run alone)
    assert any(not torch.equal(hf_batched[b], alone[b]) for b in range(len(prompts)))


# ---- checkpoints -----------------------------------------------------------------------------------------------
def test_checkpoints_load_with_exact_weights_sharded_and_tensor_parallel(model, tmp_path):
    from mla_backends.layer.pretrained import load_attention_layers
    from mla_backends.loading.checkpoint import Checkpoint

    model.save_pretrained(tmp_path, max_shard_size="40KB")  # many shards; DeepSeek's own names under model.
    assert len(list(tmp_path.glob("*.safetensors"))) > 10
    layers = load_attention_layers(tmp_path, dtype=torch.float64, progress=False, backend="REF_TORCH")
    for i, layer in layers.items():
        want = model.model.layers[i].self_attn.state_dict()
        got = dict(layer.named_parameters())
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value.to(torch.float64)), (i, name)
    # two tensor-parallel ranks read their slices; their outputs add up to the whole layer's
    ckpt = Checkpoint(tmp_path)
    x = torch.randn(7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    meta = BatchMetadata.build([7], [0], [[0, 1]], 4)
    whole = layers[1]
    want = whole(x, None, whole.allocate_cache(2, 4), plan_step(meta, [whole]))
    total = torch.zeros_like(want)
    for rank in range(2):
        part = V4Attention.from_hf_config(ckpt.config, layer_idx=1, tp_rank=rank, tp_size=2, dtype=torch.float64,
                                          backend="REF_TORCH")
        part.load_hf_state_dict(ckpt.read_attention_layer(1, tp_rank=rank, tp_size=2, dtype=torch.float64),
                                sharded=True)
        assert part.sinks.shape == (2,) and part.o_b_proj.weight.shape == (64, 16)
        total += part(x, None, part.allocate_cache(2, 4), plan_step(meta, [part]))
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)


def test_deepseek_named_checkpoints_load_and_missing_keys_are_named(model, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from mla_backends.loading.checkpoint import Checkpoint, CheckpointError

    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    raw = tmp_path / "raw"
    raw.mkdir()
    tensors = {k.removeprefix("model."): v for k, v in load_file(saved / "model.safetensors").items()}
    assert "layers.1.attn.indexer.compressor.ape" in tensors  # DeepSeek's names, no model. prefix
    save_file(tensors, raw / "model.safetensors")
    (raw / "config.json").write_text((saved / "config.json").read_text())
    got = Checkpoint(raw).read_attention_layer(1, dtype=torch.float64)
    want = model.model.layers[1].self_attn.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].double()) for k in want)
    del tensors["layers.2.attn.compressor.wgate.weight"]
    save_file(tensors, raw / "model.safetensors")
    with pytest.raises(CheckpointError, match="compressor.gate_proj.weight"):
        Checkpoint(raw).layer_files(2)
    assert json.loads((raw / "config.json").read_text())["model_type"] == "deepseek_v4"
