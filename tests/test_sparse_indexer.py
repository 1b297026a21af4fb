"""The V3.2 indexer: published formula (float64, written out here), transformers' ``deepseek_v32`` indexer,
causal top-k with -1 padding, batching independent of the work split, fp8 keys."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_backends import BatchMetadata, IndexerDims, MLADims
from mla_backends.layer.sparse import Indexer, IndexerKeyCache, hadamard_matrix, index_scores
from mla_backends.layer.sparse import indexer as indexer_mod

pytestmark = pytest.mark.usefixtures("one_thread")


HIDDEN, Q_LORA, N_HEADS, HEAD_DIM, ROPE = 48, 24, 16, 128, 16


def tiny_dims(topk: int = 5, rope_scaling: dict | None = None) -> MLADims:
    cfg = {
        "num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": ROPE,
        "v_head_dim": 16, "hidden_size": HIDDEN, "q_lora_rank": Q_LORA, "num_hidden_layers": 2,
        "index_n_heads": N_HEADS, "index_head_dim": HEAD_DIM, "index_topk": topk, "rope_theta": 10000.0,
        "model_type": "deepseek_v32",
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    return MLADims.from_hf_config(cfg)


def random_indexer(dims: MLADims, seed: int = 0, **kw) -> Indexer:
    torch.manual_seed(seed)
    ix = Indexer.from_dims(dims, dtype=torch.float64, **kw).double()
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0, 0.3)
    return ix


# ---- a plain float64 reimplementation of the published formula -------------------------------------------
def reference_scores(sd: dict, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, *, n_heads: int,
                     head_dim: int, rope: int, theta: float = 10000.0) -> torch.Tensor:
    """``I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) / sqrt(D)``, ``w = x Wp^T / sqrt(H)`` (no causal mask).

    q = rope(c_q Wq^T), k = rope(LayerNorm(x Wk^T)), rope = rotate-half on the first ``rope`` channels.
    """
    T = x.shape[0]
    q = (qr @ sd["wq_b.weight"].double().T).view(T, n_heads, head_dim)
    k = x @ sd["wk.weight"].double().T
    mu, var = k.mean(-1, keepdim=True), k.var(-1, unbiased=False, keepdim=True)
    k = (k - mu) / torch.sqrt(var + 1e-6) * sd["k_norm.weight"].double() + sd["k_norm.bias"].double()
    inv = 1.0 / theta ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()

    def rot(v: torch.Tensor) -> torch.Tensor:
        half = rope // 2
        a, b = v[..., :half], v[..., half:rope]
        c = cos.view(T, *([1] * (v.dim() - 2)), half)
        s = sin.view(T, *([1] * (v.dim() - 2)), half)
        return torch.cat([a * c - b * s, b * c + a * s, v[..., rope:]], dim=-1)

    q, k = rot(q), rot(k)
    w = x @ sd["weights_proj.weight"].double().T / math.sqrt(n_heads)
    out = torch.zeros(T, T, dtype=torch.float64)
    for h in range(n_heads):
        out += w[:, h:h + 1] * torch.relu(q[:, h] @ k.T) / math.sqrt(head_dim)
    return out


def assert_topk_is_best(sel: torch.Tensor, scores: torch.Tensor, positions: list[int], k: int) -> None:
    """Each row: the ``min(k, p+1)`` visible positions of highest score (ties allowed), then -1 padding."""
    for t, p in enumerate(positions):
        n = min(k, p + 1)
        row = sel[t].tolist()
        assert all(v == -1 for v in row[n:]), f"token {t}: padding {row}"
        got = row[:n]
        assert all(0 <= v <= p for v in got) and len(set(got)) == n, f"token {t} at {p}: {row}"
        best = torch.sort(scores[t, : p + 1], descending=True).values[:n]
        mine = torch.sort(scores[t, got], descending=True).values
        torch.testing.assert_close(mine, best, rtol=1e-5, atol=1e-6)  # float32 scores may swap near-ties


def run_steps(ix: Indexer, cache: IndexerKeyCache, steps, seqs_x, seqs_qr, block_table, bs):
    """Feed sequences through several steps; return ``{(request, position): selected row}``."""
    picks = {}
    for qlens, ctxs in steps:
        meta = BatchMetadata.build(qlens, ctxs, block_table, bs)
        xs, qrs = [], []
        for r in meta.order.tolist():  # processing order
            c, n = ctxs[r], qlens[r]
            xs.append(seqs_x[r][c:c + n])
            qrs.append(seqs_qr[r][c:c + n])
        sel = ix(torch.cat(xs), torch.cat(qrs), cache, meta)
        reqs = meta.order[meta.token_request].tolist()
        for t, (r, p) in enumerate(zip(reqs, meta.token_positions.tolist(), strict=True)):
            picks[(r, p)] = sel[t]
    return picks


LENS = [11, 7, 9]
STEPS = [([6, 7, 0], [0, 0, 0]), ([1, 0, 9], [6, 7, 0]), ([4, 0, 0], [7, 7, 9])]  # prefill, mixed, chunk
BLOCK_TABLE = [[5, 0, 2], [1, 7, -1], [3, 4, 6]]


def make_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) for n in LENS]
    qrs = [torch.randn(n, Q_LORA, generator=g, dtype=torch.float64) for n in LENS]
    return xs, qrs


@pytest.mark.parametrize("rotate", [True, False])
def test_matches_published_formula_in_float64_across_steps(rotate):
    dims = tiny_dims(topk=5)
    ix = random_indexer(dims, rotate=rotate)
    sd = ix.state_dict()
    xs, qrs = make_inputs()
    cache = IndexerKeyCache(8, 4, HEAD_DIM, storage="float64")
    picks = run_steps(ix, cache, STEPS, xs, qrs, BLOCK_TABLE, 4)
    for r, n in enumerate(LENS):
        pos = torch.arange(n)
        ref = reference_scores(sd, xs[r], qrs[r], pos, n_heads=N_HEADS, head_dim=HEAD_DIM, rope=ROPE)
        # the module's own scores agree with the formula
        q, w = ix.queries(qrs[r], xs[r], pos)
        mine = index_scores(q[None], w[None], ix.keys(xs[r], pos)[None])[0]
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-7)
        sel = torch.stack([picks[(r, p)] for p in range(n)])
        assert_topk_is_best(sel, ref, list(range(n)), 5)


def test_matches_transformers_deepseek_v32_indexer():
    tmod = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32",
                               reason="this transformers has no deepseek_v32 model")
    from transformers import DeepseekV32Config

    for rope_parameters in ({"rope_type": "default", "rope_theta": 10000.0},
                            {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0}):
        cfg = DeepseekV32Config(hidden_size=HIDDEN, q_lora_rank=Q_LORA, num_attention_heads=4,
                                num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=ROPE,
                                qk_nope_head_dim=16, v_head_dim=16, index_n_heads=N_HEADS,
                                index_head_dim=HEAD_DIM, index_topk=5, num_hidden_layers=1, vocab_size=8,
                                rope_parameters=rope_parameters)
        torch.manual_seed(3)
        ref_ix = tmod.DeepseekV32Indexer(cfg, 0).double()
        with torch.no_grad():
            for p in ref_ix.parameters():
                p.normal_(0, 0.3)
        dims = MLADims.from_hf_config(cfg)
        assert dims.indexer == IndexerDims(n_heads=N_HEADS, head_dim=HEAD_DIM, topk=5)
        ix = Indexer.from_dims(dims, dtype=torch.float64).double()
        ix.load_state_dict(ref_ix.state_dict())
        rotary = tmod.DeepseekV32RotaryEmbedding(cfg)
        xs, qrs = make_inputs(seed=7)
        cache = IndexerKeyCache(8, 4, HEAD_DIM, storage="float64")
        picks = run_steps(ix, cache, STEPS, xs, qrs, BLOCK_TABLE, 4)
        for r, n in enumerate(LENS):
            pos = torch.arange(n)[None]
            mask = torch.tril(torch.ones(1, n, n, dtype=torch.bool))
            with torch.no_grad():
                ref = ref_ix(xs[r][None], qrs[r][None], rotary(xs[r][None], pos), mask, pos)[0]
            for p in range(n):
                k = min(5, p + 1)
                mine = picks[(r, p)]
                kind = rope_parameters["rope_type"]
                assert set(mine[:k].tolist()) == set(ref[p, :k].tolist()), (kind, r, p)
                assert bool((mine[k:] == -1).all())


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard_matrix(128, torch.float64)
    torch.testing.assert_close(h @ h, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, h.T)
    with pytest.raises(ValueError, match="n: got 96"):
        hadamard_matrix(96)


def _random_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    qlens, ctxs = [1, 1, 5, 12, 0, 3], [9, 0, 20, 0, 4, 30]
    bs = 4
    pages = [-(-(q + c) // bs) for q, c in zip(qlens, ctxs, strict=True)]
    perm = torch.randperm(sum(pages), generator=g).tolist()
    table, i = [], 0
    for n in pages:
        table.append(perm[i:i + n] + [-1] * (max(pages) - n))
        i += n
    meta = BatchMetadata.build(qlens, ctxs, table, bs)
    return meta, sum(pages), g


def _fill(cache: IndexerKeyCache, meta: BatchMetadata, g: torch.Generator) -> None:
    """Write random keys at every cached position 0 .. seq_len - 1 of every request."""
    for b, s in enumerate(meta.seq_lens_list):
        pos = torch.arange(s)
        bs = cache.block_size
        slots = meta.block_table[b].long()[pos // bs] * bs + pos % bs
        cache.write(torch.randn(s, cache.head_dim, generator=g), slots)


@pytest.mark.parametrize("topk", [1, 4, 64])
def test_causal_topk_never_selects_the_future_and_pads_with_minus_one(topk):
    meta, n_pages, g = _random_batch(11)
    cache = IndexerKeyCache(n_pages, 4)
    _fill(cache, meta, g)
    T, H = meta.num_tokens, 3
    q, w = torch.randn(T, H, 128, generator=g), torch.randn(T, H, generator=g)
    sel = indexer_mod.causal_topk(q, w, cache, meta, topk)
    assert sel.dtype == torch.int32 and tuple(sel.shape) == (T, topk)
    for t, p in enumerate(meta.token_positions.tolist()):
        row = sel[t].tolist()
        n = min(topk, p + 1)
        assert all(0 <= v <= p for v in row[:n]) and len(set(row[:n])) == n
        assert row[n:] == [-1] * (topk - n)
        if topk >= p + 1:  # top-k covering the whole context selects every visible position
            assert set(row[:n]) == set(range(p + 1))
    # the same scores, computed plainly per token, pick the same best positions
    for t, (b, p) in enumerate(zip(meta.token_request.tolist(), meta.token_positions.tolist(), strict=True)):
        keys = cache.gather(meta.block_table[b], p + 1, torch.float64)
        s = (w[t].double()[:, None] * torch.relu(q[t].double() @ keys.T)).sum(0)
        assert_topk_is_best(sel[t:t + 1], s[None], [p], topk)


def test_result_does_not_depend_on_the_work_split(monkeypatch):
    meta, n_pages, g = _random_batch(12)
    cache = IndexerKeyCache(n_pages, 4)
    _fill(cache, meta, g)
    # 16 heads: a score is exactly 0 (a tie) only if all 16 ReLUs are 0
    q, w = torch.randn(meta.num_tokens, 16, 128, generator=g), torch.randn(meta.num_tokens, 16, generator=g)
    whole = indexer_mod.causal_topk(q, w, cache, meta, 8)
    monkeypatch.setattr(indexer_mod, "GROUP_ELEMENT_BUDGET", 3000)  # forces groups and token-split prefills
    items = indexer_mod._work_items(meta, per_row=4, per_pos=128 + 132)
    assert len(items) > 3 and any(j0 > 0 for _, _, j0, _ in items)
    split = indexer_mod.causal_topk(q, w, cache, meta, 8)
    # the groups have other shapes, so BLAS may round the float32 scores differently: the picks agree, except
    # that positions whose scores tie within that rounding may swap (checked against a plain float64 score)
    for t, (b, p) in enumerate(zip(meta.token_request.tolist(), meta.token_positions.tolist(), strict=True)):
        if torch.equal(split[t], whole[t]):
            continue
        keys = cache.gather(meta.block_table[b], p + 1, torch.float64)
        s = (w[t].double()[:, None] * torch.relu(q[t].double() @ keys.T)).sum(0)
        n = min(8, p + 1)
        assert split[t, n:].eq(-1).all() and whole[t, n:].eq(-1).all(), t
        torch.testing.assert_close(s[split[t, :n].long()], s[whole[t, :n].long()], rtol=1e-5, atol=1e-6)


def test_fp8_keys_select_nearly_the_same_positions():
    dims = tiny_dims(topk=4)
    ix = random_indexer(dims, seed=4)
    xs, qrs = make_inputs(seed=5)
    exact = run_steps(ix, IndexerKeyCache(8, 4, storage="float64"), STEPS, xs, qrs, BLOCK_TABLE, 4)
    fp8 = run_steps(ix, IndexerKeyCache(8, 4), STEPS, xs, qrs, BLOCK_TABLE, 4)
    same = sum(len(set(exact[k].tolist()) & set(fp8[k].tolist()) - {-1}) for k in exact)
    total = sum(len(set(exact[k].tolist()) - {-1}) for k in exact)
    assert same >= 0.9 * total


def test_inputs_are_validated():
    dims = tiny_dims()
    ix = Indexer.from_dims(dims, dtype=torch.float32)
    meta = BatchMetadata.build([2], [0], [[0]], 4)
    cache = IndexerKeyCache(1, 4)
    with pytest.raises(ValueError, match=r"hidden_states: got shape \[3, 48\]"):
        ix(torch.zeros(3, HIDDEN), torch.zeros(2, Q_LORA), cache, meta)
    with pytest.raises(TypeError, match="cache: got str"):
        ix(torch.zeros(2, HIDDEN), torch.zeros(2, Q_LORA), "cache", meta)
    with pytest.raises(ValueError, match="topk: got 0"):
        indexer_mod.causal_topk(torch.zeros(2, 1, 128), torch.zeros(2, 1), cache, meta, 0)
    with pytest.raises(ValueError, match="without an indexer"):
        Indexer.from_dims(MLADims.deepseek_v3())
    with pytest.raises(ValueError, match="rotate: got True"):
        odd = IndexerDims(n_heads=2, head_dim=96, topk=4)
        Indexer.from_dims(dataclasses.replace(tiny_dims(), indexer=odd))
