"""``python -m sglang.launch_server --attention-backend mla_backends`` with the plugin on 127.0.0.1 at a free port,
queried by the ``openai`` client with token-id prompts: the generated ids (``return_token_ids``) equal the
offline ``Engine.generate`` run. The selector's own choice this time (no ``MLA_BACKEND``). The server is stopped
by the test; every wait is bounded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sglang_harness import ENGINE_ARGS, ENGINE_ENV, HAVE_SGLANG, NEW_TOKENS, PROMPTS, SKIP_REASON, clean_pythonpath

#: bound on the server start (imports on a loaded 2-core machine take a minute or more)
START_TIMEOUT_S = 400
STOP_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(report_v2: dict, workdir: Path):  # type: ignore[no-untyped-def]
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    port = _free_port()
    model = str(workdir / "v2")
    env = {**os.environ, **ENGINE_ENV, "MLA_BACKENDS_SGLANG": "1"}
    for name in ("MLA_BACKEND", "TRITON_INTERPRET", "MLA_SPY_FILE"):
        env.pop(name, None)
    env["PYTHONPATH"] = clean_pythonpath(env.get("PYTHONPATH"))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
           "--port", str(port), "--attention-backend", "mla_backends", "--device", "cpu",
           "--dtype", "float32", "--mem-fraction-static", str(ENGINE_ARGS["mem_fraction_static"]),
           "--max-total-tokens", str(ENGINE_ARGS["max_total_tokens"]), "--disable-cuda-graph", "--sleep-on-idle",
           "--log-level", "info"]
    log = workdir / "serve.log"
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"launch_server exited (rc {proc.returncode}):\n{log.read_text()[-5000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"launch_server not healthy in {START_TIMEOUT_S} s"
            time.sleep(2)
        yield {"port": port, "model": model, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the server's own session: its scheduler and detokenizer too
            proc.wait(timeout=STOP_TIMEOUT_S)
        f.close()


def test_served_tokens_equal_offline(server: dict, report_v2: dict) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    got = []
    for prompt in PROMPTS:
        res = client.completions.create(model=server["model"], prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        got.append(list(res.choices[0].token_ids))
    assert got == report_v2["plugin"]["single"]
    text = server["log"].read_text()
    assert (f"runs absorbed MLA on mla-backends (model {server['model']}, 4 heads on this rank). Chosen: "
            "REF_TORCH") in text
