"""``benchmarks/gpu_checks.sh`` as a device run meets it: its test list, its output files, its cut steps.

The whole script runs here with CUDA faked (``tests/gpu_fake``: a ``sitecustomize.py`` on ``PYTHONPATH``
makes torch see one H200 and build "CUDA" tensors on the CPU, a stub ``nvidia-smi`` on ``PATH``; the caps and
the test list come from the script's ``GPU_CHECKS_*`` variables), with a test step cut short by its cap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
from bench_scripts import fake_h200, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_checks.sh")
FAKE = os.path.join(ROOT, "tests", "gpu_fake")
#: a test that needs CUDA: the ``gpu`` marker, a skip unless CUDA, or a skip saying it needs CUDA
CUDA_ONLY = re.compile(r"@pytest\.mark\.gpu\b|pytestmark\s*=[^\n]*\bmark\.gpu\b"
                       r"|skipif\(\s*not\s+[^,]*\b(?:cuda|CUDA)\b|pytest\.skip\(\s*f?[\"'][^\"']*needs a CUDA")


def _script_lists() -> tuple[list[str], dict[str, str]]:
    """``(TEST_FILES, {left-out file: reason})`` as the script declares them."""
    text = open(SCRIPT).read()
    files = text.split("TEST_FILES=(", 1)[1].split(")", 1)[0].split()
    left = re.findall(r'"([^":]+\.py): ([^"]+)"', text.split("LEFT_OUT=(", 1)[1].split(")\n", 1)[0])
    return files, dict(left)


def cuda_only_files() -> set[str]:
    """Every ``tests/test_*.py`` holding a CUDA-only test (:data:`CUDA_ONLY`)."""
    found = set()
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if name.startswith("test_") and name.endswith(".py"):
            if CUDA_ONLY.search(open(os.path.join(ROOT, "tests", name)).read()):
                found.add(f"tests/{name}")
    return found


def test_every_file_with_a_cuda_only_test_is_run_or_left_out_with_a_reason():
    files, left = _script_lists()
    found = cuda_only_files()
    # the detector sees the known ones (a regex that matched nothing would pass everything)
    assert {"tests/test_decode_graph.py", "tests/test_triton_mla.py", "tests/test_prefill_gpu.py"} <= found
    missing = sorted(f for f in found if f not in files and f not in left)
    assert not missing, f"CUDA-only tests in {missing}: add them to TEST_FILES or LEFT_OUT (with the reason)"
    assert {"tests/test_triton_rows.py", "tests/test_decode_graph.py"} <= set(files)
    assert "tests/test_triton_compile.py" in left and "tests/test_triton_compile.py" not in files
    for f, why in left.items():
        assert os.path.exists(os.path.join(ROOT, f)) and len(why) > 10 and f not in files, (f, why)
    assert len(set(files)) == len(files) and all(os.path.exists(os.path.join(ROOT, f)) for f in files)


def test_results_file_needs_a_commit(tmp_path, monkeypatch):
    results = load_benchmark("gpu_results")
    monkeypatch.setattr(results, "_version", lambda _module: "n/a")  # no imports of flashinfer & co.
    args = ["--outdir", str(tmp_path), "--bench", str(tmp_path / "b.json"), "--junit", str(tmp_path / "t.xml")]
    for bad in ([], ["--commit", ""], ["--commit", "HEAD"], ["--commit", "abc"]):
        with pytest.raises(SystemExit) as exc:
            results.main(args + bad)
        assert exc.value.code == 2, bad
    assert os.listdir(tmp_path) == []  # nothing written
    assert results.main(args + ["--commit", "0123abcd-dirty"]) == 0
    (path,) = tmp_path.iterdir()
    assert json.loads(path.read_text())["versions"]["commit"] == "0123abcd-dirty"


def test_decode_benchmark_keeps_its_points_when_killed(monkeypatch, tmp_path):
    bench = load_benchmark("bench_decode_gpu")
    fake_h200(monkeypatch, bench)
    calls = []

    def timer(_torch, _backend, _inputs, _args, _scale):
        calls.append(1)
        if len(calls) == 2:  # the run's time cap kills it during the second point
            raise KeyboardInterrupt
        return {"call_ms": 0.5, "kernel_ms": 0.25}

    monkeypatch.setattr(bench, "time_backend", timer)
    out = tmp_path / "b.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--backends", "REF_TORCH", "--batch", "1", "--context", "64", "--heads", "16,128",
                    "--kv-dtypes", "bfloat16", "--gpu", "h200", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["heads"], r["time_us"]) for r in records] == [(16, 250.0)]


@pytest.mark.slow
def test_whole_run_with_faked_cuda_returns_3_files_and_keeps_the_cut_tests_report(tmp_path):
    slow = tmp_path / "cases" / "test_cut.py"
    slow.parent.mkdir()
    # the cap (90 s) must fall while the second test sleeps: pytest's start on a loaded 2-core machine can
    # take most of a minute
    slow.write_text("import time\n\ndef test_passes():\n    pass\n\ndef test_runs_past_the_cap():\n"
                    "    time.sleep(600)\n")
    out = tmp_path / "out"
    env = dict(os.environ, MLA_FAKE_CUDA="1", PYTHON=sys.executable, PYTHONPATH=FAKE,
               PATH=os.path.join(FAKE, "bin") + os.pathsep + os.environ["PATH"],
               GPU_CHECKS_TEST_FILES=str(slow), GPU_CHECKS_TESTS_CAP_S="90", GPU_CHECKS_TESTS_KILL_S="90",
               GPU_CHECKS_BENCH_CAP_S="1",
               GPU_CHECKS_TARGETS_CAP_S="1", TMPDIR=str(tmp_path),
               GPU_CHECKS_BENCH_ARGS="--backends REF_TORCH --batch 1 --context 64 --heads 16 "
                                     "--kv-dtypes bfloat16 --warmup 0 --iters 1 --no-profiler")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(["bash", SCRIPT, "--commit", "0123abc", "--label", "fake", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    names = sorted(os.listdir(out))
    assert len(names) <= 8, names
    (results_name,) = [n for n in names if n.endswith("-fake.json")]
    assert names == sorted([results_name, "gpu-checks.log", "gpu-run.tar.gz"]), names
    log = (out / "gpu-checks.log").read_text()
    assert re.search(r"^tests +rc=124 ", log, re.M), res.stdout[-3000:]  # cut by its cap
    with tarfile.open(out / "gpu-run.tar.gz") as tar:
        packed = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
        assert {"nvidia-smi.log", "versions.json", "gpu-tests.log", "gpu-tests.xml", "results.log"} <= set(packed)
        junit = tar.extractfile(packed["gpu-tests.xml"]).read().decode()
    # pytest stopped by SIGINT wrote its report: the test that ran is in it
    assert 'name="test_passes"' in junit and 'name="test_runs_past_the_cap"' not in junit, junit
    doc = json.loads((out / results_name).read_text())
    assert doc["versions"]["commit"] == "0123abc" and doc["versions"]["device"]["name"] == "NVIDIA H200"
    assert doc["tests"]["available"] and doc["tests"]["passed"] == 1 and doc["absent"] == ["flashinfer"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpu-checks.")]  # its scratch is removed
