"""vLLM's side of the engine test harness (the shared part is tests/engine_harness.py): whether vLLM is installed
here, and what every vLLM run in the tests is started with."""

from __future__ import annotations

from engine_harness import engine_installed, skip_reason

HAVE_VLLM = engine_installed("vllm")
SKIP_REASON = skip_reason("vLLM", ".venv-vllm", "vllm-env", "vllm_engine")
#: every vLLM run in the tests keeps its traffic on loopback
LOOPBACK = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"}
#: vLLM's CPU settings for the tests' runs (one engine in-process, 1 GiB of cache, both cores)
ENV = dict(LOOPBACK, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
           VLLM_ENABLE_V1_MULTIPROCESSING="0")
#: vllm-cpu 0.32's rotary custom op is wrong on DeepSeek's q_pe/k_pe views: the native path avoids it
LLM_ARGS = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8,
                compilation_config={"custom_ops": ["all", "-rotary_embedding"]})
