"""fp8 latent cache, whole layer: within the documented tolerance of the bf16-cache layer (docs/layer.md).

Documented tolerance (bf16 model, same weights and inputs, relative to the bf16-cache output):
fp8_e4m3: Frobenius error <= 3 %, max abs error <= 6 % of max |out|; fp8_e5m2: <= 5 % and <= 10 %.
(Measured on this schedule: e4m3 1.3 % / 2.5 %, e5m2 2.5 % / 4.4 %.)
"""

from __future__ import annotations

import pytest
import torch
from layer_cases import (
    hf_attention,
    run_schedule,
    scattered_block_tables,
    tiny_config,
)

from mla_backends.layer.attention import MLAAttention

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = {"fp8_e4m3": (0.03, 0.06), "fp8_e5m2": (0.05, 0.10)}
STEPS = [[40, 25, 3], [1, 1, 1], [1, 6, 1], [5, 1, 9]]


def _run(kv_cache_dtype: str, scale: float = 1.0) -> tuple[torch.Tensor, object]:
    cfg = tiny_config()
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.bfloat16)
    layer.load_hf_state_dict(hf_attention(cfg).state_dict())
    lengths = [sum(s[b] for s in STEPS) for b in range(3)]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 32, generator=g).to(torch.bfloat16) for n in lengths]
    bt, nb = scattered_block_tables(3, max(lengths), 4)
    cache = layer.allocate_cache(nb, 4, kv_cache_dtype, scale=scale)
    outs = run_schedule(layer, cache, bt, xs, STEPS)
    return torch.cat([torch.cat(o) for o in outs]).double(), cache


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_within_documented_tolerance(kv_cache_dtype):
    ref, _ = _run("auto")
    # a non-unit scale: reads that forgot to multiply it back would be 4x off
    got, cache = _run(kv_cache_dtype, scale=0.25)
    assert cache.is_fp8 and cache.data.element_size() == 1
    fro = ((got - ref).norm() / ref.norm()).item()
    mx = ((got - ref).abs().max() / ref.abs().max()).item()
    fro_tol, max_tol = TOLERANCE[kv_cache_dtype]
    assert 0 < fro <= fro_tol, f"Frobenius error {fro:.3%}"
    assert mx <= max_tol, f"max error {mx:.3%}"
