"""Runs SGLang's ``Engine`` for tests/sglang_engine in one process per driver, writing a JSON report.

    python tests/sglang_engine/sglang_driver.py {v2|v3} WORKDIR [PHASE]

The plugin is on (``MLA_BACKENDS_SGLANG=1``) and absorbed attention runs on the spy backend
(``MLA_BACKEND=engine_spy:SpyBackend``, tests/engine_spy.py) unless a phase says otherwise. Each phase is one
``Engine`` started and shut down, running its workloads (:data:`WORKLOADS`); :data:`PHASES` lists them per driver.
Phases that may fail, or that need a process environment of their own, are ``isolated``: each runs in a process of
its own (``sglang_driver.py KIND WORKDIR PHASE``, started by tests/sglang_engine/conftest.py beside the drivers,
with its own copy of its checkpoint): SGLang kills the process that started an engine whose scheduler died, and
an engine's shutdown kills every child process of the process that started it. transformers' fp32
``generate()`` gives the reference tokens of every prompt.

- ``v2`` driver: ``serve`` (``python -m sglang.launch_server --attention-backend mla_backends`` on 127.0.0.1 at a
  free port, the selector's own choice, queried by the ``openai`` client with token-id prompts), ``plugin`` (page
  size 1, chunked prefill of 16 tokens: chunk continuations and radix-cache hits
  run absorbed, cold prefills expanded through ``forward_mha``), ``expanded`` (page size 16, chunked prefill of 16,
  a threshold table that absorbs nothing but single tokens: every extend of several tokens, over a cached prefix
  or not, runs expanded through ``forward_mha``), ``refused`` (``MLA_BACKEND=TRITON_MLA``, which cannot run on a
  CPU: start-up must fail with the selection's reasons). ``serve`` is also the phase of the selector's own
  choice (no ``MLA_BACKEND``: CPU_FUSED where its kernel is built for this machine, else REF_TORCH).
- ``v3`` driver: ``plugin`` (page size 1, no chunking: the exact count of absorbed calls), ``tp2`` (``tp_size`` 2,
  one core per rank), ``bf16`` (the fp8 phase's checkpoint with a bf16 cache; then, on the same engine with its
  radix cache flushed, the fake-quant spy rounding every row it reads to e5m2 with the checkpoint's scale) and
  ``fp8`` (that checkpoint, whose layers carry ``k_scale`` 0.25, with an ``fp8_e5m2`` cache; SGLang refuses fp8
  MLA caches on the CPU itself, so this phase's processes load tests/sglang_engine/fp8_lift, a test fixture that
  lifts that one check).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests/ (the shared harness) and this folder

from engine_harness import NEW_TOKENS, PROMPTS  # noqa: E402
from sglang_env import ENGINE_ARGS, ENGINE_ENV  # noqa: E402

#: prompts sharing a 48-token prefix (three chunks of 16), with tails of 1 to 6 tokens
SHARED = [list(range(60, 108)) + tail for tail in ([5, 6, 7], [9], [11, 12, 13, 14, 15, 16], [7, 3])]
#: the fp8 checkpoint's per-tensor KV-cache scale: not 1, and a power of two, so that the fake-quant bf16 run holds
#: exactly the values the fp8 cache reads back (e5m2 value x 0.25 is a bf16 number; x 0.37 would be rounded)
KV_SCALE = 0.25
#: absorb single tokens only (every extend of several tokens runs expanded), for the spy backend
EXPAND_TABLE = {"format": "mla-backends/threshold-table/v1",
                "backends": {"SPY_REF": {"entries": [{"max_context": 0, "threshold": 1}]}}}


@dataclass(frozen=True)
class Phase:
    name: str
    checkpoint: str  # "v2", "v3" or "v2s" (v2's weights with the KV scale)
    workloads: tuple[str, ...]
    args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    isolated: bool = False


PHASES: dict[str, tuple[Phase, ...]] = {
    "v2": (Phase("plugin", "v2", ("standard", "shared"), {"chunked_prefill_size": 16}),
           Phase("expanded", "v2", ("standard", "shared"), {"page_size": 16, "chunked_prefill_size": 16},
                 {"MLA_BACKENDS_THRESHOLD_TABLE": "{wd}/expand-table.json"}),
           Phase("refused", "v2", ("standard",), env={"MLA_BACKEND": "TRITON_MLA"}, isolated=True),
           Phase("serve", "v2", ("served",), isolated=True)),
    "v3": (Phase("plugin", "v3", ("standard",)),
           Phase("tp2", "v3", ("standard",), {"tp_size": 2}, {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, isolated=True),
           Phase("bf16", "v2s", ("standard", "logprobs", "flush", "fake", "standard", "logprobs"),
                 {"dtype": "bfloat16", "kv_cache_dtype": "bf16"},
                 {"MLA_BACKEND": "engine_spy:FakeQuantSpy", "MLA_FAKE_QUANT": "file:{wd}/fake-quant.txt"}),
           Phase("fp8", "v2s", ("standard", "logprobs"), {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"},
                 {"PYTHONPATH": str(HERE / "fp8_lift")}, isolated=True)),
}
#: bound on the served model's start
SERVE_START_TIMEOUT_S = 600


def _generate(eng, prompts, **extra):  # type: ignore[no-untyped-def]
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return eng.generate(input_ids=prompts, sampling_params=sp, **extra)


def _tokens(eng, prompts):  # type: ignore[no-untyped-def]
    return [list(o["output_ids"]) for o in _generate(eng, prompts)]


def _step1_logprobs(eng):  # type: ignore[no-untyped-def]
    """Per prompt: the first generated token and the top-5 {token: logprob} of the second (the first step that
    reads the cache)."""
    out = _generate(eng, PROMPTS, return_logprob=True, top_logprobs_num=5)
    return [{"prefix": list(o["output_ids"][:1]),
             "top": {str(tok): float(lp) for lp, tok, *_ in o["meta_info"]["output_top_logprobs"][1]}} for o in out]


def _run_workloads(eng, phase: Phase, wd: Path, spy: Path) -> dict:  # type: ignore[no-untyped-def]
    """The phase's workloads in order; each one's result and the spy lines it produced."""
    res: dict = {}
    suffix = ""
    for w in phase.workloads:
        spy.unlink(missing_ok=True)
        key = w + suffix
        if w == "standard":  # batched, then each prompt alone (radix-cache hits: the last token re-prefilled)
            res[key] = {"batched": _tokens(eng, PROMPTS), "single": [_tokens(eng, [p])[0] for p in PROMPTS]}
        elif w == "shared":  # one after the other (each one's prefix cached by the one before), then batched
            res[key] = {"single": [_tokens(eng, [p])[0] for p in SHARED], "batched": _tokens(eng, SHARED)}
        elif w == "logprobs":
            res[key] = {"step1": _step1_logprobs(eng)}
            continue
        elif w == "flush":
            assert eng.flush_cache().success
            continue
        elif w == "fake":  # from here on the spy rounds what it reads to the fp8 phase's cache values
            (wd / "fake-quant.txt").write_text(f"fp8_e5m2:{KV_SCALE}")
            suffix = "_fake"
            continue
        res[key]["spy"] = spy.read_text().splitlines() if spy.exists() else []
    return res


def _phase(kind: str, wd: Path, phase: Phase) -> dict:
    import sglang as sgl

    ckpt = wd / phase.checkpoint
    spy = wd / f"spy-{kind}-{phase.name}.txt"
    os.environ["MLA_SPY_FILE"] = str(spy)
    t = time.time()
    eng = sgl.Engine(model_path=str(ckpt), attention_backend="mla_backends", **{**ENGINE_ARGS, **phase.args})
    start = time.time() - t
    try:
        rep = _run_workloads(eng, phase, wd, spy)
    finally:
        eng.shutdown()
    del eng
    gc.collect()
    return rep | {"start_s": round(start, 1)}


def _build(wd: Path, name: str) -> None:
    import engine_models as models

    if (wd / name / "config.json").exists():
        return
    if name == "v2s":
        models.with_kv_scale(models.build("v2", wd / "v2s-base", engine="sglang"), wd / name, KV_SCALE)
    else:
        models.build(name, wd / name, engine="sglang")


def _phase_env(wd: Path, phase: Phase, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the plugin on, the spy backend, and the phase's settings (a ``PYTHONPATH`` entry goes first)."""
    out = {**env, **ENGINE_ENV, "MLA_BACKENDS_SGLANG": "1", "MLA_BACKEND": "engine_spy:SpyBackend"}
    for key, value in phase.env.items():
        value = value.format(wd=wd)
        out[key] = os.pathsep.join([value, out["PYTHONPATH"]]) if key == "PYTHONPATH" else value
    return out


