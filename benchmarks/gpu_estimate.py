#!/usr/bin/env python
"""The test step's time on the GPU, for ``gpu_checks.sh --dry-run``: modelled per file from measured compiles.

    python benchmarks/gpu_estimate.py --collected FILE --cap 120 tests/test_a.py tests/test_b.py ...

``FILE`` is ``pytest --collect-only -q`` output (one test id a line). Each file costs its tests' run time
plus the Triton kernels it compiles; the step as a whole costs :data:`STARTUP_S` first (python, torch,
CUDA context, collection). Prints one line a file, in the order given (``<file> <n> tests <k> compiles ~<s>
s (by ~<t> s)``, ``t`` the step's time when the file ends), the file the cap cuts, and last ``total <s>``
(the modelled step, uncapped). Standard library only.

Where the figures come from:

* **compile seconds**: the median ``compile_cpu_s`` of the committed SM90a report for the device's Triton
  (``benchmarks/results/triton-compile-sm90a-3.6.0.json``), attention plus merge kernel (a test compiles
  both): CPU seconds measured here with a cold Triton cache, i.e. one core's work without waiting for a
  shared one (pytest compiles one kernel at a time, so the device's 16 cores do not shorten it).
* **compiles per file** (:data:`COMPILES`): modelled, by reading each file's cases: one compile a distinct
  (kernel, heads-per-program layout, dtypes, page size, split-count class), which are Triton's constexprs
  and specialisations; a case that repeats an earlier one's kernel costs none (Triton's cache).
* **run seconds per test** (:data:`RUN_S`): modelled: small cases on the GPU plus a float64 reference;
  files whose tests skip on the device image (no FlashInfer) cost almost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "results", "triton-compile-sm90a-3.6.0.json")
#: seconds before the first test runs: python + torch import, CUDA context, collecting the files
STARTUP_S = 20.0
#: modelled distinct Triton kernels each GPU test file compiles (attention + merge counted as one)
COMPILES = {
    "tests/test_triton_rows.py": 24,  # 6 cases (heads 16/20/64/96/128 x pages 1/16/64) + fp8_qk + quick matrix x2
    "tests/test_triton_mla.py": 26,  # pages 1/64/256, fp8 e4m3/e5m2, dims 256/160/96, dtypes, sparse, splits
    "tests/test_decode_graph.py": 1,  # one 2-layer step, captured
    "tests/test_triton_backend.py": 2,
    "tests/test_conformance_triton.py": 10,  # the quick matrix: dtypes x pages x query lengths
    "tests/test_sparse_layer.py": 2,
}
#: modelled seconds a test runs on the GPU beyond its compiles (default :data:`RUN_S_DEFAULT`)
RUN_S = {"tests/test_flashinfer_gpu.py": 0.02, "tests/test_conformance_flashinfer.py": 0.02,
         "tests/test_case_device.py": 0.05, "tests/test_gpus.py": 0.02, "tests/test_selector_device.py": 0.05}
RUN_S_DEFAULT = 0.3


def compile_seconds(report: str = REPORT) -> float:
    """Median ``compile_cpu_s`` (``compile_s`` in older reports) of the report's attention kernels plus that
    of its merge kernels."""
    with open(report) as f:
        configs = json.load(f)["configs"]
    key = "compile_cpu_s" if all("compile_cpu_s" in c for c in configs) else "compile_s"
    attn = [c[key] for c in configs if c["config"] != "merge"]
    merge = [c[key] for c in configs if c["config"] == "merge"]
    return statistics.median(attn) + (statistics.median(merge) if merge else 0.0)


def estimate(files: list[str], counts: dict[str, int], compile_s: float) -> list[tuple[str, int, int, float]]:
    """``[(file, tests, compiles, seconds)]`` in the order of ``files``."""
    return [(f, counts.get(f, 0), COMPILES.get(f, 0),
             counts.get(f, 0) * RUN_S.get(f, RUN_S_DEFAULT) + COMPILES.get(f, 0) * compile_s) for f in files]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collected", required=True, help="pytest --collect-only -q output")
    p.add_argument("--cap", type=float, required=True, help="the test step's time cap (s)")
    p.add_argument("--report", default=REPORT, help="the compile report giving compile_s")
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    counts: dict[str, int] = {}
    with open(args.collected) as f:
        for line in f:
            if "::" in line:
                name = line.split("::", 1)[0].strip()
                counts[name] = counts.get(name, 0) + 1
    cs = compile_seconds(args.report)
    t = STARTUP_S
    cut = None
    print(f"  (startup ~{STARTUP_S:.0f} s; a compile ~{cs:.1f} s, measured: {os.path.relpath(args.report, ROOT)})")
    for f, n, k, s in estimate(args.files, counts, cs):
        t += s
        if cut is None and t > args.cap:
            cut = f
        print(f"  {f:<40s} {n:4d} tests {k:3d} compiles ~{s:4.0f} s (by ~{t:4.0f} s)")
    print(f"  cut by the {args.cap:.0f} s cap: {cut or 'none'}" + (" and the files after it (SIGINT: the JUnit "
                                                               "report keeps what ran)" if cut else ""))
    print(f"total {t:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
