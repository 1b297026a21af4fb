"""``TRITON_MLA`` declarations, device gating, lazy import, the split heuristic and input validation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from devices import case_device

from mla_backends.backends import inputs as device_module  # where check_declared_support looks devices up
from mla_backends.backends.contract import AttentionSpec
from mla_backends.core.device import CPU_DEVICE, DeviceInfo
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.triton_mla import TritonMLABackend, choose_num_kv_splits
from mla_backends.triton_mla.splits import MAX_KV_SPLITS, block_h_for, next_pow2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132)
A100 = DeviceInfo(kind="cuda", name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), sm_count=108)
T4 = DeviceInfo(kind="cuda", name="Tesla T4", compute_capability=(7, 5), sm_count=40)


def reasons(**kw):
    return TritonMLABackend.not_supported_reasons(AttentionSpec(num_heads=kw.pop("num_heads", 16), **kw))


# ---- device gating ---------------------------------------------------------------------------------------
def test_cpu_rejected_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = TritonMLABackend.device_reasons(CPU_DEVICE)
    assert got == [
        "device: got CPU; supported a CUDA device (SM80+); requires a CUDA device — set "
        "TRITON_INTERPRET=1 to run interpreted, for testing only"
    ]
    assert got[0] in reasons(device=CPU_DEVICE)


def test_cpu_accepted_under_interpreter_for_testing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonMLABackend.device_reasons(CPU_DEVICE) == []
    assert (
        reasons(device=CPU_DEVICE, kv_cache_dtype="fp8_e4m3", max_query_len=4, sparse=True, need_lse=True)
        == []
    )
    assert "testing" in TritonMLABackend.description


def test_gpu_generations():
    assert reasons(device=H100, kv_cache_dtype="fp8_e5m2", block_size=64, need_lse=True) == []
    assert reasons(device=A100, kv_cache_dtype="bfloat16") == []
    fp8_on_a100 = reasons(device=A100, kv_cache_dtype="fp8_e4m3")
    assert fp8_on_a100 == ["fp8 cache: got SM80; supported SM89+ (native fp8 conversion)"]
    assert reasons(device=T4) == ["compute capability: got SM75; supported SM80+"]


def test_declared_page_sizes_dtypes_and_dims():
    caps = TritonMLABackend.capabilities
    assert caps.preferred_page_size == 64 and caps.page_size_reason(64) is None
    assert reasons(device=H100, block_size=48) == [
        "page size: got 48; supported 1, 2, 4, 8, 16, 32, 64, 128, 256"
    ]
    assert any(str(r).startswith("dtype: got float64") for r in reasons(device=H100, dtype=torch.float64))
    assert reasons(device=H100, kv_lora_rank=256, qk_rope_head_dim=64) == []
    assert caps.requires == ("triton",) and caps.extra == "triton" and caps.sparse and caps.dense


def test_importing_the_backend_and_gating_do_not_import_triton():
    code = textwrap.dedent("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        from mla_backends.triton_mla import TritonMLABackend
        from mla_backends.backends.contract import AttentionSpec
        from mla_backends.core.device import CPU_DEVICE
        r = TritonMLABackend.not_supported_reasons(AttentionSpec(num_heads=16, device=CPU_DEVICE))
        assert any("requires a CUDA device" in str(x) for x in r), r
        assert "triton" not in sys.modules, "triton imported"
        assert "mla_backends.triton_mla.kernels" not in sys.modules
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ---- input validation before any kernel ---------------------------------------------------------------
def _tiny(q_dtype=torch.bfloat16, device=None):
    """A 1-token case on ``device`` (default :func:`devices.case_device`: CUDA when it can run kernels)."""
    device = case_device() if device is None else device
    cache = LatentKVCache(4, 16, 512, 64, kv_cache_dtype="bfloat16", model_dtype=torch.bfloat16, device=device)
    bt = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    meta = BatchMetadata.build([1], [3], bt, 16, num_blocks=4)
    zeros = dict(dtype=q_dtype, device=device)
    return cache, meta, torch.zeros(1, 16, 512, **zeros), torch.zeros(1, 16, 64, **zeros)


def test_forward_on_cpu_without_interpreter_names_the_device(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path; this machine has CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache, meta, ql, qr = _tiny(device="cpu")
    with pytest.raises(ValueError, match=r"device: got CPU; supported a CUDA device .*TRITON_INTERPRET=1"):
        TritonMLABackend().forward_mqa(ql, qr, cache, meta, scale=0.1)


def test_rejects_unsupported_query_dtype():
    cache, meta, ql, qr = _tiny(torch.float64)
    with pytest.raises(TypeError) as info:
        TritonMLABackend().forward_mqa(ql, qr, cache, meta, scale=0.1)
    assert str(info.value) == "TRITON_MLA cannot run these inputs: dtype: got float64; supported bfloat16, " \
                              "float16, float32"


@pytest.mark.parametrize("device,kv,reason", [
    (A100, "fp8_e4m3", "fp8 cache: got SM80; supported SM89+ (native fp8 conversion)"),
    (T4, "bfloat16", "compute capability: got SM75; supported SM80+"),
])
def test_forward_refuses_what_the_declarations_refuse_on_its_device(monkeypatch, device, kv, reason):
    # the tensors stay on the CPU; the declared check sees the device this test names
    monkeypatch.setattr(device_module, "device_info_for", lambda dev: device)
    cache = LatentKVCache(4, 16, 512, 64, kv_cache_dtype=kv, model_dtype=torch.bfloat16, device=case_device())
    _, meta, ql, qr = _tiny()
    with pytest.raises(ValueError) as info:
        TritonMLABackend().forward_mqa(ql, qr, cache, meta, scale=0.1)
    assert str(info.value) == f"TRITON_MLA cannot run these inputs: {reason}"


def test_shared_input_checks_run_first():
    cache, meta, ql, qr = _tiny()
    with pytest.raises(ValueError, match="q_rope"):
        TritonMLABackend().forward_mqa(ql, qr[..., :32], cache, meta, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        TritonMLABackend().forward_mqa(ql, qr, cache, meta, scale=-1.0)


@pytest.mark.parametrize(
    "bad,exc", [(0, ValueError), (MAX_KV_SPLITS + 1, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_num_kv_splits_argument(bad, exc):
    with pytest.raises(exc, match="num_kv_splits"):
        TritonMLABackend(num_kv_splits=bad)


# ---- split heuristic -------------------------------------------------------------------------------------
def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 513)] == [1, 1, 2, 4, 4, 8, 1024]


def test_split_heuristic_by_length_and_occupancy():
    sms = 132
    # one long request, few heads: split by length (16384 // 512 = 32)
    assert choose_num_kv_splits(16384, 1, 16, sms) == 32
    # short context: one split, however small the batch
    assert choose_num_kv_splits(300, 1, 16, sms) == 1
    # a batch that already fills the GPU (256 tokens x 4 head blocks of 32) is not split
    assert choose_num_kv_splits(16384, 256, 128, sms) == 1
    # in between: enough splits for ~4 programs per SM, a power of two
    s = choose_num_kv_splits(4096, 64, 128, sms)
    assert s == 4 and 64 * 4 * s >= 4 * sms and 64 * 4 * (s // 2) < 4 * sms
    # never above the cap
    assert choose_num_kv_splits(10**7, 1, 1, 10**4) == MAX_KV_SPLITS


def test_heads_per_program():
    assert [block_h_for(h) for h in (1, 5, 16, 17, 20, 64, 128)] == [16, 16, 16, 32, 32, 32, 32]
    # the occupancy term counts head blocks of the chosen width: 2 tokens x 4 blocks of 32 heads = 8 programs,
    # so 4 * 8 SMs / 8 = 4 splits (blocks of 16 heads would make 16 programs and 2 splits)
    assert choose_num_kv_splits(8192, 2, 128, 8) == 4
