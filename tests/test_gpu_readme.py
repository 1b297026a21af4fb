"""The device-run results format, the README's generated GPU section and the GPU script's dry run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def readme_gen():
    return _load("gpu_readme")


@pytest.fixture(scope="module")
def results():
    return _load("gpu_results")


def test_readme_gpu_section_matches_the_newest_results(readme_gen):
    assert readme_gen.main(["--check"]) == 0, "README.md GPU section is stale: python benchmarks/gpu_readme.py"


def test_no_results_says_so_and_how_to_make_one(readme_gen, tmp_path):
    text = readme_gen.render_section(readme_gen.newest_results(str(tmp_path)))
    assert "No device run has been recorded" in text and "gpu_checks.sh" in text


def test_newest_file_feeds_the_section_and_check_catches_drift(readme_gen, results, tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="2.5">'
                     '<testcase classname="tests.test_x" name="test_a"><failure message="boom"/></testcase>'
                     '</testsuite></testsuites>')
    tests = results.junit_summary(str(junit))
    assert tests["passed"] == 1 and tests["failed"][0]["test"] == "tests.test_x::test_a"
    rec = {"backend": "TRITON_MLA", "gpu": "h200", "batch": 64, "context": 4096, "heads": 128,
           "kv_cache_dtype": "bfloat16", "bytes": 1, "flops": 2, "roofline_us": 73.8, "bound": "compute",
           "time_us": 100.0, "roofline_fraction": 0.738}
    targets = {"targets": [{"name": "rows_vs_heads_128h", "what": "128 heads: rows over heads", "value": 2.41,
                            "target": ">= 2.0", "met": True}], "records": []}
    payload = results.assemble({"gpu": "h200", "records": [rec]}, tests, "first", "2026-12-01", ["flashinfer"],
                               targets)
    assert {"gpu", "versions", "records", "tests"} <= set(payload) and payload["versions"]["python"]
    assert payload["triton_targets"]["targets"][0]["met"] is True
    name = results.results_name("h200", "2026-12-01", "first")
    assert name == "h200-2026-12-01-first.json"
    (tmp_path / name).write_text(json.dumps(payload))
    (tmp_path / "h200-2026-11-01-old.json").write_text(json.dumps(dict(payload, records=[])))
    assert readme_gen.newest_results(str(tmp_path)).endswith(name)
    section = readme_gen.render_section(readme_gen.newest_results(str(tmp_path)))
    assert "| TRITON_MLA | bfloat16 | 64 | 4096 | 128 | compute | 73.8 | 100.0 | 74% |" in section
    assert "1 failed" in section and "flashinfer" in section
    assert "| 128 heads: rows over heads | 2.41 | >= 2.0 | yes |" in section
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{readme_gen.START}\nold\n{readme_gen.END}\ny\n")
    args = ["--readme", str(readme), "--results-dir", str(tmp_path)]
    assert readme_gen.main(["--check", *args]) == 1
    assert readme_gen.main(args) == 0 and readme_gen.main(["--check", *args]) == 0
    assert readme.read_text().startswith("x\n") and readme.read_text().endswith("y\n")
    with pytest.raises(ValueError, match="date: got '1 Dec'"):
        results.results_name("h200", "1 Dec", "x")


def test_gpu_checks_dry_run_lists_every_test_file_and_point(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), "--dry-run", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    script = open(os.path.join(ROOT, "benchmarks", "gpu_checks.sh")).read()
    files = script.split("TEST_FILES=(", 1)[1].split(")", 1)[0].split()
    assert len(files) >= 8
    for f in files:
        assert os.path.exists(os.path.join(ROOT, f)), f
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f))
        assert int(line.split()[1]) > 0, line  # every file collects at least one test
    grid = json.loads((tmp_path / "bench_decode_gpu.dry-run.json").read_text())
    assert grid["gpu"] == "h200" and any(r["backend"] == "TRITON_MLA" for r in grid["records"])
    targets = json.loads((tmp_path / "bench_triton_targets.dry-run.json").read_text())
    assert {r["kernel"] for r in targets["records"]} == {"heads", "rows"} and targets["targets"]
    est = next(ln for ln in out.splitlines() if ln.startswith("== estimate"))
    assert int(est.rsplit("= ~", 1)[1].split()[0]) <= 330, est  # a second run fits in 15 minutes
    # the modelled test time (compiles, not 1 s a test) is printed before the cap applies
    assert any(ln.startswith("  total ") and "modelled ~" in ln for ln in out.splitlines()), out
    ret = next(ln for ln in out.splitlines() if ln.startswith("returns: "))
    n, names = int(ret.split()[1]), ret.split(": ", 2)[2].split()
    assert n == len(names) <= 8 and "(limit 8)" in ret, ret
    assert names[0].startswith("h200-") and names[0].endswith("-checks.json") and "gpu-run.tar.gz" in names, ret
