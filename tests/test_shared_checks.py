"""The small pieces several modules share: config.json reading, slot-mapping checks and block-table slots
(latent and indexer caches), the device check, the FlashInfer output buffers and the FlashInfer backends'
common ``forward_mqa`` checks. Each is exercised through every caller that relies on it."""

from __future__ import annotations

import json

import pytest
import torch

from mla_backends.backends import inputs as device_module  # where check_declared_support looks devices up
from mla_backends.core.device import simulated_device
from mla_backends.core.dims import MLADims, read_config_json
from mla_backends.core.validation import require_on_device
from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
)
from mla_backends.flashinfer_mla._common import deliver_outputs, output_buffers
from mla_backends.layer.sparse import IndexerKeyCache
from mla_backends.loading.hf import hf_attention_bias
from mla_backends.step.cache import LatentKVCache, block_table_slots, check_slot_mapping
from mla_backends.step.metadata import BatchMetadata

V2_LITE = {"num_attention_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "hidden_size": 2048, "q_lora_rank": None, "attention_bias": True}


# ---- config.json ------------------------------------------------------------------------------------------
def test_config_json_is_read_from_a_file_or_its_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE))
    assert read_config_json(tmp_path) == V2_LITE
    assert read_config_json(tmp_path / "config.json") == V2_LITE
    assert MLADims.from_hf_config(tmp_path).num_heads == 16
    assert hf_attention_bias(tmp_path) is True and hf_attention_bias(str(tmp_path / "config.json")) is True
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in V2_LITE.items() if k != "attention_bias"}))
    assert hf_attention_bias(tmp_path) is False


def test_missing_config_json_names_the_argument(tmp_path):
    for call in (read_config_json, MLADims.from_hf_config, hf_attention_bias):
        with pytest.raises(ValueError, match=r"^config: got path .*missing.*; supported a config.json file"):
            call(tmp_path / "missing")


# ---- slots ------------------------------------------------------------------------------------------------
def test_slot_mapping_accepts_skips_and_in_range_slots_only():
    check_slot_mapping(torch.tensor([-1, 0, 11]), 3, 4)
    check_slot_mapping(torch.empty(0, dtype=torch.int64), 3, 4)
    for bad, shown in (([0, 12], "[0, 12]"), ([-2, 3], "[-2, 3]")):
        with pytest.raises(ValueError, match=rf"^slot_mapping: got values in \{shown[:-1]}\]; supported -1 "
                                             rf"\(skip\) or \[0, 11\] for 3 blocks of 4$"):
            check_slot_mapping(torch.tensor(bad), 3, 4)


@pytest.mark.parametrize("which", ["latent", "indexer"])
def test_both_caches_reject_bad_slots_and_devices_before_writing(which):
    if which == "latent":
        cache = LatentKVCache(3, 4, 8, 4, model_dtype=torch.float32)

        def write(slots, device="cpu"):
            cache.write(torch.ones(2, 8, device=device), torch.ones(2, 4), slots)
        first = "kv_c"
    else:
        cache = IndexerKeyCache(3, 4, 128, storage="float32")

        def write(slots, device="cpu"):
            cache.write(torch.ones(2, 128, device=device), slots)
        first = "k"
    with pytest.raises(ValueError, match=r"^slot_mapping: got values in \[0, 12\]"):
        write(torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=rf"^{first}: got device meta; supported the cache's device cpu$"):
        write(torch.tensor([0, 1]), device="meta")
    assert not bool(cache.data.any())  # nothing was written
    write(torch.tensor([-1, 5]))
    flat = cache.data.view(-1, cache.row_width)
    assert bool(flat[5].any()) and int(flat.any(dim=-1).sum()) == 1  # the -1 row was skipped


