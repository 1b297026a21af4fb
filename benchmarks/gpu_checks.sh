#!/usr/bin/env bash
# Every GPU check of the project in one run, on a GPU machine as it is: `python3` with torch and Triton, this
# checkout on PYTHONPATH, no download, no network. Each step has a time cap; the caps add up to at most
# ~325 s, so a second run fits in a 15-minute device budget.
#
#   bash benchmarks/gpu_checks.sh --commit SHA [--label LABEL] [--gpu NAME] OUTDIR   # run
#   bash benchmarks/gpu_checks.sh --dry-run [OUTDIR]          # CPU: tests, points, time estimate, files
#
# Launch (the git directory does not travel to a device machine, so the commit is passed on):
#   bash benchmarks/gpu_checks.sh --commit "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" "$OUT"
# Without --commit the checkout's `git rev-parse HEAD` is used; with neither the run refuses to start.
#
# Steps: nvidia-smi and versions; the GPU test files (pytest, JUnit XML; stopped with SIGINT at its cap so
# that pytest still writes the report); the decode benchmark; issue 16's Triton targets; the results file.
# OUTDIR receives 3 files (a device returns at most 8): the results file <gpu>-<yyyy-mm-dd>-<label>.json
# (copy it to benchmarks/results/ and run python benchmarks/gpu_readme.py), gpu-checks.log (this console
# output) and gpu-run.tar.gz (every step's log, JUnit XML and JSON; repacked after each step, so a run cut
# short keeps what finished). Absent optional pieces (FlashInfer) are reported, not failures.
# PYTHON overrides the interpreter (default python3). For tests (tests/test_gpu_checks_run.py):
# GPU_CHECKS_TEST_FILES (space-separated) replaces the test list, GPU_CHECKS_{TESTS,BENCH,TARGETS}_CAP_S the
# caps, GPU_CHECKS_TESTS_KILL_S the test step's grace after SIGINT, GPU_CHECKS_BENCH_ARGS the grid arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; LABEL=checks; GPU=""; OUT=""; COMMIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --label) LABEL=${2:?--label needs a value}; shift ;;
    --gpu) GPU=${2:?--gpu needs a value}; shift ;;
    --commit) COMMIT=${2:?--commit needs a value}; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "gpu_checks.sh: unknown option $1; supported --dry-run, --commit SHA, --label L, --gpu NAME, OUTDIR" >&2
        exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# the GPU test files, most telling first (a cut test step loses the last ones)
TEST_FILES=(tests/test_case_device.py tests/test_triton_rows.py tests/test_triton_mla.py tests/test_decode_graph.py
            tests/test_triton_backend.py tests/test_conformance_triton.py tests/test_selector_device.py
            tests/test_sparse_layer.py tests/test_prefill_gpu.py tests/test_conformance_ref.py tests/test_gpus.py
            tests/test_flashinfer_gpu.py tests/test_conformance_flashinfer.py)
# test files left out of the GPU run, "file: reason" (tests/test_gpu_checks_run.py: every file with a CUDA-only
# test is in TEST_FILES or here)
LEFT_OUT=("tests/test_triton_compile.py: CPU-only compile reports (minutes of compiles, no GPU used); CI runs them")
[ -n "${GPU_CHECKS_TEST_FILES:-}" ] && read -r -a TEST_FILES <<< "$GPU_CHECKS_TEST_FILES"
TESTS_CAP_S=${GPU_CHECKS_TESTS_CAP_S:-110}      # SIGINT after this (pytest writes its JUnit XML), KILL 30 s later
BENCH_CAP_S=${GPU_CHECKS_BENCH_CAP_S:-60}       # the benchmark starts no point after this; killed at +20 s
TARGETS_CAP_S=${GPU_CHECKS_TARGETS_CAP_S:-75}   # issue 16's targets: the same; killed at +15 s (~90 s step)
TESTS_KILL_S=${GPU_CHECKS_TESTS_KILL_S:-30}; BENCH_KILL_S=20; TARGETS_KILL_S=15
CHECKS_S=15                                     # nvidia-smi, versions, the results file (python + torch starts)
# worst case by the caps: 15 + 140 + 80 + 90 = 325 s (pytest writes its report at the SIGINT; the 30 s are
# for its summary and exit)
if [ -n "${GPU_CHECKS_BENCH_ARGS:-}" ]; then
  read -r -a BENCH_ARGS <<< "$GPU_CHECKS_BENCH_ARGS"
