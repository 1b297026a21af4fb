"""Issue 28 item 10 and two of its missing tests: what a checkpoint folder holds, not only its layout.

Classes: (1) a shard tensor stored in a dtype a layer cannot take (int32, bool, ...) is a ``CheckpointError``
naming the file and the tensor, never cast; (2) every JSON file read from a folder (``config.json``, the index,
a threshold table) that cannot be parsed (deep nesting included) is a ``ValueError`` naming the file.
Missing tests: an fp8 tensor-parallel slice whose start is not on a scale-block boundary; the keys of the
*second* requested layer checked before anything is read.

The folders are written here from a plain config dict and random tensors (no transformers model needed).
"""

from __future__ import annotations

import json

import pytest
import torch

import mla_backends
from mla_backends.core.config_fields import read_config_json
from mla_backends.core.dims import MLADims
from mla_backends.layer.thresholds import ThresholdTable
from mla_backends.loading import checkpoint
from mla_backends.loading.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, CheckpointError, attention_prefix
from mla_backends.loading.hf import expected_hf_shapes

pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("one_thread")

#: 4 heads, nope 8, rope 8, v 12, r 16, q_lora 24: q_b_proj [64, 24], kv_b_proj [80, 16], o_proj [32, 48]
CONFIG = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
          "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
          "max_position_embeddings": 256, "rope_theta": 10000.0, "num_hidden_layers": 2, "vocab_size": 97,
          "intermediate_size": 48, "torch_dtype": "float32"}
DEEP = 100_000  # far past Python's recursion limit


def _tensors(layer: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + layer)
    dims = MLADims.from_hf_config(CONFIG)
    return {attention_prefix(layer) + n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(dims).items()}


def _folder(tmp_path, *, config=None, sharded=False, tensors=None):
    """A checkpoint folder: config.json plus one file, or one shard per layer with an index."""
    from safetensors.torch import save_file

    config = dict(CONFIG if config is None else config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    layers = [tensors if tensors is not None else _tensors(0)] if not sharded else \
        [_tensors(i) for i in range(config["num_hidden_layers"])]
    if not sharded:
        save_file(layers[0], str(tmp_path / SINGLE_FILE))
        return tmp_path
    weight_map = {}
    for i, layer in enumerate(layers):
        shard = f"model-{i:05d}.safetensors"
        save_file(layer, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(layer, shard))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


# ---- (1) tensor dtypes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype, stored", [
    ("kv_a_layernorm.weight", torch.int32, "I32"),  # replicated
    ("kv_b_proj.weight", torch.bool, "BOOL"),  # sliced under tensor parallelism
    ("o_proj.weight", torch.int64, "I64"),
    ("q_a_proj.weight", torch.uint8, "U8"),
])
def test_a_non_float_shard_tensor_is_refused_naming_it(tmp_path, name, dtype, stored):
    tensors = _tensors(0)
    key = attention_prefix(0) + name
    tensors[key] = (tensors[key] > 0).to(dtype)  # values a cast would turn into a plausible weight
    path = _folder(tmp_path, config={**CONFIG, "num_hidden_layers": 1}, tensors=tensors)
    for tp_size in (1, 2):
        with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: {key} is stored as {stored}; supported "
                                                  r"floating point \(F16, BF16, F32, F64\) or fp8"):
            Checkpoint(path).read_attention_layer(0, tp_rank=tp_size - 1, tp_size=tp_size)
    with pytest.raises(CheckpointError, match=f"{key} is stored as {stored}"):
        mla_backends.load_attention_layers(path, backend="REF_TORCH", progress=False)


def test_float_dtypes_are_read_and_cast(tmp_path):
    """The check refuses only what is not floating point: f16 / bf16 / f64 tensors are read as before."""
    tensors = _tensors(0)
    kinds = (torch.float16, torch.bfloat16, torch.float64)
    for i, key in enumerate(sorted(tensors)):
        tensors[key] = tensors[key].to(kinds[i % 3])
    path = _folder(tmp_path, config={**CONFIG, "num_hidden_layers": 1}, tensors=tensors)
    got = Checkpoint(path).read_attention_layer(0, dtype=torch.float64)
    prefix = attention_prefix(0)
    assert set(got) == {k[len(prefix):] for k in tensors}
    for key, t in tensors.items():
        assert torch.equal(got[key[len(prefix):]], t.to(torch.float64)), key


