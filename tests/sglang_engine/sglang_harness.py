"""Constants shared by tests/sglang_engine (not a conftest, so test modules can import it by name)."""

from __future__ import annotations

import importlib.util
import os

_SPEC = importlib.util.find_spec("sglang")
#: a real SGLang package (a directory named sglang on the path is only a namespace package: no origin)
HAVE_SGLANG = _SPEC is not None and _SPEC.origin is not None
SKIP_REASON = ("SGLang is not installed in this environment: tests/sglang_engine run in .venv-sglang "
               "(`make sglang-env`; `make test` runs them)")
#: what every SGLang run in the tests needs: SGLang's CPU engine, no cap on open files it cannot raise
ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
PROMPTS = [[5, 17, 33, 8, 9, 100, 42], [7, 8, 9], list(range(3, 40)), [150, 3, 77, 91, 12, 5, 6, 8, 10, 11, 99]]
NEW_TOKENS = 10
#: the Engine / launch_server arguments every test run shares (fp32, no tokenizer: token ids in and out;
#: sleep_on_idle: an idle SGLang scheduler otherwise polls at full speed, taking a core from everything else)
ENGINE_ARGS = dict(device="cpu", skip_tokenizer_init=True, dtype="float32", mem_fraction_static=0.05,
                   max_total_tokens=2048, disable_cuda_graph=True, sleep_on_idle=True, log_level="warning")


def clean_pythonpath(value: str | None) -> str:
    """``PYTHONPATH`` without the main suite's ``.test-site`` (tests/conftest.py puts it there: its deliberately
    broken plugin would be loaded, and logged, by every SGLang process)."""
    return os.pathsep.join(p for p in (value or "").split(os.pathsep) if p and not p.endswith(".test-site"))