else
  BENCH_ARGS=(--batch 1,8,64,128 --context 1k,4k,16k --heads 16,128 --kv-dtypes bfloat16,fp8_e4m3
              --backends TRITON_MLA,FLASHINFER_MLA,FLASHINFER_MLA_TRTLLM,FLASHINFER_MLA_CUTLASS,FLASHINFER_MLA_XQA
              --warmup 3 --iters 10)
fi
BENCH_ARGS+=(--max-seconds "$BENCH_CAP_S")
SUMMARY_LOG=gpu-checks.log; TARBALL=gpu-run.tar.gz
results_name() {  # results_name GPU: the results file's name for today
  "$PY" -c "import sys, datetime; sys.path.insert(0, 'benchmarks'); import gpu_results as g; \
print(g.results_name(sys.argv[1], datetime.date.today().isoformat(), sys.argv[2]))" "$1" "$LABEL"
}
if [ -n "$COMMIT" ] && ! [[ "$COMMIT" =~ ^[0-9a-f]{7,40}(-dirty)?$ ]]; then
  echo "gpu_checks.sh: --commit: got '$COMMIT'; supported 7-40 lowercase hex digits, optionally -dirty" >&2
  exit 2
fi
mkdir -p "$OUT"

if [ "$DRY" = 1 ]; then
  echo "gpu_checks.sh --dry-run: interpreter $PY; output would go to $OUT/"
  echo "== test files (collected here; modelled GPU time: benchmarks/gpu_estimate.py)"
  "$PY" -m pytest --collect-only -q -p no:cacheprovider "${TEST_FILES[@]}" > "$OUT/collected.txt" 2>/dev/null
  "$PY" benchmarks/gpu_estimate.py --collected "$OUT/collected.txt" --cap "$TESTS_CAP_S" "${TEST_FILES[@]}" \
    > "$OUT/tests-estimate.txt"
  grep -v '^total ' "$OUT/tests-estimate.txt"
  model_tests=$(sed -n 's/^total //p' "$OUT/tests-estimate.txt")
  est_tests=$(( model_tests < TESTS_CAP_S ? model_tests : TESTS_CAP_S ))
  echo "  total $(grep -c '::' "$OUT/collected.txt") tests, modelled ~${model_tests} s, ~${est_tests} s with the ${TESTS_CAP_S} s cap"
  for f in "${LEFT_OUT[@]}"; do echo "  left out: $f"; done
  echo "== benchmark points (bench_decode_gpu.py --dry-run --gpu ${GPU:-h200})"
  "$PY" benchmarks/bench_decode_gpu.py --dry-run --gpu "${GPU:-h200}" "${BENCH_ARGS[@]}" \
      --json "$OUT/bench_decode_gpu.dry-run.json" | tee "$OUT/bench_decode_gpu.dry-run.log"
  est_bench=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(int(min(d['estimate_s'] or 0, $BENCH_CAP_S + $BENCH_KILL_S)))" \
      "$OUT/bench_decode_gpu.dry-run.json")
  echo "== issue 16 target points (bench_triton_targets.py --dry-run --gpu ${GPU:-h200}), capped at ${TARGETS_CAP_S} s + ${TARGETS_KILL_S} s"
  "$PY" benchmarks/bench_triton_targets.py --dry-run --gpu "${GPU:-h200}" --json "$OUT/bench_triton_targets.dry-run.json" \
      > "$OUT/bench_triton_targets.dry-run.log"
  head -n 1 "$OUT/bench_triton_targets.dry-run.log"
  est_targets=$((TARGETS_CAP_S + TARGETS_KILL_S))
  echo "== estimate: checks ~${CHECKS_S} s + tests ~${est_tests} s + benchmark ~${est_bench} s + targets ~${est_targets} s = ~$((CHECKS_S + est_tests + est_bench + est_targets)) s (limit 330 s)"
  echo "returns: 3 files (limit 8): $(results_name "${GPU:-h200}") $SUMMARY_LOG $TARBALL"
  exit 0
fi

