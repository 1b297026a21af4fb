"""A DeepSeek-V3.2 ``MLAAttention``: indexer built from the config, sparse attention in prefill and decode,
transformers' ``DeepseekV32Attention`` as the float64 oracle, dense equality when top-k covers the context,
and the skip pattern (a layer reusing the previous layer's top-k)."""

from __future__ import annotations

import pytest
import torch
from layer_cases import SCHEDULE, run_schedule, scattered_block_tables

from mla_backends import BatchMetadata, MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.sparse import Indexer, SparseKVCache
from mla_backends.loading.hf import StateDictError
from mla_backends.step.plan import plan_step

tmod = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32",
                           reason="this transformers has no deepseek_v32 model")
from transformers import DeepseekV32Config  # noqa: E402

RTOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")


def v32_config(topk: int = 4, layers: int = 1) -> DeepseekV32Config:
    cfg = DeepseekV32Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=16, index_head_dim=128,
        index_topk=topk, num_hidden_layers=layers, max_position_embeddings=256, vocab_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_v32_attention(cfg: DeepseekV32Config, seed: int = 0):
    torch.manual_seed(seed)
    attn = tmod.DeepseekV32Attention(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.normal_(0.0, 0.2)
            if "layernorm" in name or "k_norm.weight" in name:
                p.add_(1.0)
    return attn


@torch.no_grad()
def hf_full_sequence(attn, cfg, x: torch.Tensor) -> torch.Tensor:
    L = x.shape[0]
    cos, sin = tmod.DeepseekV32RotaryEmbedding(cfg)(x[None], torch.arange(L)[None])
    mask = torch.full((L, L), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    y, _ = attn(x[None], (cos, sin), mask)
    return y[0]


def inputs(cfg, steps, seed: int = 1):
    lengths = [sum(s[b] for s in steps) for b in range(len(steps[0]))]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64) for n in lengths], lengths


def float_cache(layer: MLAAttention, nb: int, bs: int) -> SparseKVCache:
    """Both caches in float64 (fp8 indexer keys would make a float64 comparison inexact)."""
    return SparseKVCache.allocate(layer.dims, nb, bs, model_dtype=torch.float64, layer_idx=layer.layer_idx,
                                  indexer_storage="float64")


def test_from_hf_config_builds_the_indexer_and_a_132_byte_indexer_cache():
    layer = MLAAttention.from_hf_config(v32_config(), dtype=torch.float32)
    assert isinstance(layer.indexer, Indexer) and layer.indexer.topk == 4
    cache = layer.allocate_cache(4, 16)
    assert isinstance(cache, SparseKVCache) and cache.indexer_bytes_per_token == 132
    assert tuple(cache.indexer_cache.data.shape) == (4, 16, 132)
    dense = MLAAttention.from_hf_config(MLADims.deepseek_v3().tensor_parallel(32), dtype=torch.float32)
    assert dense.indexer is None and not isinstance(dense.allocate_cache(2, 16), SparseKVCache)


def test_sparse_schedule_matches_transformers_v32_attention():
    cfg = v32_config(topk=4)
    attn = hf_v32_attention(cfg)
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    layer.load_hf_state_dict(attn.state_dict())  # attention + indexer.* weights
    calls = []
    inner = layer.backend.forward_mqa

    def spy(q_latent, q_rope, cache, meta, **kw):
        calls.append((meta.max_query_len, kw.get("topk_indices") is not None))
        return inner(q_latent, q_rope, cache, meta, **kw)

    layer.backend.forward_mqa = spy
    xs, lengths = inputs(cfg, SCHEDULE)
    bt, nb = scattered_block_tables(len(xs), max(lengths), 4)
    outs = run_schedule(layer, float_cache(layer, nb, 4), bt, xs, SCHEDULE)
    for b, x in enumerate(xs):
        ref = hf_full_sequence(attn, cfg, x)
        got = torch.cat(outs[b])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < RTOL, f"request {b}: relative error {err:.2e} against transformers"
    # prefill steps (query length > 1) go through forward_mqa with top-k as well: no dense fallback
    assert calls and all(sparse for _, sparse in calls) and any(q > 1 for q, _ in calls)
    assert layer.last_topk_indices is not None and layer.last_topk_indices.shape[1] == 4


