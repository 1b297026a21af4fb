"""Count the device-to-host syncs of one decode step of a 3-layer model (CPU, REF_TORCH).

The count comes from :func:`mla_backends.core.host_sync.no_host_sync` in counting mode, loaded from this checkout
by file path, so the same script also counts an older checkout's code (``PYTHONPATH=/path/to/old python
benchmarks/count_host_syncs.py``): the guard sees operations, not devices, so CPU counts are what a GPU
would sync on. ``BatchMetadata.build`` runs outside the count (it is where host work belongs).

Prints the syncs of the whole step and those outside the backend's ``forward_mqa``, with their operations.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
from collections import Counter

import torch

GUARD_PATH = pathlib.Path(__file__).resolve().parents[1] / "mla_backends" / "host_sync.py"


def load_guard():
    spec = importlib.util.spec_from_file_location("_count_host_sync_guard", GUARD_PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=40)
    args = ap.parse_args(argv)
    guard = load_guard()
    from mla_backends.core.dims import MLADims
    from mla_backends.layer.attention import MLAAttention
    from mla_backends.loading.hf import random_hf_state_dict
    from mla_backends.step.metadata import BatchMetadata
    from mla_backends.step.plan import plan_step

    torch.manual_seed(0)
    dims = MLADims.deepseek_v2_lite()
    bs, B, S = 16, args.batch, args.context
    pages = -(-(S + 2) // bs)
    layers, caches = [], []
    for i in range(args.layers):
        layer = MLAAttention(dims, backend="REF_TORCH", dtype=torch.float32, layer_idx=i)
        layer.load_hf_state_dict(random_hf_state_dict(dims, dtype=torch.float32))
        layers.append(layer)
        caches.append(layer.allocate_cache(B * pages + 1, bs))
    bt = torch.randperm(B * pages + 1)[: B * pages].view(B, pages).int()

    def step(q: list[int], c: list[int], counted: bool):
        meta = BatchMetadata.build(q, c, bt, bs)
        plan = plan_step(meta, layers)  # once per step, before the first layer (outside the guard)
        x = torch.randn(sum(q), dims.hidden_size)
        if not counted:
            for layer, cache in zip(layers, caches, strict=True):
                x = layer(x, None, cache, plan)
            return None
        inside: list[str] = []
        with guard.no_host_sync(count=True) as rec:
            for layer, cache in zip(layers, caches, strict=True):
                original = layer.backend.forward_mqa

                def wrapped(*a, _orig=original, _rec=rec, **k):
                    n0 = _rec.count
                    try:
                        return _orig(*a, **k)
                    finally:
                        inside.extend(_rec.ops[n0:])

                layer.backend.forward_mqa = wrapped
                try:
                    x = layer(x, None, cache, plan)
                finally:
                    del layer.backend.forward_mqa
        return rec, inside

    with torch.inference_mode():
        step([S] * B, [0] * B, counted=False)  # prefill fills the caches
        rec, inside = step([1] * B, [S] * B, counted=True)
    outside = rec.count - len(inside)
    print(f"one decode step, {args.layers} layers, batch {B}, context {S} (REF_TORCH, CPU): "
          f"{rec.count} host syncs, {outside} outside forward_mqa, {len(inside)} inside")
    for op, n in sorted(Counter(rec.ops).items()):
        print(f"  {n:3d} x {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