def test_block_table_slots_follow_the_row_and_both_caches_gather_by_them():
    row = torch.tensor([2, 0, 1], dtype=torch.int32)
    want = [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 0, 1, 2, 3, 4 * 1 + 0]  # block 2, block 0, block 1
    assert block_table_slots(row, 9, 4).tolist() == want
    assert block_table_slots(row, 0, 4).tolist() == []
    with pytest.raises(TypeError, match="^length: got float"):
        block_table_slots(row, 2.0, 4)
    latent = LatentKVCache(3, 4, 8, 4, model_dtype=torch.float64, kv_cache_dtype="float64")
    keys = IndexerKeyCache(3, 4, 128, storage="float32")
    latent.data.copy_(torch.arange(latent.data.numel(), dtype=torch.float64).view_as(latent.data))
    keys.data.copy_(torch.arange(keys.data.numel(), dtype=torch.float32).view_as(keys.data))
    idx = torch.tensor(want)
    assert torch.equal(latent.gather(row, 9), latent.data.view(-1, 12)[idx])
    assert torch.equal(keys.gather(row, 9), keys.data.view(-1, 128)[idx])


def test_require_on_device_names_the_tensor_and_owner():
    require_on_device(torch.device("cpu"), a=torch.zeros(1), b=torch.zeros(2))
    with pytest.raises(ValueError, match=r"^b: got device meta; supported the layer's device cpu$"):
        require_on_device(torch.device("cpu"), "the layer's", a=torch.zeros(1), b=torch.zeros(1, device="meta"))


# ---- FlashInfer output buffers ----------------------------------------------------------------------------
def test_output_buffers_reuse_contiguous_caller_buffers():
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(3, 2)
    result, got_lse = output_buffers(q, out, lse)
    assert result is out and got_lse is lse
    assert deliver_outputs(result, got_lse, out, lse) == (out, lse)


def test_output_buffers_stage_non_contiguous_caller_buffers_and_copy_back():
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    out = torch.zeros(3, 8, 2, dtype=torch.bfloat16).transpose(1, 2)  # [3, 2, 8], non-contiguous
    lse = torch.zeros(2, 3).t()  # [3, 2], non-contiguous
    result, got_lse = output_buffers(q, out, lse)
    assert result is not out and result.is_contiguous() and result.dtype == q.dtype and result.shape == q.shape
    assert got_lse is not lse and got_lse.is_contiguous() and got_lse.dtype == torch.float32
    result.copy_(q)
    got_lse.fill_(1.5)
    final_out, final_lse = deliver_outputs(result, got_lse, out, lse)
    assert final_out is out and final_lse is lse
    assert torch.equal(out, q) and bool((lse == 1.5).all())
    fresh, fresh_lse = output_buffers(q, None, None)
    assert fresh.shape == (3, 2, 8) and fresh_lse.shape == (3, 2)
    assert deliver_outputs(fresh, fresh_lse, None, None) == (fresh, fresh_lse)


# ---- the FlashInfer backends' common forward_mqa checks ----------------------------------------------------
def _batch(kv="auto", dtype=torch.bfloat16, heads=16):
    cache = LatentKVCache(4, 64, kv_cache_dtype=kv, model_dtype=dtype)
    meta = BatchMetadata.build([1, 1], [5, 9], [[0, -1], [1, -1]], 64, num_blocks=4)
    q = torch.zeros(2, heads, 512, dtype=dtype)
    return cache, meta, q, torch.zeros(2, heads, 64, dtype=dtype)


ALL = (FlashInferMLABackend, FlashInferCutlassMLABackend, FlashInferTrtllmMLABackend, FlashInferXqaMLABackend)


