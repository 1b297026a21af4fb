"""Runs vLLM for tests/vllm_engine in one process per checkpoint (engine in-process, one worker), writing a JSON report.

    python tests/vllm_engine/driver.py {v2|v3} WORKDIR

Phases, in order, each one ``LLM`` started and shut down: ``own`` (MLA_BACKENDS_VLLM unset: vLLM's CPU_MLA),
``plugin`` (the plugin enabled through the same ``register()`` vLLM calls, decode forced onto the spy backend
with ``MLA_BACKEND``), for v2 ``selected`` (``MLA_BACKEND`` unset: the selector's own choice, CPU_FUSED where its
kernel is built for this machine), then for v3 ``tp2`` (tensor_parallel_size 2, one core per rank) and for v2
``fp8`` and ``fp8_e5m2`` (the plugin with ``kv_cache_dtype`` fp8 / fp8_e5m2), each followed by ``fake_fp8_e4m3`` /
``fake_fp8_e5m2`` (an fp32 cache whose rows the FakeQuantSpy rounds to that format before decode),
``refused`` (``MLA_BACKEND=TRITON_MLA``, which cannot run on a CPU) and ``refused_288`` (a checkpoint with
``kv_lora_rank`` 256 and rope 32, whose 288-wide rows vLLM's MLA metadata cannot take). Each phase runs the
prompts batched (one ``generate``) and singly, and records the top log-probabilities of each prompt's second
token (the first step that reads the cache). transformers' fp32 ``generate()`` gives the reference tokens.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests/ (the shared harness) and this folder

from engine_harness import NEW_TOKENS, PROMPTS  # noqa: E402
from vllm_env import ENV, LLM_ARGS  # noqa: E402


def _generate(llm, prompts):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in out]


def _step_logprobs(llm, step: int = 1, top: int = 5):  # type: ignore[no-untyped-def]
    """Per prompt: (generated tokens up to ``step``, {token: logprob} of the ``top`` candidates at ``step``)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=step + 1, temperature=0.0, ignore_eos=True, logprobs=top)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [{"prefix": list(r.outputs[0].token_ids[:step]),
             "top": {str(t): float(lp.logprob) for t, lp in r.outputs[0].logprobs[step].items()}} for r in out]


def _impl_classes(llm) -> list[str]:  # type: ignore[no-untyped-def]
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return sorted({type(m.impl).__name__ for m in ctx.values() if hasattr(m, "impl")})


def _phase(model: str, **extra):  # type: ignore[no-untyped-def]
    from vllm import LLM

    t = time.time()
    llm = LLM(model=model, **{**LLM_ARGS, **extra})
    start = time.time() - t
    batched = _generate(llm, PROMPTS)
    single = [_generate(llm, [p])[0] for p in PROMPTS]
    step1 = _step_logprobs(llm)
    impls = _impl_classes(llm)
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    del llm
    gc.collect()
    return {"batched": batched, "single": single, "step1": step1, "impls": impls, "start_s": round(start, 1)}


def _reset_selection() -> None:
    """Forget vLLM's cached backend choice so the next LLM in this process asks the registry again."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


def main(kind: str, work: str) -> None:
    import engine_models as models

    from mla_backends.testing.engines import hf_greedy_tokens

    os.environ.update(ENV)  # the engine environment (tests/engine_harness.py) has no switch of the outer run
    wd = Path(work)
    ckpt = wd / kind
    if not (ckpt / "config.json").exists():
        models.build(kind, ckpt, engine="vllm")
    report: dict = {"kind": kind, "shards": len(list(ckpt.glob("*.safetensors")))}
    report["hf"] = hf_greedy_tokens(ckpt, PROMPTS, NEW_TOKENS)
    spy = wd / f"spy-{kind}.txt"
    spy.unlink(missing_ok=True)
    os.environ["MLA_SPY_FILE"] = str(spy)

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    print("=== phase own", flush=True)
    report["own"] = _phase(str(ckpt))
    report["own"]["overridden"] = AttentionBackendEnum.CPU_MLA.is_overridden()
    report["own"]["spy_calls"] = len(spy.read_text().splitlines()) if spy.exists() else 0

    print("=== phase plugin", flush=True)
    os.environ["MLA_BACKENDS_VLLM"] = "1"
    os.environ["MLA_BACKEND"] = "engine_spy:SpyBackend"
    from mla_backends.integrations.vllm import register

    register()  # what vLLM's plugin loader ran at start-up, now with the switch on
    _reset_selection()
    report["plugin"] = _phase(str(ckpt))
    report["plugin"]["overridden"] = AttentionBackendEnum.CPU_MLA.is_overridden()
    report["plugin"]["spy"] = spy.read_text().splitlines() if spy.exists() else []
    spy.unlink(missing_ok=True)

    if kind == "v2":  # the selector's own choice: CPU_FUSED where its kernel is built, else REF_TORCH
        print("=== phase selected", flush=True)
        os.environ.pop("MLA_BACKEND", None)
        _reset_selection()
        report["selected"] = _phase(str(ckpt))
        os.environ["MLA_BACKEND"] = "engine_spy:SpyBackend"
        print("=== phase selected done", flush=True)

    if kind == "v3":
        print("=== phase tp2", flush=True)
        _reset_selection()
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
        report["tp2"] = _phase(str(ckpt), tensor_parallel_size=2, distributed_executor_backend="mp")
        report["tp2"]["spy"] = spy.read_text().splitlines() if spy.exists() else []
    else:
        for name, fmt in (("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
            print(f"=== phase {name}", flush=True)  # the cache really in fp8
            _reset_selection()
            report[name] = _phase(str(ckpt), kv_cache_dtype=name)
            report[name]["spy_calls"] = len(spy.read_text().splitlines()) if spy.exists() else 0
            spy.unlink(missing_ok=True)
            print(f"=== phase fake_{fmt}", flush=True)  # an fp32 cache, its rows rounded to fmt before decode
            os.environ.update(MLA_BACKEND="engine_spy:FakeQuantSpy", MLA_FAKE_QUANT=fmt)
            _reset_selection()
            report[f"fake_{fmt}"] = _phase(str(ckpt))
            os.environ["MLA_BACKEND"] = "engine_spy:SpyBackend"
            spy.unlink(missing_ok=True)
        print("=== phase refused_288", flush=True)
        narrow = wd / f"{kind}-288"
        if not (narrow / "config.json").exists():
            models.build(kind, narrow, engine="vllm", kv_lora_rank=256, qk_rope_head_dim=32)
        os.environ.pop("MLA_BACKEND", None)  # the selector's own choice (CPU_FUSED or REF_TORCH: both take 288)
        _reset_selection()
        t = time.time()
        try:
            _phase(str(narrow))
            report["refused_288"] = {"error": None}
        except Exception as exc:
            report["refused_288"] = {"error": f"{type(exc).__name__}: {exc}", "after_s": round(time.time() - t, 1)}
        print("=== phase refused", flush=True)
        os.environ["MLA_BACKEND"] = "TRITON_MLA"
        _reset_selection()
        try:
            _phase(str(ckpt))
            report["refused"] = {"error": None}
        except Exception as exc:  # the start-up failure the test inspects
            report["refused"] = {"error": f"{type(exc).__name__}: {exc}"}
    (wd / f"report-{kind}.json").write_text(json.dumps(report, indent=1))
    print("=== done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
