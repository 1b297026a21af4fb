"""Issue 28 on the transformers integration: threads, copies, padding and options no longer answer silently
wrong; the page pool's cap, doubling and row copy each have a test (tiny random models, fp32, REF_TORCH)."""

from __future__ import annotations

import copy
import math
import sys
import threading

import pytest
import torch
from hf_models import compare_generations, generate_greedy, left_padded, right_padded, tiny_v3

pytest.importorskip("transformers")
from mla_backends.integrations.transformers import (
    DEFAULT_BLOCK_SIZE,
    MAX_RESERVE_TOKENS,
    MLAGenerationCache,
    PatchedMLAAttention,
    UnsupportedGenerationError,
    is_patched,
    patch_model,
    unpatch_model,
)
from mla_backends.integrations.transformers.attention import STEP_GATE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8
JOIN_S = 120  # generous: a deadlock, not slowness, is what a thread still alive after it means


def _state(model):
    return model.__dict__["_mla_backends_patch"]


def _gate_free() -> bool:
    """No step in flight and nobody holds the gate."""
    if not STEP_GATE._lock.acquire(blocking=False):
        return False
    STEP_GATE._lock.release()
    return STEP_GATE.thread is None and STEP_GATE.cache is None


def _in_threads(jobs):
    """Run each ``job()`` in its own thread, all released at once; their results (or exceptions)."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(i):
        start.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that steps of different calls interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock)"
    return results


# ---- 1. threads ------------------------------------------------------------------------------------------
def test_threads_sharing_one_patched_model_each_get_transformers_tokens():
    model = tiny_v3(num_layers=2)
    prompts = [left_padded(lengths, seed=s) for s, lengths in enumerate([[5, 9, 3], [7, 2], [4, 4, 6, 1], [8]])]
    refs = [generate_greedy(model, ids, mask, NEW) for ids, mask in prompts]
    patch_model(model, backend="REF_TORCH", block_size=4)
    got = _in_threads([lambda p=p: generate_greedy(model, *p, NEW) for p in prompts])
    for i, (ref, out) in enumerate(zip(refs, got, strict=True)):
        assert not isinstance(out, BaseException), f"thread {i}: {out!r}"
        compare_generations(ref, out)
    assert _gate_free()


def test_threads_on_a_model_and_its_copy_and_a_plain_forward():
    model = tiny_v3(num_layers=1, seed=2)
    ids, mask = left_padded([6, 3], seed=1)
    ref = generate_greedy(model, ids, mask, NEW)
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
    patch_model(model, backend="REF_TORCH", block_size=2)
    twin = copy.deepcopy(model)

    def forward():
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits

    got = _in_threads([lambda: generate_greedy(model, ids, mask, NEW), lambda: generate_greedy(twin, ids, mask, NEW),
                       forward, forward])
    assert not any(isinstance(g, BaseException) for g in got), got
    compare_generations(ref, got[0])
    compare_generations(ref, got[1])
    real = mask.bool()
    for logits in got[2:]:
        torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-4, atol=1e-4)


def test_a_forward_that_raises_lets_the_gate_go(monkeypatch):
    """The step hook runs when the forward raises, so another thread's call is not left waiting."""
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH")
    ids, mask = left_padded([4, 2])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits

    def boom(self, *args, **kwargs):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(PatchedMLAAttention, "forward", boom)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            model(ids, attention_mask=mask)
        assert _gate_free()
        with pytest.raises(RuntimeError, match="boom"):
            generate_greedy(model, ids, mask, 2)
        assert _gate_free()
    (got,) = _in_threads([lambda: model(ids, attention_mask=mask).logits.detach()])
    assert torch.equal(got, want)


# ---- 2. copies -------------------------------------------------------------------------------------------
def test_a_deep_copy_generates_with_its_own_weights():
    model = tiny_v3(num_layers=2)
    ids, mask = left_padded([5, 8])
    ref = generate_greedy(model, ids, mask, NEW)
    changed = tiny_v3(num_layers=2)  # unpatched, with the change made to the copy below
    with torch.no_grad():
        changed.model.layers[1].self_attn.o_proj.weight.mul_(-2.0)
        changed.lm_head.weight.mul_(-1.0)
    ref_changed = generate_greedy(changed, ids, mask, NEW)
    assert not torch.equal(ref.sequences, ref_changed.sequences)

    patch_model(model, backend="REF_TORCH")
    twin = copy.deepcopy(model)
    assert is_patched(twin)
    assert twin.model.layers[1].self_attn.mla is not model.model.layers[1].self_attn.mla
    with torch.no_grad():  # the copy's own attention (patched) and head weights
        twin.model.layers[1].self_attn.mla.o_proj.weight.mul_(-2.0)
        twin.lm_head.weight.mul_(-1.0)
    compare_generations(ref_changed, generate_greedy(twin, ids, mask, NEW))
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))  # the original is untouched
    unpatch_model(twin)  # the copy's own originals come back; the original stays patched
    assert is_patched(model) and not is_patched(twin)
    assert type(twin.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))


# ---- 3. padding ------------------------------------------------------------------------------------------
def test_generate_refuses_right_padding_and_rows_of_padding_only():
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH")
    ids, mask = right_padded([5, 3, 4])
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 1 .*right padding.*left"):
        generate_greedy(model, ids, mask, 2)
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 1 .*right padding"):
        generate_greedy(model, ids, None, 2)  # transformers infers the mask from the pad tokens
    ids, mask = left_padded([5, 3, 4])
    mask[2] = 0
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 2 is all padding"):
        generate_greedy(model, ids, mask, 2)
    ids[2] = 0  # all pad tokens: transformers infers a row of padding, refused at the first decode step
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 2 of the prompt is all padding"):
        generate_greedy(model, ids, None, 2)
    mid = left_padded([5, 3])[1]
    mid[0, 2] = 0  # a hole inside the prompt
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 0 .*padding after a real token"):
        generate_greedy(model, left_padded([5, 3])[0], mid, 2)
    assert _gate_free()
    ids, mask = left_padded([5, 3, 4])
    assert generate_greedy(model, ids, mask, 2).sequences.shape == (3, 7)  # left padding still runs


