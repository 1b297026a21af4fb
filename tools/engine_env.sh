# Shared by tools/vllm_env.sh and tools/sglang_env.sh (sourced, not run): the steps of an engine's environment.
# Expects PYTHON and TORCH_SPEC; sets PY.

# engine_env_start VENV ENGINE_SPEC: a fresh venv at VENV, pip upgraded, torch ($TORCH_SPEC, the CPU build) first,
# then ENGINE_SPEC without its dependencies (they would pull a CUDA torch)
engine_env_start() {
    rm -rf "$1"
    "$PYTHON" -m venv "$1"
    PY="$1/bin/python"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$TORCH_SPEC"
    "$PY" -m pip install -q --no-deps "$2"
}

# engine_env_requirements DIST REQS NAME...: DIST's Requires-Dist lines minus extras and the NAMEs, written to
# REQS and installed
engine_env_requirements() {
    local dist="$1" reqs="$2"
    shift 2
    "$PY" tools/requires_without.py "$dist" "$reqs" "$@"
    "$PY" -m pip install -q -r "$reqs"
}

# engine_env_done VENV STAMP MODULES...: import the MODULEs, print versions, leave STAMP and the build's time
engine_env_done() {
    local venv="$1" stamp="$2"
    shift 2
    "$PY" -m pip check || true
    # CPU_FUSED's kernel for this environment's torch (a cache hit when .venv has the same torch and Python)
    "$PY" -m mla_backends build || echo "CPU_FUSED not built (above: why); REF_TORCH serves the CPU"
    "$PY" -c "import importlib, sys; print(' '.join(f'{m} {getattr(importlib.import_module(m), \"__version__\", \"?\")}' for m in sys.argv[1:]))" "$@"
    touch "$venv/$stamp"
    echo "built $venv in $(( $(date +%s) - start )) s, size $(du -sh "$venv" | cut -f1)"
}
