"""DeepSeek-V4 decode error of ``fp8_ds_mla`` records (584-byte rows) against bf16 rows, both against float64.

    python benchmarks/v4_fp8_records_error.py [--json FILE]

One V4 decode call of ``forward_mqa`` (REF_TORCH; TRITON_MLA reads the same bytes) at V4-Flash's row width
(512: 448 fp8 + 64 bf16), 16 heads, 8 requests of 300 cached tokens, window 128 over 64-token pages, 32 picked
compressed entries of 64, per-head sinks, scale ``512 ** -0.5``. Rows and queries have unit RMS (as V4's
RMSNorm leaves them), drawn plainly and, in a second case, with 22 of the 448 plain channels ten times larger
(outlier channels). The same rows are stored as float64, as bf16 rows and as fp8 records; bf16 queries for the
last two. Printed and written: the output's relative error ``||o - o64|| / ||o64||`` (Frobenius) and
``max |o - o64| / max |o64|`` for bf16 rows and for records, per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

H, REQUESTS, CONTEXT, WIDTH, PAGE, WINDOW, ENTRIES, PICKS = 16, 8, 300, 512, 64, 128, 64, 32


def _rows(n: int, outliers: bool, g):
    import torch

    x = torch.randn(n, WIDTH, generator=g, dtype=torch.float64)
    if outliers:
        x[:, torch.randperm(448, generator=g)[:22]] *= 10
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def measure(outliers: bool, seed: int = 0) -> dict[str, float]:
    """Relative errors of bf16 rows and of fp8 records against float64, for one case."""
    import torch

    from mla_backends import BatchMetadata, LatentKVCache, RefTorchBackend
    from mla_backends.backends.v4_inputs import CompressedKeys
    from mla_backends.step.records import RecordCache

    g = torch.Generator().manual_seed(seed)
    seq = CONTEXT + 1
    pages = -(-seq // PAGE)
    table = torch.stack([torch.arange(pages) + i * pages for i in range(REQUESTS)]).to(torch.int32)
    meta = BatchMetadata.build([1] * REQUESTS, [CONTEXT] * REQUESTS, table, PAGE)
    rows = [_rows(seq, outliers, g) for _ in range(REQUESTS)]
    entries = [_rows(ENTRIES, outliers, g) for _ in range(REQUESTS)]
    q = torch.randn(REQUESTS, H, WIDTH, generator=g, dtype=torch.float64)
    q = q / q.pow(2).mean(-1, keepdim=True).sqrt()
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    picks = torch.stack([torch.randperm(ENTRIES, generator=g)[:PICKS] for _ in range(REQUESTS)])
    ctable = torch.arange(REQUESTS, dtype=torch.int32)[:, None]
    outs = {}
    for name in ("float64", "bfloat16", "fp8_ds_mla"):
        dt = torch.float64 if name == "float64" else torch.bfloat16
        if name == "fp8_ds_mla":
            cache, ccache = RecordCache(REQUESTS * pages, PAGE, WIDTH, 0), RecordCache(REQUESTS, ENTRIES, WIDTH, 0)
        else:
            cache = LatentKVCache(REQUESTS * pages, PAGE, WIDTH, 0, model_dtype=dt)
            ccache = LatentKVCache(REQUESTS, ENTRIES, WIDTH, 0, model_dtype=dt)
        for b in range(REQUESTS):
            slots = torch.arange(seq) + b * pages * PAGE
            cache.write(rows[b].to(dt), rows[b][:, :0].to(dt), slots)
            ccache.write(entries[b].to(dt), entries[b][:, :0].to(dt), torch.arange(ENTRIES) + b * ENTRIES)
        qq = q.to(dt)
        out, _ = RefTorchBackend().forward_mqa(
            qq, qq[..., :0], cache, meta, scale=WIDTH ** -0.5, sinks=sinks.to(torch.float64 if dt == torch.float64
                                                                                else torch.float32),
            window=WINDOW, compressed=CompressedKeys(ccache, ctable, picks))
        outs[name] = out.double()
    ref = outs["float64"]
    res = {}
    for name in ("bfloat16", "fp8_ds_mla"):
        d = outs[name] - ref
        res[f"{name}_frobenius"] = float(d.norm() / ref.norm())
        res[f"{name}_max"] = float(d.abs().max() / ref.abs().max())
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = p.parse_args(argv)
    doc = {"shape": {"heads": H, "requests": REQUESTS, "context": CONTEXT, "width": WIDTH, "page": PAGE,
                     "window": WINDOW, "entries": ENTRIES, "picks": PICKS},
           "cases": {name: measure(outliers) for name, outliers in (("plain", False), ("outlier_channels", True))}}
    for name, res in doc["cases"].items():
        print(f"{name:17s} bf16 rows {res['bfloat16_frobenius']:.2e} (max {res['bfloat16_max']:.2e})   fp8 records "
              f"{res['fp8_ds_mla_frobenius']:.2e} (max {res['fp8_ds_mla_max']:.2e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