def test_chunked_prefill_of_left_padding_still_matches_transformers():
    """Chunks of 4 over a 9-token prompt: row 1's only real token comes in the last, 1-token chunk (not taken
    for a generated token of a row of padding only); a prompt of padding only is still refused."""
    model = tiny_v3(num_layers=1)
    ids, mask = left_padded([9, 1, 5])
    ref = generate_greedy(model, ids, mask, 4, prefill_chunk_size=4)
    patch_model(model, backend="REF_TORCH")
    compare_generations(ref, generate_greedy(model, ids, mask, 4, prefill_chunk_size=4))
    ids[1] = 0  # a row of pad tokens only: the mask transformers infers has no real token in it
    with pytest.raises(UnsupportedGenerationError, match=r"attention_mask: row 1 of the prompt is all padding"):
        generate_greedy(model, ids, None, 4, prefill_chunk_size=4)
    assert _gate_free()


def test_a_plain_forward_of_right_padding_matches_transformers_at_the_real_tokens():
    model = tiny_v3(num_layers=2)
    ids, mask = right_padded([6, 2, 4])
    mask[1, :] = 0  # and a row of padding only: no real token to compare, nothing refused
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        patch_model(model, backend="REF_TORCH")
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


# ---- 12. options -----------------------------------------------------------------------------------------
def test_a_plain_forward_refuses_what_it_cannot_honour():
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH")
    ids, mask = left_padded([4, 2])
    with torch.no_grad():
        with pytest.raises(UnsupportedGenerationError, match="output_attentions: got True"):
            model(ids, attention_mask=mask, output_attentions=True)
        with pytest.raises(UnsupportedGenerationError, match="output_attentions: got True"):
            model.model(ids, attention_mask=mask, output_attentions=True)  # the bare stack too
        model.config.output_attentions = True  # the config's default counts as asking
        with pytest.raises(UnsupportedGenerationError, match="output_attentions"):
            model(ids, attention_mask=mask)
        model.config.output_attentions = False
        with pytest.raises(UnsupportedGenerationError, match="cu_seq_lens_q.*packed sequences"):
            model(ids, attention_mask=mask, cu_seq_lens_q=torch.tensor([0, 4, 6]))
        with pytest.raises(ValueError, match=r"attention_mask: got shape \[3, 4\]; supported \[2, L\]"):
            model(ids, attention_mask=torch.ones(3, 4, dtype=torch.long))
        with pytest.raises(UnsupportedGenerationError, match="attention_mask: got .*2-D"):
            model(ids, attention_mask=torch.ones(2, 1, 4, 4))
        assert _gate_free()
        out = model(ids, attention_mask=mask, output_hidden_states=True)  # what it honours still runs
    assert len(out.hidden_states) == 2 and out.logits.shape == (2, 4, 97)


# ---- the page pool (mutation tests) ----------------------------------------------------------------------
@pytest.mark.parametrize("positions, reserve, tokens", [
    (256, 10, 10),                          # the call's own bound
    (256, 10**6, 256),                      # capped at the layers' max_model_len
    (2 * MAX_RESERVE_TOKENS, 10**6, MAX_RESERVE_TOKENS),  # capped at MAX_RESERVE_TOKENS
])
def test_the_first_step_reserves_the_capped_bound(positions, reserve, tokens):
    model = patch_model(tiny_v3(num_layers=1, max_positions=positions), backend="REF_TORCH")
    cache = _state(model).new_cache(reserve_tokens=reserve)
    cache.begin_step(torch.ones(2, 3, dtype=torch.bool))
    assert cache.num_blocks == 2 * math.ceil(tokens / DEFAULT_BLOCK_SIZE)
    assert next(iter(cache.caches.values())).num_blocks == cache.num_blocks
    cache.release()


def test_a_growing_pool_doubles_keeps_its_rows_and_gives_transformers_tokens(monkeypatch):
    """A cache passed in has no bound: its pool grows while decoding, each time to twice its pages (or what
    is needed, if more), the old rows copied, and the tokens are still unpatched transformers'."""
    model = tiny_v3(num_layers=2)
    ids, mask = left_padded([6, 2, 4], seed=5)
    ref = generate_greedy(model, ids, mask, NEW)
    patch_model(model, backend="REF_TORCH", block_size=1)
    cache = MLAGenerationCache(_state(model).layers, block_size=1, kv_cache_dtype="auto")
    seen: list[tuple[int, int]] = []  # (pages handed out, pool pages) after each step began
    begin = MLAGenerationCache.begin_step

    def spy(self, new_mask):
        begin(self, new_mask)
        seen.append((sum(len(p) for p in self.pages), self.num_blocks))

    monkeypatch.setattr(MLAGenerationCache, "begin_step", spy)
    got = generate_greedy(model, ids, mask, NEW, **{_state(model).cache_kw: cache})
    compare_generations(ref, got)
    pool, growths = 0, 0
    for used, blocks in seen:
        if used > pool:
            pool, growths = max(used, 2 * pool), growths + 1
        assert blocks == pool, f"pool {blocks} pages for {used} used; doubling gives {pool}"
    assert 1 < growths < len(seen)  # grew during decoding, not at every step
    assert cache.allocations == growths * 2  # per growth, one pool per layer
