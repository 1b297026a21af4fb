"""``python -m mla_backends.integrations.vllm serve`` (vLLM's own ``vllm serve``) with the plugin on 127.0.0.1
at a free port, queried by the ``openai`` client with token-id prompts: the generated ids
(``return_token_ids``) equal the offline ``LLM.generate`` run. The server is stopped by the test; every wait
is bounded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from harness import HAVE_VLLM, LOOPBACK, SKIP_REASON

HERE = Path(__file__).resolve().parent
#: bound on the server start (imports on a loaded 2-core machine take minutes)
START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(report_v3: dict, workdir: Path):  # type: ignore[no-untyped-def]
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    from driver import LLM_ARGS

    port = _free_port()
    model = str(workdir / "v3")
    env = {**os.environ, **LOOPBACK, "MLA_BACKENDS_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("MLA_BACKEND", None)  # the selector's own choice this time
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "mla_backends.integrations.vllm", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(LLM_ARGS["max_model_len"]), "--max-num-seqs", "8",
           "--distributed-executor-backend", "uni",
           "--compilation-config", json.dumps(LLM_ARGS["compilation_config"])]
    log = workdir / "serve.log"
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited (rc {proc.returncode}):\n{log.read_text()[-5000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not healthy in {START_TIMEOUT_S} s"
            time.sleep(2)
        yield {"port": port, "model": model, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        f.close()


def test_served_tokens_equal_offline(server: dict, report_v3: dict) -> None:
    import openai
    from driver import NEW_TOKENS, PROMPTS

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", timeout=300,
                           max_retries=0)
    got = []
    for prompt in PROMPTS:
        res = client.completions.create(model=server["model"], prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        got.append(list(res.choices[0].token_ids))
    assert got == report_v3["plugin"]["single"]
    assert (f"runs MLA decode on mla-backends (model {server['model']}, 4 heads on this rank). Chosen: REF_TORCH, "
            "block_size 16") in server["log"].read_text()
