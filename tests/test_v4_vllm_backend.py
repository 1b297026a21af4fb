"""vLLM's DeepSeek-V4 ``forward_mqa`` on mla-backends (``VLLMV4Attention``, no vLLM imported): window-only, CSA
(the indexer's picks) and HCA (every visible entry) layers over vLLM-shaped pools (records or bf16 rows, each pool
with its own table and page) against the float64 reference of ``tests/v4_vllm_inputs.py``. The same checks on
vLLM's own metadata classes, and against vLLM's CPU op where it runs, are in ``tests/vllm_engine/test_vllm_v4.py``."""

from __future__ import annotations

import pytest
import torch
from v4_vllm_inputs import WINDOW, H, v4_vllm_step

from mla_backends.integrations.vllm.v4_backend import VLLMV4Attention


def _run(ratio, records, backend=None):
    inputs, ref = v4_vllm_step(ratio, records)
    q = inputs.pop("q")
    out = torch.full_like(q, 7.0)  # the padded head (index H) must stay untouched
    runner = VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=ratio, scale=512 ** -0.5, backend=backend,
                             kv_cache_dtype="fp8_ds_mla" if records else "auto")
    runner.forward(q, out, **inputs)
    return out, ref, runner


@pytest.mark.parametrize("records", [True, False])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_vllm_v4_forward_matches_the_float64_reference(ratio, records):
    out, ref, runner = _run(ratio, records)
    assert runner.backend.name == "REF_TORCH"
    assert (out[:, :H].double() - ref).abs().max() <= 4 * 2.0 ** -8 * ref.abs().max()
    assert bool((out[:, H] == 7.0).all())


def test_vllm_v4_forward_on_triton_mla_interpreted():
    out, ref, runner = _run(4, True, backend="TRITON_MLA")
    assert runner.backend.name == "TRITON_MLA"
    assert (out[:, :H].double() - ref).abs().max() <= 4 * 2.0 ** -8 * ref.abs().max()


def test_one_step_per_metadata_object_and_refusals():
    inputs, _ = v4_vllm_step(4, True)
    q = inputs.pop("q")
    runner = VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=4, scale=0.1)
    first = runner.step(inputs["swa_metadata"], q.shape[0])
    assert runner.step(inputs["swa_metadata"], q.shape[0]) is first  # every layer of the step shares it
    with pytest.raises(ValueError, match="compressed_metadata/compressed_cache: got None"):
        runner.forward(q, torch.empty_like(q), **{**inputs, "compressed_metadata": None})
    with pytest.raises(ValueError, match="q: got 3 tokens; supported the step's 7"):
        VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=4, scale=0.1).step(inputs["swa_metadata"], 3)
    with pytest.raises(ValueError, match="backend: got FLASHINFER_MLA, which cannot run vLLM's DeepSeek-V4"):
        VLLMV4Attention(num_heads=H, window=WINDOW, compress_ratio=4, scale=0.1, backend="FLASHINFER_MLA")
