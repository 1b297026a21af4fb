"""``python -m mla_backends.integrations.vllm serve`` (vLLM's own ``vllm serve``) with the plugin on 127.0.0.1
at a free port, queried by the ``openai`` client with token-id prompts: the generated ids
(``return_token_ids``) equal the offline ``LLM.generate`` run. The server is stopped by the test; every wait
is bounded (tests/engine_harness.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from engine_harness import cpu_choice, engine_env, free_port, served, served_tokens
from vllm_env import ENV, HAVE_VLLM, LLM_ARGS, SKIP_REASON

HERE = Path(__file__).resolve().parent
#: bound on the server start (imports on a loaded 2-core machine take minutes)
START_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def server(report_v3: dict, workdir: Path):  # type: ignore[no-untyped-def]
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    port = free_port()
    model = str(workdir / "v3")
    env = engine_env(HERE, {**ENV, "MLA_BACKENDS_VLLM": "1"})  # the selector's own choice this time
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    cmd = [sys.executable, "-m", "mla_backends.integrations.vllm", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(LLM_ARGS["max_model_len"]), "--max-num-seqs", "8",
           "--distributed-executor-backend", "uni",
           "--compilation-config", json.dumps(LLM_ARGS["compilation_config"])]
    with served(cmd, env, workdir / "serve.log", port, start_timeout_s=START_TIMEOUT_S) as log:
        yield {"port": port, "model": model, "log": log}


def test_served_tokens_equal_offline(server: dict, report_v3: dict) -> None:
    assert served_tokens(server["port"], server["model"]) == report_v3["plugin"]["single"]
    chosen = cpu_choice()  # the selector's CPU choice on this machine
    assert (f"runs MLA decode on mla-backends (model {server['model']}, 4 heads on this rank). Chosen: {chosen}, "
            "block_size 16") in server["log"].read_text()