def test_topk_covering_the_context_equals_the_dense_layer():
    cfg = v32_config(topk=64)  # >= every sequence length below
    attn = hf_v32_attention(cfg, seed=2)
    sparse = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    sparse.load_hf_state_dict(attn.state_dict())
    dense_cfg = {k: v for k, v in cfg.to_dict().items() if not k.startswith("index_")}
    dense = MLAAttention.from_hf_config(dense_cfg, dtype=torch.float64)
    assert dense.indexer is None
    dense.load_hf_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("indexer.")})
    xs, lengths = inputs(cfg, SCHEDULE, seed=3)
    bt, nb = scattered_block_tables(len(xs), max(lengths), 4)
    got = run_schedule(sparse, sparse.allocate_cache(nb, 4), bt, xs, SCHEDULE)  # fp8 indexer keys: any order
    ref = run_schedule(dense, dense.allocate_cache(nb, 4), bt, xs, SCHEDULE)
    for b in range(len(xs)):
        torch.testing.assert_close(torch.cat(got[b]), torch.cat(ref[b]), rtol=1e-9, atol=1e-12)


def test_skip_layer_reuses_the_previous_top_k_and_keeps_no_indexer_cache():
    cfg = v32_config(topk=3, layers=2)
    d = {**cfg.to_dict(), "index_topk_pattern": "FS"}
    attn = hf_v32_attention(cfg, seed=4)
    sd = attn.state_dict()
    first = MLAAttention.from_hf_config(d, dtype=torch.float64, layer_idx=0)
    second = MLAAttention.from_hf_config(d, dtype=torch.float64, layer_idx=1)
    assert first.dims.indexer.skip_layers == frozenset({1})
    assert isinstance(first.indexer, Indexer) and second.indexer is None
    with pytest.raises(StateDictError, match="unexpected keys"):
        second.load_hf_state_dict(sd)  # a reusing layer has no indexer weights
    with pytest.raises(StateDictError, match="missing keys"):
        first.load_hf_state_dict({k: v for k, v in sd.items() if not k.startswith("indexer.")})
    first.load_hf_state_dict(sd)
    second.load_hf_state_dict({k: v for k, v in sd.items() if not k.startswith("indexer.")})
    c1, c2 = first.allocate_cache(8, 4), second.allocate_cache(8, 4)
    assert c1.indexer_bytes_per_token == 132 and c2.indexer_cache is None and c2.indexer_bytes_per_token == 0

    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    meta = BatchMetadata.build([6, 3], [0, 0], [[0, 1], [2]], 4)
    with pytest.raises(ValueError, match="reuses the previous layer's top-k"):
        second(x, None, c2, plan_step(meta, [second]))
    y1 = first(x, None, c1, plan_step(meta, [first]))
    topk = first.last_topk_indices
    assert tuple(topk.shape) == (9, 3)
    # same attention weights + the same top-k: the reusing layer computes what the indexing layer did
    torch.testing.assert_close(second(x, None, c2, plan_step(meta, [second]), topk_indices=topk), y1, rtol=1e-12,
                               atol=1e-12)


