"""Constants shared by tests/vllm_engine (not a conftest, so test modules can import it by name)."""

from __future__ import annotations

import importlib.util

_SPEC = importlib.util.find_spec("vllm")
#: a real vLLM package (a directory named vllm on the path is only a namespace package: no origin)
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None
SKIP_REASON = ("vLLM is not installed in this environment: tests/vllm_engine run in .venv-vllm (`make vllm-env`; "
               "`make test` runs them)")
#: every vLLM run in the tests keeps its traffic on loopback
LOOPBACK = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"}
