"""Issue 37, part 8: what was left open on the transformers integration and the checkpoint loaders.

- Pickling a patched model works: the loaded model (``pickle``, ``torch.save``/``torch.load``) is patched on
  its own (its ``generate``, hooks and layers), gives transformers' tokens and unpatches to the original
  modules.
- ``copy.copy`` of a patched model is shared: the same modules and patch, the same tokens; unpatching or
  re-patching through the copy is refused (it would change the original under it), and once the original is
  unpatched the copy is plain too.
- ``MLAAttention.from_pretrained`` / ``load_attention_layers`` check their arguments before they read the
  checkpoint: a bad device, dtype, TP rank or a misspelt option opens no safetensors file.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from hf_models import compare_generations, generate_greedy, left_padded, tiny_v2, tiny_v3

pytest.importorskip("transformers")
import mla_backends  # noqa: E402
from mla_backends import checkpoint  # noqa: E402
from mla_backends.integrations.transformers import is_patched, patch_model, unpatch_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 5


def _round_trip_pickle(model):
    return pickle.loads(pickle.dumps(model))


def _round_trip_torch(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ---- pickling ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("round_trip", [_round_trip_pickle, _round_trip_torch], ids=["pickle", "torch.save"])
@pytest.mark.parametrize("build", [tiny_v3, tiny_v2], ids=["v3", "v2"])
def test_a_pickled_patched_model_is_patched_on_its_own(build, round_trip):
    model = build(num_layers=2)
    ids, mask = left_padded([5, 3])
    ref = generate_greedy(model, ids, mask, NEW)
    patch_model(model, backend="REF_TORCH", block_size=2)
    loaded = round_trip(model)
    assert is_patched(loaded) and loaded.generate.model is loaded  # its generate drives itself
    attn = loaded.model.layers[1].self_attn
    assert type(attn).__name__ == "PatchedMLAAttention" and attn.mla is not model.model.layers[1].self_attn.mla
    compare_generations(ref, generate_greedy(loaded, ids, mask, NEW))
    with torch.no_grad():  # its weights are its own
        attn.mla.o_proj.weight.zero_()
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))
    unpatch_model(loaded)
    assert not is_patched(loaded) and is_patched(model)
    assert type(loaded.model.layers[0].self_attn).__name__.endswith("Attention")
    assert "PatchedMLA" not in type(loaded.model.layers[0].self_attn).__name__
    assert not loaded.model._forward_pre_hooks and not loaded.model._forward_hooks  # its own hooks removed
    assert model.model._forward_pre_hooks  # the original keeps its own
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))


def test_a_pickled_copy_of_a_bare_decoder_stack_runs():
    model = tiny_v3(num_layers=1)
    ids, mask = left_padded([4, 6])
    with torch.no_grad():
        want = model.model(ids, attention_mask=mask).last_hidden_state
    stack = patch_model(model.model, backend="REF_TORCH")
    loaded = _round_trip_pickle(stack)
    assert is_patched(loaded)
    with torch.no_grad():
        got = loaded(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


# ---- copy.copy -------------------------------------------------------------------------------------------
def test_a_shallow_copy_is_shared_and_cannot_undo_the_original():
    model = tiny_v3(num_layers=2, seed=3)
    ids, mask = left_padded([6, 2, 4])
    ref = generate_greedy(model, ids, mask, NEW)
    patch_model(model, backend="REF_TORCH", block_size=4)
    shallow = copy.copy(model)
    assert shallow.model is model.model and is_patched(shallow)  # shared modules, shared patch
    compare_generations(ref, generate_greedy(shallow, ids, mask, NEW))
    with pytest.raises(ValueError, match=r"^model: got a shallow copy \(copy\.copy\).*unpatch_model on the model"):
        unpatch_model(shallow)
    with pytest.raises(ValueError, match=r"^model: got a shallow copy \(copy\.copy\).*patch_model"):
        patch_model(shallow, backend="REF_TORCH")
    assert is_patched(model) and is_patched(shallow)  # nothing changed
    assert type(model.model.layers[0].self_attn).__name__ == "PatchedMLAAttention"
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))
    unpatch_model(model)  # through the original: the copy, sharing its modules, is plain too
    assert not is_patched(shallow) and not is_patched(model)
    assert type(shallow.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    compare_generations(ref, generate_greedy(shallow, ids, mask, NEW))
    compare_generations(ref, generate_greedy(model, ids, mask, NEW))
    with pytest.raises(ValueError, match="shallow copy"):  # patching it would patch the original's modules
        patch_model(shallow, backend="REF_TORCH")
    patch_model(model, backend="REF_TORCH")  # the original can be patched again
    compare_generations(ref, generate_greedy(shallow, ids, mask, NEW))


def test_a_deep_copy_of_a_shallow_copy_is_its_own():
    model = patch_model(tiny_v3(num_layers=1), backend="REF_TORCH")
    deep = copy.deepcopy(copy.copy(model))
    assert is_patched(deep) and deep.model is not model.model
    unpatch_model(deep)  # its own: allowed, and the original stays patched
    assert is_patched(model) and not is_patched(deep)


# ---- from_pretrained checks arguments before reading -------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A sharded and a single-file checkpoint of one tiny model."""
    model = tiny_v3(num_layers=2)
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(sharded, max_shard_size="20KB")
    single = tmp_path_factory.mktemp("single")
    model.save_pretrained(single)
    return str(sharded), str(single)


