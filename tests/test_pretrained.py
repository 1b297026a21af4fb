"""``MLAAttention.from_pretrained`` / ``load_attention_layers`` on checkpoint folders written by the tests."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_models import tiny_v2, tiny_v3

import mla_backends
from mla_backends.loading.checkpoint import INDEX_FILE, CheckpointError, attention_prefix
from mla_backends.loading.fp8 import dequantize_block_fp8
from mla_backends.loading.hf import shard_hf_tensor

pytestmark = pytest.mark.usefixtures("one_thread")
MLAAttention = mla_backends.MLAAttention
SLICED = ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "o_proj.weight")


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory):
    model = tiny_v3()
    path = tmp_path_factory.mktemp("v3")
    model.save_pretrained(path, max_shard_size="20KB")
    return model, str(path)


def _attn_state(model, idx):
    return {k: v for k, v in model.model.layers[idx].self_attn.state_dict().items()}


def _shards(path):
    with open(os.path.join(path, INDEX_FILE)) as fh:
        return json.load(fh)["weight_map"]


class _Spy:
    """Wraps safetensors.safe_open: records opened files and, per tensor, the elements read."""

    def __init__(self, monkeypatch):
        import safetensors

        self.opened, self.read = [], {}
        real = safetensors.safe_open
        spy = self

        class Handle:
            def __init__(self, file, **kw):
                spy.opened.append(os.path.basename(file))
                self._h = real(file, **kw)

            def __enter__(self):
                self._f = self._h.__enter__()
                return self

            def __exit__(self, *exc):
                return self._h.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_tensor(self, key):
                t = self._f.get_tensor(key)
                spy.read[key] = spy.read.get(key, 0) + t.numel()
                return t

            def get_slice(self, key):
                sl = self._f.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def get_dtype(self):
                        return sl.get_dtype()

                    def __getitem__(self, idx):
                        t = sl[idx]
                        spy.read[key] = spy.read.get(key, 0) + t.numel()
                        return t

                return Slice()

        monkeypatch.setattr(safetensors, "safe_open", Handle)


def test_layers_get_exactly_the_module_weights(v3_folder):
    model, path = v3_folder
    assert len(set(_shards(path).values())) > 3  # really sharded
    for idx in range(3):
        layer = MLAAttention.from_pretrained(path, idx, backend="REF_TORCH")
        assert layer.dtype == torch.float32 and layer.layer_idx == idx  # the checkpoint's own dtype
        for name, ref in _attn_state(model, idx).items():
            mod, attr = name.rsplit(".", 1)
            assert torch.equal(getattr(getattr(layer, mod), attr), ref), name


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_read_only_their_slices(v3_folder, tp_size, monkeypatch):
    model, path = v3_folder
    full = _attn_state(model, 1)
    for rank in range(tp_size):
        spy = _Spy(monkeypatch)
        layer = MLAAttention.from_pretrained(path, 1, backend="REF_TORCH", tp_rank=rank, tp_size=tp_size)
        for name, ref in full.items():
            mod, attr = name.rsplit(".", 1)
            want = shard_hf_tensor(name, ref, layer.dims, rank)
            assert torch.equal(getattr(getattr(layer, mod), attr), want), (rank, name)
            read = spy.read[attention_prefix(1) + name]
            if name in SLICED:
                assert read == ref.numel() // tp_size, f"{name}: read {read} of {ref.numel()} elements"


def test_only_the_shards_holding_the_layer_are_opened(v3_folder, monkeypatch):
    _, path = v3_folder
    wm = _shards(path)
    for idx in range(3):
        need = {s for k, s in wm.items() if k.startswith(attention_prefix(idx))}
        assert need != set(wm.values())
        spy = _Spy(monkeypatch)
        MLAAttention.from_pretrained(path, idx, backend="REF_TORCH")
        assert set(spy.opened) == need, f"layer {idx}: opened {sorted(spy.opened)}; needed {sorted(need)}"


def test_load_attention_layers_all_and_some(v3_folder, capsys):
    model, path = v3_folder
    layers = mla_backends.load_attention_layers(path, backend="REF_TORCH")
    assert sorted(layers) == [0, 1, 2]
    assert "3/3" in capsys.readouterr().err  # the progress bar
    two = mla_backends.load_attention_layers(path, [2, 0], backend="REF_TORCH", progress=False,
                                             dtype=torch.float64)
    assert sorted(two) == [0, 2] and two[2].dtype == torch.float64
    assert torch.equal(two[2].kv_b_proj.weight, _attn_state(model, 2)["kv_b_proj.weight"].double())
    with pytest.raises(ValueError, match="layer_idx: got 3"):
        mla_backends.load_attention_layers(path, [0, 3])


def test_single_file_v2_checkpoint(tmp_path):
    model = tiny_v2()
    model.save_pretrained(tmp_path)
    assert not (tmp_path / INDEX_FILE).exists()
    layer = MLAAttention.from_pretrained(tmp_path, 1, backend="REF_TORCH", dtype="float64")
    assert layer.dims.q_lora_rank is None
    assert torch.equal(layer.q_proj.weight, _attn_state(model, 1)["q_proj.weight"].double())


def _fp8_folder(tmp_path, tp_size_hint=1):
    """A block-quantised fp8 checkpoint (blocks 8 x 8, partial last blocks) of tiny_v3's layer 0."""
    from safetensors.torch import save_file

    model = tiny_v3(num_layers=1)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prefix = attention_prefix(0)
    tensors, want = {}, {}
    g = torch.Generator().manual_seed(0)
    for name, w in _attn_state(model, 0).items():
        if w.dim() == 2:
            q = w.to(torch.float8_e4m3fn)
            scale = torch.rand(-(-w.shape[0] // 8), -(-w.shape[1] // 8), generator=g) + 0.5
            tensors[prefix + name] = q
            tensors[prefix + name + "_scale_inv"] = scale
            want[name] = dequantize_block_fp8(q, scale, (8, 8), torch.bfloat16)
        else:
            tensors[prefix + name] = w.to(torch.bfloat16)
            want[name] = w.to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return want


def test_fp8_checkpoint_loads_dequantised(tmp_path):
    want = _fp8_folder(tmp_path)
    layer = MLAAttention.from_pretrained(tmp_path, 0, backend="REF_TORCH")
    assert layer.dtype == torch.bfloat16  # fp8 releases dequantise to bf16
    for tp_size in (1, 2):
        for rank in range(tp_size):
            layer = MLAAttention.from_pretrained(tmp_path, 0, backend="REF_TORCH", tp_rank=rank, tp_size=tp_size)
            for name, ref in want.items():
                mod, attr = name.rsplit(".", 1)
                got = getattr(getattr(layer, mod), attr)
                assert torch.equal(got, shard_hf_tensor(name, ref, layer.dims, rank)), (tp_size, rank, name)


def test_errors_name_the_path_and_what_is_missing(v3_folder, tmp_path):
    _, path = v3_folder
    with pytest.raises(CheckpointError, match="no config.json"):
        MLAAttention.from_pretrained(tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="not an MLA model"):
        MLAAttention.from_pretrained(tmp_path, 0)
    with pytest.raises(TypeError, match="path"):
        MLAAttention.from_pretrained(3, 0)
    # a broken copy of the sharded folder: an index entry removed, a shard deleted, a key moved
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    wm_file = bad / INDEX_FILE
    index = json.loads(wm_file.read_text())
    wm = index["weight_map"]
    key0 = attention_prefix(0) + "kv_b_proj.weight"
    key2 = attention_prefix(2) + "o_proj.weight"
    key1 = attention_prefix(1) + "q_a_proj.weight"
    del wm[key0]
    shard2 = wm[key2]
    os.remove(bad / shard2)
    wm[key1] = next(s for s in set(wm.values()) if s != wm[key1] and s != shard2)
    wm_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"layer 0 has no \['{key0}'\]"):
        MLAAttention.from_pretrained(bad, 0)
    with pytest.raises(CheckpointError, match=rf"missing shard\(s\) \['{shard2}'\]"):
        MLAAttention.from_pretrained(bad, 2)
    with pytest.raises(CheckpointError, match=f"does not hold .*{key1}"):
        MLAAttention.from_pretrained(bad, 1)
    with pytest.raises(CheckpointError, match="layer 0 has no"):  # checked before any layer is read
        mla_backends.load_attention_layers(bad, [1, 0], progress=False)


def test_unreadable_index_and_shards_are_checkpoint_errors(v3_folder, tmp_path):
    """A broken index (invalid JSON, a JSON list) or a corrupt shard names the file; no raw parser error."""
    import shutil

    _, path = v3_folder
    bad = tmp_path / "broken"
    shutil.copytree(path, bad)
    index = bad / INDEX_FILE
    good_index = index.read_text()
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: not a readable JSON index"):
        MLAAttention.from_pretrained(bad, 0)
    index.write_text("[]")
    with pytest.raises(CheckpointError, match="no weight_map"):
        MLAAttention.from_pretrained(bad, 0)
    index.write_text(good_index)
    key, shard = next((k, v) for k, v in sorted(_shards(bad).items()) if ".self_attn." in k)
    layer = int(key.split(".")[2])  # model.layers.{L}.self_attn.*
    (bad / shard).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        MLAAttention.from_pretrained(bad, layer)


def test_fp8_scale_of_the_wrong_shape_is_refused_by_every_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    _fp8_folder(tmp_path)
    key = attention_prefix(0) + "q_b_proj.weight_scale_inv"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[key] = tensors[key][:-1].contiguous()  # one block row short
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for rank in range(2):  # rank 0's slice of the short scale used to look fine
        with pytest.raises(CheckpointError, match="q_b_proj.weight_scale_inv: got shape"):
            MLAAttention.from_pretrained(tmp_path, 0, backend="REF_TORCH", tp_rank=rank, tp_size=2)


def test_index_cannot_point_outside_the_folder_and_layers_are_checked_first(v3_folder, tmp_path, monkeypatch):
    import shutil

    _, path = v3_folder
    bad = tmp_path / "escape"
    shutil.copytree(path, bad)
    index = json.loads((bad / INDEX_FILE).read_text())
    key = next(k for k in index["weight_map"] if ".self_attn." in k)
    index["weight_map"][key] = "../elsewhere.safetensors"
    (bad / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="supported plain file names"):
        MLAAttention.from_pretrained(bad, 0)
    with pytest.raises(TypeError, match=r"layers\[1\]: got str"):
        mla_backends.load_attention_layers(path, [0, "1"], progress=False)
    # a bad option fails before any tensor is read
    reads = []
    from mla_backends.loading import checkpoint

    original = checkpoint.Checkpoint.read_attention_layer
    monkeypatch.setattr(checkpoint.Checkpoint, "read_attention_layer",
                        lambda self, *a, **k: reads.append(a) or original(self, *a, **k))
    with pytest.raises(ValueError):
        mla_backends.load_attention_layers(path, [0], backend="NOPE", progress=False)
    assert reads == []