def _setup(wd: Path, phase: Phase) -> None:
    os.environ.update(_phase_env(wd, phase, dict(os.environ)))


def _serve(wd: Path, phase: Phase) -> dict:
    """The served model: SGLang's OpenAI server with the plugin, its greedy tokens and its log."""
    from engine_harness import free_port, served, served_tokens

    port = free_port()
    model = str(wd / phase.checkpoint)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
           "--port", str(port), "--attention-backend", "mla_backends", "--device", "cpu", "--dtype", "float32",
           "--mem-fraction-static", str(ENGINE_ARGS["mem_fraction_static"]),
           "--max-total-tokens", str(ENGINE_ARGS["max_total_tokens"]), "--disable-cuda-graph", "--sleep-on-idle",
           "--log-level", "info"]
    env = {k: v for k, v in os.environ.items() if k not in ("MLA_BACKEND", "MLA_SPY_FILE")}
    with served(cmd, env, wd / "serve.log", port, start_timeout_s=SERVE_START_TIMEOUT_S) as log:
        tokens = served_tokens(port, model)
    return {"model": model, "tokens": tokens, "server_log": log.read_text(errors="replace")[-20000:]}


def child(kind: str, work: str, name: str) -> None:
    """One isolated phase, in this process, on its own copy of its checkpoint (``WORKDIR/KIND-PHASE``)."""
    phase = next(p for p in PHASES[kind] if p.name == name)
    wd = Path(work) / f"{kind}-{name}"
    wd.mkdir(exist_ok=True)
    _build(wd, phase.checkpoint)
    _setup(wd, phase)
    rep = _serve(wd, phase) if "served" in phase.workloads else _phase(kind, wd, phase)
    (Path(work) / f"report-{kind}-{name}.json").write_text(json.dumps(rep, indent=1))


def main(kind: str, work: str) -> None:
    from mla_backends.testing.engines import hf_greedy_tokens

    wd = Path(work)
    (wd / "expand-table.json").write_text(json.dumps(EXPAND_TABLE))
    (wd / "fake-quant.txt").write_text("")
    for name in dict.fromkeys([kind, *(p.checkpoint for p in PHASES[kind] if not p.isolated)]):
        _build(wd, name)
    report: dict = {"kind": kind, "shards": len(list((wd / kind).glob("*.safetensors")))}
    report["hf"] = hf_greedy_tokens(wd / kind, PROMPTS, NEW_TOKENS)
    if kind == "v2":
        report["hf_shared"] = hf_greedy_tokens(wd / kind, SHARED, NEW_TOKENS)
    base = dict(os.environ)
    for phase in PHASES[kind]:
        if phase.isolated:
            continue
        print(f"=== phase {phase.name}", flush=True)
        _setup(wd, phase)
        report[phase.name] = _phase(kind, wd, phase)
        os.environ.clear()
        os.environ.update(base)
    (wd / f"report-{kind}.json").write_text(json.dumps(report, indent=1))
    print("=== done", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        child(sys.argv[1], sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
