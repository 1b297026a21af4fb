"""SGLang's side of the engine test harness (the shared part is tests/engine_harness.py): whether SGLang is
installed here, and what every SGLang run in the tests is started with."""

from __future__ import annotations

from engine_harness import engine_installed, skip_reason

HAVE_SGLANG = engine_installed("sglang")
SKIP_REASON = skip_reason("SGLang", ".venv-sglang", "sglang-env", "sglang_engine")
#: what every SGLang run in the tests needs: SGLang's CPU engine
ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
#: the Engine / launch_server arguments every test run shares (fp32, no tokenizer: token ids in and out;
#: sleep_on_idle: an idle SGLang scheduler otherwise polls at full speed, taking a core from everything else;
#: max_total_tokens bounds the pool, and mem_fraction_static only has to pass SGLang's CPU memory profile, which
#: counts what other processes allocate while the model loads as the model's: 0.05 failed with engines beside)
ENGINE_ARGS = dict(device="cpu", skip_tokenizer_init=True, dtype="float32", mem_fraction_static=0.3,
                   max_total_tokens=2048, disable_cuda_graph=True, sleep_on_idle=True, log_level="warning")
