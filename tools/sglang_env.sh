#!/usr/bin/env bash
# Build .venv-sglang: sglang 0.5.23 on torch 2.13.0 (CPU), the sgl_kernel stand-in (a test fixture), mla-backends
# editable, and what tests/sglang_engine needs.
# Usage: tools/sglang_env.sh [VENV_DIR] (default .venv-sglang), run from the repository root; `make sglang-env`
# calls it. The recipe (docs/integrations.md, "SGLang"): torch first (CPU), then sglang without its dependencies,
# then its Requires-Dist lines minus extras, torch, the media packages (the index's torchvision, torchaudio and
# torchcodec are CUDA builds that fail to load against CPU torch) and the CUDA-only kernel packages (no CPU build
# of any is published; SGLang's CPU engine imports a handful of names from sgl_kernel, which the stand-in under
# tests/sglang_engine/stand_in provides, and calls none of them for the models the tests run).
# sglang 0.5.23 pins torch==2.14.1; its only build on this machine's index is a multi-GB CUDA one, and 2.13.0
# (the CPU build vLLM's environment uses) runs SGLang's CPU engine for these models: the pin is overridden.
set -euo pipefail
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
start=$(date +%s)
# shellcheck source=tools/engine_env.sh
. "$(dirname "$0")/engine_env.sh"
engine_env_start "$VENV" "$SGLANG_SPEC"
# torch and its media packages (CUDA builds on the index), then every CUDA-only kernel or toolkit package, then
# what only those, the multimodal models or the profiler use (timm needs torchvision)
engine_env_requirements sglang "$VENV/sglang-requirements.txt" torch torchvision torchaudio torchcodec \
    sglang-kernel sgl-kernel flashinfer-python flash-attn-4 humming-kernels nvidia-cutlass-dsl nvidia-mathdx \
    nvshmem4py-cu13 cuda-python quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla tilelang torch-memory-saver \
    apache-tvm-ffi timm av decord2 py-spy deepseek-recipe tml-renderers kernels
# the stand-in for SGLang's CUDA-only kernel package (only here: never in .venv, never shipped), mla-backends
# itself (no extras: they would move transformers past SGLang's pin) and the test tools
"$PY" -m pip install -q --no-deps --no-build-isolation tests/sglang_engine/stand_in
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q pytest safetensors
engine_env_done "$VENV" .sglang-env-built torch sglang transformers sgl_kernel mla_backends
