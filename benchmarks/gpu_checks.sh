#!/usr/bin/env bash
# Every GPU check of the project in one run, on a GPU machine as it is: `python3` with torch and Triton, this
# checkout on PYTHONPATH, no download, no network. About 7 minutes on an H100/H200; each step has a time cap
# (at most ~575 s in all).
#
#   bash benchmarks/gpu_checks.sh [--label LABEL] [--gpu NAME] OUTDIR   # run; everything lands in OUTDIR
#   bash benchmarks/gpu_checks.sh --dry-run [OUTDIR]                    # CPU: list tests and points, estimate
#
# Steps: nvidia-smi and versions; the GPU test files (pytest, JUnit XML); the decode benchmark (roofline
# records); issue 16's Triton targets (rows vs heads kernel, 1- vs 4-token queries); the results file
# OUTDIR/<gpu>-<yyyy-mm-dd>-<label>.json (copy it to benchmarks/results/ and run
# python benchmarks/gpu_readme.py). Absent optional pieces (FlashInfer) are reported, not failures.
# PYTHON overrides the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; LABEL=checks; GPU=""; OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --label) LABEL=${2:?--label needs a value}; shift ;;
    --gpu) GPU=${2:?--gpu needs a value}; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "gpu_checks.sh: unknown option $1; supported --dry-run, --label L, --gpu NAME, OUTDIR" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"

TEST_FILES=(tests/test_case_device.py tests/test_gpus.py tests/test_selector_device.py tests/test_triton_backend.py
            tests/test_triton_compile.py tests/test_triton_mla.py tests/test_conformance_ref.py
            tests/test_conformance_triton.py tests/test_sparse_layer.py tests/test_flashinfer_gpu.py
            tests/test_conformance_flashinfer.py tests/test_prefill_gpu.py)
TESTS_CAP_S=300   # the pytest step is killed after this
BENCH_CAP_S=130   # the benchmark stops starting new points after this (and is killed at +60 s)
TARGETS_CAP_S=40  # issue 16's targets (bench_triton_targets.py): the same, killed at +20 s
# worst case by the caps: tests 310 s + benchmark 190 s + targets 60 s + checks ~15 s = ~575 s
BENCH_ARGS=(--batch 1,8,64,128 --context 1k,4k,16k --heads 16,128 --kv-dtypes bfloat16,fp8_e4m3
            --backends TRITON_MLA,FLASHINFER_MLA,FLASHINFER_MLA_TRTLLM,FLASHINFER_MLA_CUTLASS,FLASHINFER_MLA_XQA
            --warmup 3 --iters 10 --max-seconds "$BENCH_CAP_S")

if [ "$DRY" = 1 ]; then
  echo "gpu_checks.sh --dry-run: interpreter $PY; output would go to $OUT/"
  echo "== test files (collected here; each test estimated at 1 s on the GPU, compiles included)"
  total=0
  collected=$("$PY" -m pytest --collect-only -q -p no:cacheprovider "${TEST_FILES[@]}" 2>/dev/null)
  for f in "${TEST_FILES[@]}"; do
    n=$(grep -c "^$f::" <<< "$collected")
    total=$((total + n))
    printf '  %-40s %4d tests  ~%4d s\n' "$f" "$n" "$n"
  done
  est_tests=$(( total < TESTS_CAP_S ? total : TESTS_CAP_S ))
  echo "  total $total tests, ~${est_tests} s (capped at ${TESTS_CAP_S} s)"
  echo "== benchmark points (bench_decode_gpu.py --dry-run --gpu ${GPU:-h200})"
  "$PY" benchmarks/bench_decode_gpu.py --dry-run --gpu "${GPU:-h200}" "${BENCH_ARGS[@]}" \
      --json "$OUT/bench_decode_gpu.dry-run.json" | tee "$OUT/bench_decode_gpu.dry-run.log"
  est_bench=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(int(min(d['estimate_s'] or 0, $BENCH_CAP_S)))" \
      "$OUT/bench_decode_gpu.dry-run.json")
  echo "== issue 16 target points (bench_triton_targets.py --dry-run --gpu ${GPU:-h200}), capped at ${TARGETS_CAP_S} s"
  "$PY" benchmarks/bench_triton_targets.py --dry-run --gpu "${GPU:-h200}" --json "$OUT/bench_triton_targets.dry-run.json" \
      > "$OUT/bench_triton_targets.dry-run.log"
  head -n 1 "$OUT/bench_triton_targets.dry-run.log"
  est_targets=$TARGETS_CAP_S
  echo "== estimate: machine checks ~10 s + tests ~${est_tests} s + benchmark ~${est_bench} s + targets ~${est_targets} s = ~$((10 + est_tests + est_bench + est_targets)) s (limit 480 s)"
  exit 0
fi

declare -a SUMMARY=()
step() {  # step NAME LOGFILE CMD...: run, log, record rc and seconds
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-12s rc=%-4s %5ds  %s' "$name" "$rc" $((SECONDS - t0)) "$OUT/$log")")
  return $rc
}

step nvidia-smi nvidia-smi.log nvidia-smi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" \
  || { cat "$OUT/nvidia-smi.log"; exit 2; }
step versions versions.json "$PY" -c "import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_results; print(json.dumps(gpu_results.versions(), indent=2))"
cat "$OUT/versions.json"
ABSENT=()
"$PY" -c "import flashinfer" > /dev/null 2>&1 || ABSENT+=(flashinfer)
[ ${#ABSENT[@]} -gt 0 ] && echo "absent optional pieces: ${ABSENT[*]} (their tests skip; their benchmark points are recorded as skipped)"

TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" > /dev/null 2>&1 && TIMEOUT_ARGS=(--timeout=120)
step tests gpu-tests.log timeout -k 10 "$TESTS_CAP_S" "$PY" -m pytest -q -rs -p no:cacheprovider "${TIMEOUT_ARGS[@]}" \
  --junitxml="$OUT/gpu-tests.xml" "${TEST_FILES[@]}"
tail -n 25 "$OUT/gpu-tests.log"
GPU_ARGS=(); [ -n "$GPU" ] && GPU_ARGS=(--gpu "$GPU")
step bench bench_decode_gpu.log timeout -k 10 $((BENCH_CAP_S + 60)) "$PY" benchmarks/bench_decode_gpu.py \
  "${BENCH_ARGS[@]}" "${GPU_ARGS[@]}" --json "$OUT/bench_decode_gpu.json"
tail -n 30 "$OUT/bench_decode_gpu.log"
step targets bench_triton_targets.log timeout -k 5 $((TARGETS_CAP_S + 20)) "$PY" benchmarks/bench_triton_targets.py \
  "${GPU_ARGS[@]}" --max-seconds "$TARGETS_CAP_S" --json "$OUT/bench_triton_targets.json"
tail -n 8 "$OUT/bench_triton_targets.log"
ABSENT_ARGS=(); for a in "${ABSENT[@]}"; do ABSENT_ARGS+=(--absent "$a"); done
step results results.log "$PY" benchmarks/gpu_results.py --outdir "$OUT" --label "$LABEL" \
  --bench "$OUT/bench_decode_gpu.json" --junit "$OUT/gpu-tests.xml" --targets "$OUT/bench_triton_targets.json" \
  "${ABSENT_ARGS[@]}"

echo
echo "== summary ($OUT/)"
printf '%s\n' "${SUMMARY[@]}"
echo "absent: ${ABSENT[*]:-none}; results file: $(tail -n 1 "$OUT/results.log")"
bad=0
for line in "${SUMMARY[@]}"; do case "$line" in *"rc=0 "*) ;; *) bad=1 ;; esac; done
exit $bad
