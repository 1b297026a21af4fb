"""``python -m sglang.launch_server --attention-backend mla_backends`` with the plugin on 127.0.0.1 at a free port,
queried by the ``openai`` client with token-id prompts (sglang_driver.py's ``serve`` phase, beside the others;
tests/engine_harness.py starts, waits for and stops the server, every wait bounded): the generated ids
(``return_token_ids``) equal transformers' and the offline ``Engine.generate`` run's. The selector's own choice
this time (no ``MLA_BACKEND``)."""

from __future__ import annotations

from engine_harness import cpu_choice


def test_served_tokens_equal_offline(report_v2: dict) -> None:
    served = report_v2["serve"]
    assert not served.get("error"), served.get("log", "")[-4000:]
    assert served["tokens"] == report_v2["hf"] == report_v2["plugin"]["standard"]["single"]
    chosen = cpu_choice()  # the compiled kernel where built for this machine
    assert (f"runs absorbed MLA on mla-backends (model {served['model']}, 4 heads on this rank). Chosen: "
            f"{chosen}") in served["server_log"]
