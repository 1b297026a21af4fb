#!/usr/bin/env python
"""Assemble one device run's results file: ``<gpu>-<yyyy-mm-dd>-<label>.json``.

    python benchmarks/gpu_results.py --outdir OUT --label first --commit SHA --bench OUT/bench_decode_gpu.json \\
        --junit OUT/gpu-tests.xml [--targets OUT/bench_triton_targets.json] [--absent flashinfer]
    python benchmarks/gpu_results.py --versions-only --commit SHA    # the versions as JSON, on stdout

Writes ``OUT/<gpu>-<date>-<label>.json`` = ``{"gpu", "date", "label", "versions", "records", "tests",
"skipped", "errors", "not_run", "triton_targets", "absent"}``: the benchmark's records (see
``bench_decode_gpu.py``), the Triton targets (``bench_triton_targets.py``, when given), the pytest summary
from its JUnit XML (counts, and each failure's test id and first line), the versions of everything that ran.
Copy it into ``benchmarks/results/`` and run ``python benchmarks/gpu_readme.py`` to regenerate the README's
GPU section. Standard library only (torch/triton are asked for their versions).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

FORMAT = "mla-backends/gpu-results/v1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(module: str) -> str:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception as exc:  # absent, or broken on import
        return f"absent ({type(exc).__name__})"


#: a commit as the results file records it: 7-40 hex digits, ``-dirty`` when the tree had changes
COMMIT_RE = re.compile(r"[0-9a-f]{7,40}(-dirty)?")


def check_commit(commit: str | None) -> str:
    """``commit`` when it is a commit id (:data:`COMMIT_RE`), else ValueError naming what it got."""
    if not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit):
        raise ValueError(f"commit: got {commit!r}; supported 7-40 lowercase hex digits, optionally '-dirty' "
                         "(pass --commit $(git rev-parse HEAD) where the checkout was made)")
    return commit


def versions(commit: str | None = None) -> dict[str, Any]:
    """Python, torch (and its CUDA), Triton, FlashInfer, numpy, the driver, nvcc, and the checkout's commit
    (``commit`` when given, else ``git rev-parse HEAD``, None without git)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "triton", "flashinfer", "numpy", "pynvml"):
        out[mod] = _version(mod)
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["device"] = {"name": p.name, "compute_capability": [p.major, p.minor],
                             "sm_count": p.multi_processor_count, "total_memory": p.total_memory}
    except Exception:
        pass
    tools = [("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
             ("nvcc", ["nvcc", "--version"])]
    if commit is None:
        tools.append(("commit", ["git", "-C", ROOT, "rev-parse", "HEAD"]))
    else:
        out["commit"] = commit
    for key, cmd in tools:
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            text = ""
        if key == "nvcc":
            m = re.search(r"release ([\d.]+)", text)
            text = m.group(1) if m else ""
        out[key] = text.splitlines()[0] if text else None
    return out


def junit_summary(path: str) -> dict[str, Any]:
    """Counts and failures from a pytest JUnit XML file (``{"available": False}`` when there is none)."""
    if not os.path.exists(path):
        return {"available": False}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:  # a report cut off while being written
        return {"available": False, "error": f"unreadable JUnit XML: {exc}"}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time_s": 0.0}
    failed: list[dict[str, str]] = []
    for suite in root.iter("testsuite"):
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] += int(suite.get(key, 0))
        counts["time_s"] += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    msg = (el.get("message") or el.text or "").strip().splitlines()
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": tag,
                                   "message": msg[0][:300] if msg else ""})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"available": True, **counts, "failed": failed}


def results_name(gpu: str, date: str, label: str) -> str:
    """``<gpu>-<yyyy-mm-dd>-<label>.json`` with anything but ``[a-z0-9.-]`` turned into ``-``."""
    clean = [re.sub(r"[^a-z0-9.]+", "-", s.lower()).strip("-") for s in (gpu, label)]
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ValueError(f"date: got {date!r}; supported yyyy-mm-dd")
    return f"{clean[0] or 'gpu'}-{date}-{clean[1] or 'run'}.json"


def assemble(bench: dict[str, Any], tests: dict[str, Any], label: str, date: str,
             absent: list[str], targets: dict[str, Any] | None = None, commit: str | None = None) -> dict[str, Any]:
    """The results file's content from the benchmark payload, the test summary and (optionally) the
    ``bench_triton_targets.py`` payload (its records and targets, under ``triton_targets``); ``commit``
    goes into ``versions`` (None: asked of git)."""
    return {"format": FORMAT, "gpu": bench.get("gpu", "unknown"), "date": date, "label": label,
            "versions": versions(commit), "peaks": bench.get("peaks"), "records": bench.get("records", []),
            "tests": tests, "skipped": bench.get("skipped", []), "errors": bench.get("errors", []),
            "not_run": bench.get("not_run", []), "triton_target": bench.get("triton_target"),
            "triton_targets": None if targets is None else {
                k: targets.get(k, []) for k in ("targets", "records", "errors", "not_run")},
            "absent": absent}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outdir")
    p.add_argument("--label", default="checks")
    p.add_argument("--commit", required=True, help="the checkout's commit (git rev-parse HEAD where it was made)")
    p.add_argument("--bench", help="bench_decode_gpu.py's JSON")
    p.add_argument("--junit", help="pytest --junitxml file")
    p.add_argument("--absent", action="append", default=[], help="an optional piece that was not there")
    p.add_argument("--targets", default=None, help="bench_triton_targets.py's JSON (optional)")
    p.add_argument("--versions-only", action="store_true", help="print the versions as JSON and stop")
    args = p.parse_args(argv)
    try:
        check_commit(args.commit)
    except ValueError as exc:
        p.error(f"--commit: {exc}; no results file written")
    if args.versions_only:
        print(json.dumps(versions(args.commit), indent=2))
        return 0
    for flag in ("outdir", "bench", "junit"):
        if not getattr(args, flag):
            p.error(f"--{flag} is required")
    bench: dict[str, Any] = {}
    if os.path.exists(args.bench):
        with open(args.bench) as f:
            bench = json.load(f)
    targets = None
    if args.targets and os.path.exists(args.targets):
        with open(args.targets) as f:
            targets = json.load(f)
    date = _dt.date.today().isoformat()
    payload = assemble(bench, junit_summary(args.junit), args.label, date, args.absent, targets, args.commit)
    path = os.path.join(args.outdir, results_name(payload["gpu"], date, args.label))
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
