"""Runs SGLang's ``Engine`` for tests/sglang_engine in one process per checkpoint, writing a JSON report.

    python tests/sglang_engine/sglang_driver.py {v2|v3} WORKDIR

Phases, in order, each one ``Engine`` started and shut down, the plugin switched on (``MLA_BACKENDS_SGLANG=1``)
and absorbed attention forced onto the spy backend (``MLA_BACKEND=sglang_spy:SpyBackend``): ``plugin`` (page
size 1), then for v2 ``page16`` (page size 16), ``selected`` (page size 16, ``MLA_BACKEND`` unset: the selector's
own choice, CPU_FUSED where its kernel is built) and ``refused`` (``MLA_BACKEND=TRITON_MLA``, which cannot run on a
CPU: start-up must fail with the selection's reasons), for v3 ``tp2`` (``tp_size`` 2, one core per rank). The last
two run in a child process each: SGLang kills the process that started an engine whose scheduler died. Each
phase runs the prompts batched (one ``generate``) and then singly (SGLang's radix cache then holds each prompt:
the single runs re-prefill the last token after a cached prefix, an absorbed extend; at page size 16 only whole
pages are cached, so the 37-token prompt re-prefills 5 tokens absorbed and the short ones run cold, expanded).
transformers' fp32 ``generate()`` gives the reference tokens.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _generate(eng, prompts):  # type: ignore[no-untyped-def]
    from sglang_harness import NEW_TOKENS

    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return [list(o["output_ids"]) for o in eng.generate(input_ids=prompts, sampling_params=sp)]


def _phase(model: str, spy: Path, **extra):  # type: ignore[no-untyped-def]
    import sglang as sgl
    from sglang_harness import ENGINE_ARGS, PROMPTS

    spy.unlink(missing_ok=True)
    t = time.time()
    eng = sgl.Engine(model_path=model, attention_backend="mla_backends", **{**ENGINE_ARGS, **extra})
    start = time.time() - t
    try:
        batched = _generate(eng, PROMPTS)
        single = [_generate(eng, [p])[0] for p in PROMPTS]
    finally:
        eng.shutdown()
    del eng
    gc.collect()
    calls = spy.read_text().splitlines() if spy.exists() else []
    return {"batched": batched, "single": single, "start_s": round(start, 1), "spy": calls}


#: bound on one isolated phase (its own process: SGLang kills the process that started an engine whose scheduler
#: died, so a phase expected to fail, or that may fail, runs in a child)
PHASE_TIMEOUT_S = 400


def _isolated(kind: str, wd: Path, phase: str, env: dict[str, str]) -> dict:
    """Run ``phase`` in a child ``sglang_driver.py`` process: its report, or ``{"error": ..., "log": ...}`` when the
    engine failed to start (the log holds the scheduler's traceback)."""
    import subprocess

    out = wd / f"report-{kind}-{phase}.json"
    out.unlink(missing_ok=True)
    log = wd / f"driver-{kind}-{phase}.log"
    t = time.time()
    with open(log, "w") as f:
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), kind, str(wd), phase],
                                  stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  timeout=PHASE_TIMEOUT_S)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    if out.exists() and rc == 0:
        return json.loads(out.read_text())
    return {"error": f"rc {rc} after {round(time.time() - t, 1)} s", "log": text[-20000:]}


def _setup(kind: str, work: str) -> tuple[Path, Path, Path]:
    import sglang_models as models
    from sglang_harness import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    os.environ["MLA_BACKENDS_SGLANG"] = "1"
    os.environ.setdefault("MLA_BACKEND", "sglang_spy:SpyBackend")
    wd = Path(work)
    ckpt = wd / kind
    if not (ckpt / "config.json").exists():
        models.build(kind, ckpt)
    spy = wd / f"spy-{kind}.txt"
    os.environ["MLA_SPY_FILE"] = str(spy)
    return wd, ckpt, spy


def child(kind: str, work: str, phase: str) -> None:
    """One isolated phase: ``refused`` (whatever ``MLA_BACKEND`` the parent set) or ``tp2``."""
    wd, ckpt, spy = _setup(kind, work)
    extra = {"tp_size": 2} if phase == "tp2" else {}
    spy = wd / f"spy-{kind}-{phase}.txt"
    os.environ["MLA_SPY_FILE"] = str(spy)
    rep = _phase(str(ckpt), spy, **extra)
    (wd / f"report-{kind}-{phase}.json").write_text(json.dumps(rep, indent=1))


def main(kind: str, work: str) -> None:
    from sglang_harness import NEW_TOKENS, PROMPTS

    from mla_backends.testing.engines import hf_greedy_tokens

    os.environ.pop("MLA_BACKEND", None)
    wd, ckpt, spy = _setup(kind, work)
    report: dict = {"kind": kind, "shards": len(list(ckpt.glob("*.safetensors")))}
    report["hf"] = hf_greedy_tokens(ckpt, PROMPTS, NEW_TOKENS)

    print("=== phase plugin", flush=True)
    report["plugin"] = _phase(str(ckpt), spy)
    if kind == "v2":
        print("=== phase page16", flush=True)
        report["page16"] = _phase(str(ckpt), spy, page_size=16)
        print("=== phase selected", flush=True)  # the selector's own choice (CPU_FUSED where it is built)
        forced = os.environ.pop("MLA_BACKEND")
        report["selected"] = _phase(str(ckpt), spy, page_size=16, log_level="info")  # its start-up line
        os.environ["MLA_BACKEND"] = forced
        print("=== phase selected done", flush=True)
        print("=== phase refused", flush=True)
        report["refused"] = _isolated(kind, wd, "refused", {"MLA_BACKEND": "TRITON_MLA"})
    else:
        print("=== phase tp2", flush=True)  # one core per rank (SGLang binds one NUMA node per rank by default)
        report["tp2"] = _isolated(kind, wd, "tp2", {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    (wd / f"report-{kind}.json").write_text(json.dumps(report, indent=1))
    print("=== done", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        child(sys.argv[1], sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
