"""transformers' own ``generate()`` on a patched model against the unpatched one (tiny random models, fp32)."""

from __future__ import annotations

import pytest
import torch
from hf_models import LOGITS_RTOL, generate_greedy, left_padded, tiny_v2, tiny_v3
from hf_models import compare_generations as _compare

pytest.importorskip("transformers")
from mla_backends.integrations.transformers import (
    MLAGenerationCache,
    PatchedMLAAttention,
    UnsupportedGenerationError,
    is_patched,
    patch_model,
    unpatch_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 32


def _generate(model, ids, mask, **kw):
    return generate_greedy(model, ids, mask, NEW_TOKENS, **kw)


@pytest.mark.parametrize("build", [tiny_v3, tiny_v2], ids=["v3_moe_yarn_qlora", "v2_q_proj"])
def test_greedy_generate_matches_unpatched(build):
    model = build()
    ids, mask = left_padded([5, 11, 3])
    ref = _generate(model, ids, mask)
    patch_model(model, backend="REF_TORCH", block_size=4)  # small pages: many per request
    assert all(isinstance(layer.self_attn, PatchedMLAAttention) for layer in model.model.layers)
    got = _generate(model, ids, mask)
    assert len(got.logits) == NEW_TOKENS
    assert _compare(ref, got) >= NEW_TOKENS // 2
    again = _generate(model, ids, mask)  # a second call starts from a fresh cache (nothing leaks)
    assert torch.equal(again.sequences, got.sequences)
    unpatch_model(model)
    assert torch.equal(_generate(model, ids, mask).sequences, ref.sequences)


def test_sampling_follows_the_same_distribution():
    model = tiny_v3(seed=1)
    ids, mask = left_padded([4, 7, 2], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(7)
        ref = model.generate(ids, **kw)
        patch_model(model, backend="REF_TORCH")
        torch.manual_seed(7)
        got = model.generate(ids, **kw)
    assert torch.equal(ref, got)


def test_plain_forward_and_cache_lifetime():
    model = tiny_v3()
    ids, mask = left_padded([6, 6, 6])
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        patch_model(model, backend="REF_TORCH")
        got = model(ids, attention_mask=mask).logits
    assert ((ref - got).abs().max() / ref.abs().max()).item() < LOGITS_RTOL
    from mla_backends.integrations.transformers.attention import STEP_GATE
    assert STEP_GATE.thread is None and STEP_GATE.cache is None  # the forward's step and temporary cache are gone
    seen = []
    original = MLAGenerationCache.release

    def spy(self):
        seen.append(self.num_blocks)
        original(self)

    MLAGenerationCache.release = spy
    try:
        out = _generate(model, *left_padded([3, 5, 2]))
    finally:
        MLAGenerationCache.release = original
    assert seen and seen[0] > 0  # the call's pages were allocated, then released when it returned
    assert out.past_key_values.released and not out.past_key_values.caches


def test_decode_steps_run_absorbed_over_a_pool_allocated_once(monkeypatch):
    """Each decode step is one absorbed ``forward_mqa`` per layer over one new token per request; no
    ``forward_mha``, no re-run of the context, and the latent pool sized once for the call (never regrown or
    copied while decoding)."""
    import mla_backends.layer.attention as layer_mod
    from mla_backends.backends.contract import MLABackend

    model = tiny_v3()
    layers = len(model.model.layers)
    ids, mask = left_padded([5, 11, 3])
    patch_model(model, backend="REF_TORCH", block_size=4)
    steps: list[dict[str, list[int]]] = []
    begin, mqa, mha = MLAGenerationCache.begin_step, MLABackend.forward_mqa, layer_mod.forward_mha
    pools: list[list[int]] = []

    def on_begin(self, new_mask):
        begin(self, new_mask)
        steps.append({"mqa": [], "mha": []})
        pools.append([c.data.data_ptr() for c in self.caches.values()])

    def on_mqa(self, q_latent, *args, **kw):
        steps[-1]["mqa"].append(q_latent.shape[0])
        return mqa(self, q_latent, *args, **kw)

    def on_mha(q, *args, **kw):
        steps[-1]["mha"].append(q.shape[0])
        return mha(q, *args, **kw)

    monkeypatch.setattr(MLAGenerationCache, "begin_step", on_begin)
    monkeypatch.setattr(MLABackend, "forward_mqa", on_mqa)
    monkeypatch.setattr(layer_mod, "forward_mha", on_mha)
    out = _generate(model, ids, mask)
    assert len(steps) == NEW_TOKENS
    assert steps[0] == {"mqa": [], "mha": [19] * layers}  # the prefill: every real prompt token, expanded
    for t, step in enumerate(steps[1:], 1):
        assert step == {"mqa": [3] * layers, "mha": []}, f"decode step {t}: {step}"
    assert out.past_key_values.allocations == layers  # one pool per layer, sized for prompt + new tokens
    assert all(p == pools[0] for p in pools)


def test_pool_grows_when_the_bound_is_unknown():
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH", block_size=4)
    ids, mask = left_padded([6, 2])
    state = model.__dict__["_mla_backends_patch"]
    cache = MLAGenerationCache(state.layers, block_size=4, kv_cache_dtype="auto")  # given: no bound known
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       **{state.cache_kw: cache})
    assert cache.allocations > 1  # no reserve: the pool doubled as the sequences lengthened
    with pytest.raises(ValueError, match="reserve_tokens"):
        MLAGenerationCache({}, block_size=4, kv_cache_dtype="auto", reserve_tokens=0)


@pytest.mark.parametrize("kwargs, feature", [
    ({"num_beams": 2}, "beam search"),
    ({"penalty_alpha": 0.5, "top_k": 4}, "contrastive search"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
])
def test_unsupported_features_raise_naming_them(kwargs, feature):
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH")
    ids, mask = left_padded([3, 4])
    with pytest.raises(UnsupportedGenerationError, match=feature):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **kwargs)


def test_unpatch_restores_the_original_modules():
    model = tiny_v3()
    before = [layer.self_attn for layer in model.model.layers]
    patch_model(model, backend="REF_TORCH")
    assert is_patched(model)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)
    unpatch_model(model)
    assert not is_patched(model)
    assert [layer.self_attn for layer in model.model.layers] == before
    assert "generate" not in model.__dict__
    with pytest.raises(ValueError, match="did not patch"):
        unpatch_model(model)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="block_size"):
        patch_model(tiny_v3(num_layers=1), block_size=0)


def test_generate_without_a_cache_is_refused_not_wrong():
    """``use_cache=False`` makes transformers feed the whole sequence every step; a patched model always caches
    the latent, so it refuses the call instead of attending over rows added twice."""
    model = tiny_v3(num_layers=1)
    ids, mask = left_padded([5, 3])
    patch_model(model, backend="REF_TORCH")
    with pytest.raises(UnsupportedGenerationError, match="use_cache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       use_cache=False)
    unpatch_model(model)


def test_a_bare_decoder_stack_can_be_patched():
    """``DeepseekV3Model`` (no ``generate``): the attention modules are patched and a forward runs."""
    base = tiny_v3(num_layers=1).model
    ids, mask = left_padded([5, 3])
    want = base(ids, attention_mask=mask).last_hidden_state
    patch_model(base, backend="REF_TORCH")
    assert is_patched(base) and "generate" not in base.__dict__
    got = base(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)
    unpatch_model(base)