if [ -z "$COMMIT" ]; then
  COMMIT=$(git rev-parse HEAD 2>/dev/null)
  if [ -z "$COMMIT" ]; then
    echo "gpu_checks.sh: no commit: pass --commit SHA (the git directory does not travel to a device machine):" >&2
    echo "  bash benchmarks/gpu_checks.sh --commit \"\$(git rev-parse HEAD)\" OUTDIR" >&2
    exit 2
  fi
  git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT-dirty"
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-checks.XXXXXX")  # every step's files; OUT gets them packed
exec > >(tee "$OUT/$SUMMARY_LOG") 2>&1
TEE_PID=$!
echo "gpu_checks.sh: commit $COMMIT; steps' files in $WORK, packed into $OUT/$TARBALL after each step"
pack() {  # the tarball of everything so far, replaced whole
  tar -czf "$OUT/$TARBALL.part" -C "$WORK" . && mv -f "$OUT/$TARBALL.part" "$OUT/$TARBALL"
}
finish() {  # finish RC: the summary, then close the log
  echo
  echo "== summary ($OUT/: $(cd "$OUT" && ls | tr '\n' ' '))"
  printf '%s\n' "${SUMMARY[@]}"
  rm -rf "$WORK"
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$1"
}
declare -a SUMMARY=()
step() {  # step NAME LOGFILE CMD...: run, log, record rc and seconds, repack
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" > "$WORK/$log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-12s rc=%-4s %5ds  %s' "$name" "$rc" $((SECONDS - t0)) "$log")")
  pack
  return $rc
}

step nvidia-smi nvidia-smi.log nvidia-smi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" \
  || { cat "$WORK/nvidia-smi.log"; finish 2; }
step versions versions.json "$PY" benchmarks/gpu_results.py --versions-only --commit "$COMMIT"
cat "$WORK/versions.json"
ABSENT=()
"$PY" -c "import flashinfer" > /dev/null 2>&1 || ABSENT+=(flashinfer)
[ ${#ABSENT[@]} -gt 0 ] && echo "absent optional pieces: ${ABSENT[*]} (their tests skip; their benchmark points are recorded as skipped)"

TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" > /dev/null 2>&1 && TIMEOUT_ARGS=(--timeout=120)
for f in "${LEFT_OUT[@]}"; do echo "left out of the tests: $f"; done
# pytest through a line that restores Python's SIGINT handler: a shell that starts a job in the background
# leaves SIGINT ignored in it (and no shell can undo that), and then the cap's SIGINT would do nothing
PYTEST=("$PY" -c 'import signal; signal.signal(signal.SIGINT, signal.default_int_handler); import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))')
step tests gpu-tests.log timeout -s INT -k "$TESTS_KILL_S" "$TESTS_CAP_S" "${PYTEST[@]}" -q -rs -p no:cacheprovider \
  "${TIMEOUT_ARGS[@]}" --junitxml="$WORK/gpu-tests.xml" "${TEST_FILES[@]}"
tail -n 25 "$WORK/gpu-tests.log"
GPU_ARGS=(); [ -n "$GPU" ] && GPU_ARGS=(--gpu "$GPU")
step bench bench_decode_gpu.log timeout -k 5 $((BENCH_CAP_S + BENCH_KILL_S)) "$PY" benchmarks/bench_decode_gpu.py \
  "${BENCH_ARGS[@]}" "${GPU_ARGS[@]}" --json "$WORK/bench_decode_gpu.json"
tail -n 30 "$WORK/bench_decode_gpu.log"
step targets bench_triton_targets.log timeout -k 5 $((TARGETS_CAP_S + TARGETS_KILL_S)) "$PY" \
  benchmarks/bench_triton_targets.py "${GPU_ARGS[@]}" --max-seconds "$TARGETS_CAP_S" --json "$WORK/bench_triton_targets.json"
tail -n 8 "$WORK/bench_triton_targets.log"
ABSENT_ARGS=(); for a in "${ABSENT[@]}"; do ABSENT_ARGS+=(--absent "$a"); done
step results results.log "$PY" benchmarks/gpu_results.py --outdir "$OUT" --label "$LABEL" --commit "$COMMIT" \
  --bench "$WORK/bench_decode_gpu.json" --junit "$WORK/gpu-tests.xml" --targets "$WORK/bench_triton_targets.json" \
  "${ABSENT_ARGS[@]}"
echo "absent: ${ABSENT[*]:-none}; results file: $(tail -n 1 "$WORK/results.log")"
bad=0
for line in "${SUMMARY[@]}"; do case "$line" in *"rc=0 "*) ;; *) bad=1 ;; esac; done
finish $bad
