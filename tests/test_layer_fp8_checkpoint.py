"""Block-quantised fp8 checkpoints (DeepSeek's releases: float8 ``X.weight`` + ``X.weight_scale_inv``).

The quantisation and the reference dequantisation are written plainly here, block by block in Python loops,
independent of ``mla_backends.loading.fp8``. Cases: blocks that do not divide the shapes, the block size
read from ``quantization_config``, a whole schedule against transformers with the dequantised weights, tensor
parallelism, the V3.2 indexer's weights, and every malformed pair listed with nothing loaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from layer_cases import SCHEDULE, hf_attention, hf_full_sequence, run_schedule, scattered_block_tables, tiny_config

from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.loading.fp8 import (
    DEFAULT_WEIGHT_BLOCK_SIZE,
    dequantize_block_fp8,
    dequantize_fp8_checkpoint,
    weight_block_size_from_config,
)
from mla_backends.loading.hf import StateDictError

pytestmark = pytest.mark.usefixtures("one_thread")

FP8 = torch.float8_e4m3fn
QUANTISED = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
             "kv_b_proj.weight", "o_proj.weight")


def quantise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax quantisation to e4m3 (scale = absmax / 448, not a power of two)."""
    rows, cols = w.shape
    nbr, nbc = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(rows, cols, dtype=FP8)
    scale = torch.empty(nbr, nbc, dtype=torch.float32)
    for i in range(nbr):
        for j in range(nbc):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            s = float(w[sl].abs().max()) / 448.0
            scale[i, j] = s
            q[sl] = (w[sl] / scale[i, j].double()).to(FP8)
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[sl] = q[sl].double() * float(scale[i, j])
    return out