@pytest.fixture
def opened(monkeypatch):
    """The safetensors files the loaders open (reading keys or tensors), and the layers whose tensors they
    read (``read_attention_layer``)."""
    seen: list = []
    real_open, real_read = checkpoint._safe_open, checkpoint.Checkpoint.read_attention_layer

    def spy_open(file):
        seen.append(file)
        return real_open(file)

    def spy_read(self, layer_idx, **kwargs):
        seen.append(("tensors of layer", layer_idx))
        return real_read(self, layer_idx, **kwargs)

    monkeypatch.setattr(checkpoint, "_safe_open", spy_open)
    monkeypatch.setattr(checkpoint.Checkpoint, "read_attention_layer", spy_read)
    return seen


#: arguments checked before the checkpoint is opened at all
BAD = [
    (dict(device="bogus"), ValueError, "device: got 'bogus'"),
    (dict(device="cuda:7"), ValueError, "device: got 'cuda:7'"),
    (dict(device=1.5), TypeError, "device: got float"),
    (dict(dtype="int8"), ValueError, "dtype: got 'int8'"),
    (dict(tp_rank=2, tp_size=2), ValueError, "tp_rank: got 2"),
    (dict(tp_size=0), ValueError, "tp_size: got 0"),
    (dict(tp_rank=-1), ValueError, "tp_rank: got -1"),
    (dict(devce="cpu"), TypeError, r"options: got unexpected keyword\(s\) \['devce'\]"),
]
#: arguments checked against the model's config: before any tensor is read (a single file's header, which
#: lists the keys, may have been opened)
BAD_FOR_THE_MODEL = [
    (dict(backend="NO_SUCH_BACKEND"), ValueError, "NO_SUCH_BACKEND"),
    (dict(dispatch="sometimes"), ValueError, "dispatch"),
    (dict(tp_size=3), ValueError, "tp_size"),
]


@pytest.mark.parametrize("which", [0, 1], ids=["sharded", "single-file"])
@pytest.mark.parametrize(("kwargs", "exc", "words"), BAD)
def test_from_pretrained_checks_arguments_before_reading(folders, opened, which, kwargs, exc, words):
    if kwargs.get("device") == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    path = folders[which]
    kwargs = {"backend": "REF_TORCH", **kwargs}
    with pytest.raises(exc, match=words):
        mla_backends.MLAAttention.from_pretrained(path, 1, **kwargs)
    with pytest.raises(exc, match=words):
        mla_backends.load_attention_layers(path, [1], progress=False, **kwargs)
    assert not opened, f"read the checkpoint before refusing {kwargs}: {opened}"


@pytest.mark.parametrize("which", [0, 1], ids=["sharded", "single-file"])
@pytest.mark.parametrize(("kwargs", "exc", "words"), BAD_FOR_THE_MODEL)
def test_from_pretrained_checks_model_arguments_before_reading_tensors(folders, opened, which, kwargs, exc, words):
    path = folders[which]
    kwargs = {"backend": "REF_TORCH", **kwargs}
    with pytest.raises(exc, match=words):
        mla_backends.MLAAttention.from_pretrained(path, 1, **kwargs)
    with pytest.raises(exc, match=words):
        mla_backends.load_attention_layers(path, [1], progress=False, **kwargs)
    assert not [s for s in opened if isinstance(s, tuple)], f"read tensors before refusing {kwargs}: {opened}"
    assert all(s.endswith("model.safetensors") for s in opened), opened  # at most a single file's header


@pytest.mark.parametrize("which", [0, 1], ids=["sharded", "single-file"])
def test_from_pretrained_refuses_a_bad_layer_index_before_reading_tensors(folders, opened, which):
    path = folders[which]
    for bad, exc in ((-1, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="layer_idx"):
            mla_backends.MLAAttention.from_pretrained(path, bad, backend="REF_TORCH")
    assert not opened
    with pytest.raises(ValueError, match="layer_idx: got 9; supported 0..1"):
        mla_backends.MLAAttention.from_pretrained(path, 9, backend="REF_TORCH")
    with pytest.raises(TypeError, match="progress: got str"):
        mla_backends.load_attention_layers(path, [1], progress="yes", backend="REF_TORCH")


def test_from_pretrained_still_loads_after_its_checks(folders):
    for path in folders:
        layer = mla_backends.MLAAttention.from_pretrained(path, 1, backend="REF_TORCH", device="cpu")
        layers = mla_backends.load_attention_layers(path, progress=False, backend="REF_TORCH", device="cpu")
        for name, p in layer.named_parameters():
            assert torch.equal(p, dict(layers[1].named_parameters())[name]), name
