"""Selector overhead: import + first ``select_backend()`` on top of ``import torch``, and a cached call.

Targets (issue 4): under 100 ms added by ``import mla_backends`` + the first selection (no triton or
flashinfer import), under 20 microseconds for a cached selection.

    .venv/bin/python benchmarks/bench_select.py [--repeats 5]

Each cold measurement runs in a fresh interpreter: it imports torch first (not counted), then times
``import mla_backends`` and the first ``select_backend()`` (which loads the registry and entry-point plugins).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import timeit

_COLD = r"""
import json, sys, time
import torch
t0 = time.perf_counter()
import mla_backends
t1 = time.perf_counter()
sel = mla_backends.select_backend("deepseek-v3", device=DEVICE)
t2 = time.perf_counter()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "flashinfer"))
print(json.dumps({"import": t1 - t0, "first_select": t2 - t1, "heavy": heavy, "backend": sel.name}))
"""


def cold(device: str, autoload: bool) -> dict:
    import os

    env = dict(os.environ)
    if not autoload:
        env["MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    code = _COLD.replace("DEVICE", repr(device))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set, so every fresh interpreter recompiles the sources and the "
              "cold figures below include compilation (about 2x); unset it for installed-package figures")
    print("cold: import mla_backends + first select_backend(), after import torch (median of "
          f"{args.repeats} fresh interpreters)")
    for device, autoload in (("auto", True), ("sm100", True), ("sm100", False)):
        runs = [cold(device, autoload) for _ in range(args.repeats)]
        imp = statistics.median(r["import"] for r in runs) * 1e3
        first = statistics.median(r["first_select"] for r in runs) * 1e3
        heavy = sorted({m for r in runs for m in r["heavy"]})
        plugins = "on " if autoload else "off"
        print(f"  device={device:<6} plugins={plugins}  import {imp:6.1f} ms  first select "
              f"{first:6.1f} ms  total {imp + first:6.1f} ms = {(imp + first) / 100:.2f}x the 100 ms target  "
              f"-> {runs[0]['backend']}; triton/flashinfer imported: {heavy or 'none'}")

    from mla_backends import select_backend
    from mla_backends.core.dims import MLADims

    dims = MLADims.deepseek_v3().tensor_parallel(8)
    select_backend(dims, device="sm90", block_size=64)
    n = 20000
    for label, kwargs in (("simulated sm90, block 64", {"device": "sm90", "block_size": 64}),
                          ("probed device (auto)", {})):
        select_backend(dims, **kwargs)
        best = min(timeit.repeat(lambda kw=kwargs: select_backend(dims, **kw), number=n, repeat=5)) / n
        print(f"cached select_backend ({label}): {best * 1e6:.2f} us per call = {best * 1e6 / 20:.2f}x the "
              "20 us target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