def test_sparse_layer_on_triton_matches_transformers():
    """The same V3.2 layer with TRITON_MLA's sparse kernel (the interpreter on CPU, the GPU where present)."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = v32_config(topk=4)
    attn = hf_v32_attention(cfg, seed=6)
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float32, backend="TRITON_MLA", device=device)
    assert layer.backend_cls.capabilities.sparse
    layer.load_hf_state_dict(attn.state_dict())
    xs, lengths = inputs(cfg, SCHEDULE, seed=7)
    bt, nb = scattered_block_tables(len(xs), max(lengths), 4)
    cache = SparseKVCache.allocate(layer.dims, nb, 4, model_dtype=torch.float32, device=device,
                                   indexer_storage="float32")
    done, outs = [0] * len(xs), [[] for _ in xs]
    for qlens in SCHEDULE:  # as run_schedule, with positions left to the metadata (on the layer's device)
        meta = BatchMetadata.build(qlens, list(done), bt.to(device), 4, num_blocks=nb)
        hidden = torch.cat([xs[b][done[b]: done[b] + q] for b, q in enumerate(qlens)]).float().to(device)
        y, off = layer(hidden, None, cache, plan_step(meta, [layer])).cpu(), 0
        for b, q in enumerate(qlens):
            outs[b].append(y[off: off + q])
            off, done[b] = off + q, done[b] + q
    for b, x in enumerate(xs):
        ref = hf_full_sequence(attn, cfg, x)
        got = torch.cat(outs[b]).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"request {b}: relative error {err:.2e} against transformers"


def test_caller_top_k_on_an_indexing_layer_still_caches_the_indexer_keys():
    cfg = v32_config(topk=3)
    attn = hf_v32_attention(cfg, seed=8)
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    layer.load_hf_state_dict(attn.state_dict())
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, 32, generator=g, dtype=torch.float64)
    given, own = layer.allocate_cache(4, 4), layer.allocate_cache(4, 4)
    meta = BatchMetadata.build([7], [0], [[2, 0]], 4)
    layer(x, None, own, plan_step(meta, [layer]))
    topk = layer.last_topk_indices
    layer(x, None, given, plan_step(meta, [layer]), topk_indices=topk)  # the caller's top-k: keys still written
    assert torch.equal(given.indexer_cache.data, own.indexer_cache.data)
    assert bool(given.indexer_cache.data.any())


def test_top_k_mismatches_raise_before_the_cache_changes():
    cfg = v32_config(topk=3, layers=2)
    d = {**cfg.to_dict(), "index_topk_pattern": "FS"}
    sd = {k: v for k, v in hf_v32_attention(cfg, seed=10).state_dict().items() if not k.startswith("indexer.")}
    second = MLAAttention.from_hf_config(d, dtype=torch.float64, layer_idx=1)  # reuses layer 0's top-k
    second.load_hf_state_dict(sd)
    dense = MLAAttention.from_hf_config({k: v for k, v in d.items() if not k.startswith("index_")},
                                        dtype=torch.float64)
    dense.load_hf_state_dict(sd)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    meta = BatchMetadata.build([6, 3], [0, 0], [[0, 1], [2]], 4)
    for layer, topk, match in ((second, None, "topk_indices: got None on layer 1, which reuses"),
                               (dense, torch.zeros(9, 3, dtype=torch.int32),
                                "topk_indices: got a tensor on a dense layer; supported None")):
        cache = layer.allocate_cache(4, 4)
        cache.data.copy_(torch.randn(cache.data.shape, dtype=torch.float64))
        before = cache.data.clone()
        with pytest.raises(ValueError, match=match):
            layer(x, None, cache, plan_step(meta, [layer]), topk_indices=topk)
        assert torch.equal(cache.data, before), "a rejected call wrote the cache"


def test_indexer_weights_are_checked_like_the_attention_weights():
    cfg = v32_config()
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    sd = {"model.layers.0.self_attn." + k: v for k, v in hf_v32_attention(cfg, seed=12).state_dict().items()}
    wk = "model.layers.0.self_attn.indexer.wk.weight"
    bad = {**sd, wk: sd[wk].long(), "model.layers.0.self_attn.indexer.k_norm.bias": [0.0] * 128}
    with pytest.raises(StateDictError) as info:
        layer.load_hf_state_dict(bad, prefix="model.layers.0.self_attn.")
    assert info.value.misshaped == [
        "model.layers.0.self_attn.indexer.k_norm.bias (got list; supported a tensor of shape [128])",
        f"{wk} (got dtype torch.int64; supported a floating-point tensor)"]
    assert not info.value.missing and not info.value.unexpected
    assert not layer._loaded
    layer.load_hf_state_dict(sd, prefix="model.layers.0.self_attn.")
    torch.testing.assert_close(layer.indexer.wk.weight, sd[wk])
