#!/usr/bin/env bash
# Every GPU check of the project in one run, for a machine with a CUDA device (about 10 minutes on an H100/H200).
# Usage: bash benchmarks/gpu_checks.sh [OUTDIR]    (after `make install`, or with PYTHON pointing at a ready env)
# Writes OUTDIR/gpu-tests.log, OUTDIR/bench_decode_gpu.json and OUTDIR/bench_decode_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-results}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 2
export PYTHONUNBUFFERED=1
# 1. numerics and conformance on the GPU (the CPU-only cases run too; GPU ones no longer skip)
"$PY" -m pytest -q -rs tests/test_triton_mla.py tests/test_conformance_triton.py tests/test_conformance_ref.py \
    tests/test_flashinfer_gpu.py tests/test_conformance_flashinfer.py tests/test_selector_device.py \
    tests/test_sparse_layer.py \
    2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
# 2. decode benchmark of every backend that runs here (GB/s, TFLOP/s, fraction of peak HBM bandwidth)
"$PY" benchmarks/bench_decode_gpu.py --output "$OUT/bench_decode_gpu.json" 2>&1 | tee "$OUT/bench_decode_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc; results in $OUT/"
exit $(( tests_rc != 0 || bench_rc != 0 ))