def _refused(cls, *args, **kwargs) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as info:
        cls().forward_mqa(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_every_flashinfer_backend_refuses_topk_naming_itself(cls, monkeypatch):
    monkeypatch.setattr(device_module, "device_info_for",
                        lambda device: simulated_device(*min(cls.capabilities.compute_capabilities)))
    cache, meta, q, qr = _batch()
    topk = torch.zeros(2, 4, dtype=torch.int32)
    err = _refused(cls, q, qr, cache, meta, scale=0.1, topk_indices=topk)
    assert isinstance(err, ValueError)
    assert str(err) == f"{cls.name} cannot run these inputs: attention: got sparse (top-k indices); supported " \
                       "dense only"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_lse_buffer_is_refused_exactly_where_no_lse_is_declared(cls):
    cache, meta, q, qr = _batch()
    lse = torch.empty(2, 16)
    device = f"device: got CPU; supported a CUDA device ({cls.capabilities.compute_capability_text()})"
    want = [device] if cls.capabilities.returns_lse else [device, "LSE: got a request for it; supported output "
                                                                  "only (no LSE)"]
    err = _refused(cls, q, qr, cache, meta, scale=0.1, lse_out=lse)
    assert str(err) == f"{cls.name} cannot run these inputs: " + "; ".join(want)


@pytest.mark.parametrize("cls,fp8_text", [(FlashInferMLABackend, " or fp8_e4m3"), (FlashInferCutlassMLABackend, "")],
                         ids=["fa", "cutlass"])
def test_cache_must_hold_the_query_dtype(cls, fp8_text, monkeypatch):
    monkeypatch.setattr(device_module, "device_info_for",
                        lambda device: simulated_device(*min(cls.capabilities.compute_capabilities)))
    cache, meta, q, qr = _batch(kv="float16")
    err = _refused(cls, q, qr, cache, meta, scale=0.1)
    assert isinstance(err, TypeError)
    assert str(err) == (f"{cls.name} cannot run these inputs: kv cache dtype: got float16 with bfloat16 queries; "
                        f"supported the query dtype (bfloat16){fp8_text}")


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_dims_outside_the_kernel_are_refused(cls, monkeypatch):
    monkeypatch.setattr(device_module, "device_info_for",
                        lambda device: simulated_device(*min(cls.capabilities.compute_capabilities)))
    cache = LatentKVCache(4, 64, 256, 64, model_dtype=torch.bfloat16)
    meta = BatchMetadata.build([1], [5], [[0]], 64, num_blocks=4)
    q, qr = torch.zeros(1, 16, 256, dtype=torch.bfloat16), torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    err = _refused(cls, q, qr, cache, meta, scale=0.1)
    assert str(err) == (f"{cls.name} cannot run these inputs: kv_lora_rank/qk_rope_head_dim: got 256/64; "
                        "supported 512/64")


def test_declared_support_is_derived_when_planned_and_looked_up(monkeypatch):
    """A configured backend's combination, with and without an LSE, is asked of its declarations once, when the
    step is planned; the calls of every layer then look it up in the plan. Without a plan a call is asked in
    full, and a rejection is never recorded."""
    from mla_backends.backends.contract import AttentionSpec, configure_backend
    from mla_backends.backends.inputs import check_declared_support
    from mla_backends.ref_torch import RefTorchBackend
    from mla_backends.step.plan import plan_step

    cache, meta, q, qr = _batch()
    calls = []
    inner = RefTorchBackend.not_supported_reasons.__func__

    def spy(cls, spec):
        calls.append(spec.need_lse)
        return inner(cls, spec)

    monkeypatch.setattr(RefTorchBackend, "not_supported_reasons", classmethod(spy))
    backend = configure_backend(RefTorchBackend, AttentionSpec(num_heads=16, dtype=torch.bfloat16, block_size=64),
                                0.1)
    plan = plan_step(meta, [backend])
    assert calls == [False, True] and plan.accepted  # without and with an LSE
    for _ in range(3):  # three layers of one step
        check_declared_support(RefTorchBackend, q, cache, meta, plan=plan)
        check_declared_support(RefTorchBackend, q, cache, meta, lse_out=torch.empty(2, 16), plan=plan)
    assert calls == [False, True]
    check_declared_support(RefTorchBackend, q, cache, meta)  # no plan: asked in full
    assert calls == [False, True, False]
    with pytest.raises(TypeError, match="REF_TORCH cannot run these inputs: dtype: got int8"):
        check_declared_support(RefTorchBackend, q.to(torch.int8), cache, meta)  # a rejection is never cached