# ---- (2) JSON files that cannot be parsed --------------------------------------------------------------------
def test_deeply_nested_index_is_a_checkpoint_error(tmp_path):
    path = _folder(tmp_path, sharded=True)
    (path / INDEX_FILE).write_text('{"weight_map": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: not a readable JSON index .*nested too deeply"):
        Checkpoint(path)
    (path / INDEX_FILE).write_bytes(b'{"weight_map": {"\xff": 1}}')  # not UTF-8
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: not a readable JSON index"):
        mla_backends.load_attention_layers(path, progress=False)


def test_deeply_nested_config_is_a_value_error_naming_the_file(tmp_path):
    path = _folder(tmp_path)
    (path / "config.json").write_text('{"rope_scaling": ' + "{\"a\": " * DEEP + "1" + "}" * DEEP + "}")
    where = str(path / "config.json")
    for read in (lambda: Checkpoint(path), lambda: read_config_json(path),
                 lambda: mla_backends.MLAAttention.from_pretrained(path, 0),
                 lambda: mla_backends.MLAAttention.from_hf_config(where)):
        with pytest.raises(ValueError, match=f"config: got invalid JSON in {where} .*nested too deeply"):
            read()


def test_deeply_nested_threshold_table_is_a_value_error_naming_the_file(tmp_path):
    table = tmp_path / "thresholds.json"
    table.write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(ValueError, match=f"threshold_table: got '{table}', not valid JSON"):
        ThresholdTable.load(table)


# ---- missing test: an fp8 slice starting inside a scale block --------------------------------------------------
BLOCK = (12, 5)  # divides none of the rank slices: q_b rows 32 / 16, kv_b rows 40 / 20, o_proj columns 24 / 12


def _plain_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64 ``q[i, j] * scale[i // bo, j // bi]``, written out."""
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = float(q[i, j]) * float(scale[i // block[0], j // block[1]])
    return out


def _fp8_folder(tmp_path, scale_dtype: torch.dtype = torch.float32):
    """Layer 0 with every matrix fp8 in ``BLOCK`` blocks; returns the folder and the plain float64 weights."""
    g = torch.Generator().manual_seed(1)
    tensors, full = {}, {}
    prefix = attention_prefix(0)
    for key, w in _tensors(0).items():
        if w.dim() == 2:
            q = w.to(torch.float8_e4m3fn)
            scale = torch.rand(-(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1]), generator=g) + 0.5
            tensors[key], tensors[key + "_scale_inv"] = q, scale.to(scale_dtype)
            full[key[len(prefix):]] = _plain_dequant(q, scale, BLOCK)
        else:
            tensors[key] = w
    config = {**CONFIG, "num_hidden_layers": 1,
              "quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}}
    return _folder(tmp_path, config=config, tensors=tensors), full


def test_fp8_rank_slices_that_start_inside_a_scale_block(tmp_path):
    """Each rank's slice of a block-quantised weight equals the same rows / columns of the whole weight
    dequantised plainly, although its first row (column) falls inside a scale block."""
    path, full = _fp8_folder(tmp_path)
    ckpt = Checkpoint(path)
    sliced = {"q_b_proj.weight": (0, 16), "kv_b_proj.weight": (0, 20), "o_proj.weight": (1, 12)}  # per head
    for tp_size in (2, 4):
        for rank in range(tp_size):
            got = ckpt.read_attention_layer(0, tp_rank=rank, tp_size=tp_size, dtype=torch.float64)
            for name, ref in full.items():
                if name in sliced:
                    dim, per_head = sliced[name]
                    width = per_head * 4 // tp_size
                    ref = ref.narrow(dim, rank * width, width)
                assert torch.equal(got[name], ref), (tp_size, rank, name)
    offsets = {(rank * per_head * 4 // tp) % BLOCK[dim] for dim, per_head in sliced.values() for tp in (2, 4)
               for rank in range(tp)}
    assert offsets - {0}, "no slice starts inside a block: the case this test is for is missing"


def test_an_integer_fp8_scale_is_refused_naming_it(tmp_path):
    path, _ = _fp8_folder(tmp_path, scale_dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"self_attn\.\w+\.weight_scale_inv: scale_inv: got torch.int32"):
        Checkpoint(path).read_attention_layer(0)


# ---- missing test: every requested layer checked before anything is read ---------------------------------------
@pytest.mark.parametrize("breakage", ["key", "shard"])
def test_the_second_requested_layer_is_checked_before_any_layer_is_built_or_read(tmp_path, monkeypatch, breakage):
    path = _folder(tmp_path, config={**CONFIG, "num_hidden_layers": 3}, sharded=True)
    broken = attention_prefix(2) + "kv_b_proj.weight"
    index = json.loads((path / INDEX_FILE).read_text())
    if breakage == "key":
        del index["weight_map"][broken]
        (path / INDEX_FILE).write_text(json.dumps(index))
        text = rf"layer 2 has no \['{broken}'\]"
    else:
        (path / index["weight_map"][broken]).unlink()
        text = r"missing shard\(s\) \['model-00002.safetensors'\] holding layer 2"
    reads, built = [], []
    monkeypatch.setattr(checkpoint.Checkpoint, "read_attention_layer", lambda self, *a, **k: reads.append(a))
    real_init = mla_backends.MLAAttention.__init__
    monkeypatch.setattr(mla_backends.MLAAttention, "__init__",
                        lambda self, *a, **k: built.append(a) or real_init(self, *a, **k))
    with pytest.raises(CheckpointError, match=text):
        mla_backends.load_attention_layers(path, [2, 0], backend="REF_TORCH", progress=False)
    assert reads == [] and built == [], "a layer was read or built before the second one was checked"