def fp8_checkpoint(sd: dict[str, torch.Tensor], block: tuple[int, int]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the fp8 checkpoint, the same weights dequantised by hand in float64)."""
    fp8, plain = {}, {}
    for k, v in sd.items():
        if k.split(".", 1)[-1] in QUANTISED or k in QUANTISED:
            q, s = quantise(v.double(), block)
            fp8[k], fp8[k[: -len("weight")] + "weight_scale_inv"] = q, s
            plain[k] = dequantise(q, s, block)
        else:
            fp8[k] = plain[k] = v
    return fp8, plain


def _weights(layer: MLAAttention) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer.state_dict().items()} | {"W_UK_T": layer.W_UK_T.clone(),
                                                                    "W_UV": layer.W_UV.clone()}


def _config(block: list[int] | None):
    cfg = tiny_config()
    if block is not None:
        cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": block}
    return cfg


@pytest.mark.parametrize("block", [[16, 16], [8, 32], None])  # None: the default 128 x 128, one partial block
def test_fp8_checkpoint_loads_the_dequantised_weights_exactly(block):
    cfg = _config(block)
    blk = tuple(block) if block else DEFAULT_WEIGHT_BLOCK_SIZE
    fp8, plain = fp8_checkpoint(hf_attention(cfg).state_dict(), blk)
    assert any(v.dtype == FP8 for v in fp8.values()) and any(k.endswith("weight_scale_inv") for k in fp8)
    a = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    assert a.weight_block_size == blk
    a.load_hf_state_dict(fp8)
    b = MLAAttention.from_hf_config(tiny_config(), dtype=torch.float64)
    b.load_hf_state_dict(plain)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # and the dequantised weights are really the originals to fp8 precision (e4m3: 3 mantissa bits)
    orig = hf_attention(cfg).state_dict()
    for k in ("kv_b_proj.weight", "o_proj.weight"):
        rel = ((wa[k] - orig[k]).norm() / orig[k].norm()).item()
        assert 1e-4 < rel < 0.08, (k, rel)


def test_fp8_layer_schedule_matches_transformers_with_the_dequantised_weights():
    cfg = _config([16, 16])
    attn = hf_attention(cfg)
    fp8, plain = fp8_checkpoint(attn.state_dict(), (16, 16))
    attn.load_state_dict(plain)  # the oracle runs the weights the checkpoint really holds
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    layer.load_hf_state_dict(fp8)
    g = torch.Generator().manual_seed(3)
    lengths = [sum(s[b] for s in SCHEDULE) for b in range(len(SCHEDULE[0]))]
    xs = [torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64) for n in lengths]
    bt, nb = scattered_block_tables(len(xs), max(lengths), 4)
    outs = run_schedule(layer, layer.allocate_cache(nb, 4), bt, xs, SCHEDULE)
    for b, x in enumerate(xs):
        ref = hf_full_sequence(attn, cfg, x)
        err = ((torch.cat(outs[b]) - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-6, f"request {b}: relative error {err:.2e}"


def test_fp8_checkpoint_under_tensor_parallelism_takes_the_rank_slice_of_the_dequantised_weight():
    cfg = _config([16, 16])
    fp8, plain = fp8_checkpoint(hf_attention(cfg).state_dict(), (16, 16))
    a = MLAAttention.from_hf_config(cfg, dtype=torch.float64, tp_rank=1, tp_size=2)
    a.load_hf_state_dict(fp8)
    b = MLAAttention.from_hf_config(cfg, dtype=torch.float64, tp_rank=1, tp_size=2)
    b.load_hf_state_dict(plain)
    for k, v in _weights(a).items():
        assert torch.equal(v, _weights(b)[k]), k


def test_fp8_checkpoint_with_a_prefix_and_bf16_norms():
    cfg = _config([16, 16])
    fp8, plain = fp8_checkpoint(hf_attention(cfg).state_dict(), (16, 16))
    pre = "model.layers.0.self_attn."
    a = MLAAttention.from_hf_config(cfg, dtype=torch.float32)
    a.load_hf_state_dict({pre + k: (v.bfloat16() if "layernorm" in k else v) for k, v in fp8.items()},
                         prefix=pre)
    b = MLAAttention.from_hf_config(cfg, dtype=torch.float32)
    b.load_hf_state_dict({k: (v.bfloat16() if "layernorm" in k else v) for k, v in plain.items()})
    for k, v in _weights(a).items():
        assert torch.equal(v, _weights(b)[k]), k


def test_v32_indexer_weights_may_be_fp8_too():
    tmod = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32",
                               reason="this transformers has no deepseek_v32 model")
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=16, index_head_dim=128,
        index_topk=4, num_hidden_layers=1, max_position_embeddings=256, vocab_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]},
    )
    torch.manual_seed(0)
    attn = tmod.DeepseekV32Attention(cfg, layer_idx=0).double()
    sd = attn.state_dict()
    fp8 = dict(sd)
    for k in ("indexer.wq_b.weight", "indexer.wk.weight", "kv_b_proj.weight"):
        fp8[k], fp8[k[: -len("weight")] + "weight_scale_inv"] = quantise(sd[k], (16, 16))
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    layer.load_hf_state_dict(fp8)
    for k in ("wq_b.weight", "wk.weight"):
        want = dequantise(*quantise(sd["indexer." + k], (16, 16)), (16, 16))
        assert torch.equal(layer.indexer.state_dict()[k], want), k


def test_malformed_fp8_pairs_are_all_listed_and_nothing_is_loaded():
    cfg = _config([16, 16])
    fp8, plain = fp8_checkpoint(hf_attention(cfg).state_dict(), (16, 16))
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float64)
    layer.load_hf_state_dict(plain)
    before = _weights(layer)
    bad = {k: (v * 0.5 if v.dtype == torch.float32 else v) for k, v in fp8.items()}  # would change weights
    del bad["o_proj.weight_scale_inv"]  # fp8 weight, no scale
    bad["kv_b_proj.weight_scale_inv"] = torch.ones(2, 2)  # wrong shape: [5, 1] for [80, 16]
    bad["q_a_layernorm.weight_scale_inv"] = torch.ones(1, 1)  # a scale for a weight that is not fp8
    bad["extra.weight_scale_inv"] = torch.ones(1, 1)  # a scale with no weight
    with pytest.raises(StateDictError) as info:
        layer.load_hf_state_dict(bad)
    msg = str(info.value)
    assert "o_proj.weight (got torch.float8_e4m3fn without o_proj.weight_scale_inv" in msg
    assert "kv_b_proj.weight_scale_inv (got torch.float32 tensor of shape [2, 2]; supported a floating-point " \
           "tensor of shape [5, 1] (weight [80, 16] in 16 x 16 blocks)" in msg
    assert "q_a_layernorm.weight (got torch.float64 of shape [24] with a weight_scale_inv" in msg
    assert info.value.unexpected == ["extra.weight_scale_inv (no extra.weight to scale)"]
    assert len(info.value.misshaped) == 3
    after = _weights(layer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed weights"


def test_dequantize_block_fp8_validates_its_arguments():
    w = torch.zeros(20, 10).to(FP8)
    with pytest.raises(TypeError, match=r"weight: got torch.float32 tensor of shape \[20, 10\]; supported a 2-D"):
        dequantize_block_fp8(torch.zeros(20, 10), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"scale_inv: got torch.float32 tensor of shape \[1, 1\]; supported .* "
                                         r"shape \[3, 2\] \(weight \[20, 10\] in 8 x 8 blocks\)"):
        dequantize_block_fp8(w, torch.ones(1, 1), (8, 8))
    with pytest.raises(ValueError, match=r"weight_block_size: got \(0, 8\); supported two positive ints"):
        dequantize_block_fp8(w, torch.ones(1, 1), (0, 8))
    with pytest.raises(TypeError, match="state_dict: got list"):
        dequantize_fp8_checkpoint([w])
    out = dequantize_block_fp8(torch.ones(20, 10).to(FP8), torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                               (8, 8))
    assert out.dtype == torch.float32 and out[7, 7] == 1 and out[8, 8] == 4 and out[19, 9] == 6


def test_weight_block_size_from_every_config_form(tmp_path):
    assert weight_block_size_from_config(tiny_config()) == (128, 128)
    assert weight_block_size_from_config(_config([64, 32])) == (64, 32)
    assert weight_block_size_from_config({"quantization_config": {"weight_block_size": [4, 8]}}) == (4, 8)
    assert weight_block_size_from_config(MLADims.deepseek_v3()) == (128, 128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 16]}}))
    assert weight_block_size_from_config(str(path)) == (32, 16)
    with pytest.raises(ValueError, match=r"weight_block_size: got \(128,\); supported two positive ints"):
        weight_block_size_from_config({"quantization_config": {"weight_block_size": [128]}})
    with pytest.raises(ValueError, match="weight_block_size: got"):
        MLAAttention(MLADims.deepseek_v2_lite(), dtype=torch.float32, weight_block_size=(128, -1))


def test_fp8_checkpoint_into_a_bf16_layer_rounds_the_float32_product_once():
    cfg = _config([16, 16])
    fp8, plain = fp8_checkpoint(hf_attention(cfg).state_dict(), (16, 16))
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.bfloat16)
    layer.load_hf_state_dict(fp8)
    for k in ("kv_b_proj.weight", "o_proj.weight", "kv_a_proj_with_mqa.weight"):
        # float64 holds the fp8 x float32 product exactly, so .float() is the correctly rounded float32 product
        assert torch.equal(layer.state_dict()[k], plain[k].float().bfloat16()), k


def test_dequantize_rejects_bad_output_dtypes_and_block_sizes():
    w, s = torch.ones(4, 4).to(FP8), torch.ones(1, 1)
    for bad in ("bfloat16", torch.int8, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype: got .*; supported a floating-point torch.dtype other than float8"):
            dequantize_block_fp8(w, s, (4, 4), dtype=bad)
        with pytest.raises(TypeError, match="dtype: got"):
            dequantize_fp8_checkpoint({"x.weight": w, "x.weight_scale_inv": s}, (4, 4), dtype=bad)
    with pytest.raises(ValueError, match="weight_block_size: got 128; supported two positive ints"):
        weight_block_size_from_config({"quantization_config": {"weight_block_size": 128}})
    assert dequantize_block_fp8(w, s * 3, (4, 4), dtype=torch.float16).dtype == torch.float16
