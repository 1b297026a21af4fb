"""Adapters that run other libraries' models on mla-backends.

- :mod:`mla_backends.integrations.transformers`: ``patch_model`` / ``unpatch_model`` put transformers'
  DeepSeek-V2/V3 attention on :class:`~mla_backends.layer.attention.MLAAttention`, so ``model.generate()`` decodes
  absorbed over a paged latent cache. Imported on demand (it imports transformers).
- :mod:`mla_backends.integrations.vllm`: a vLLM plugin (``vllm.general_plugins`` entry point, inert unless
  ``MLA_BACKENDS_VLLM=1``) that runs vLLM's MLA decode on the selected backend. Importing it never imports vLLM.
- :mod:`mla_backends.integrations.sglang`: an SGLang plugin (``sglang.srt.plugins`` entry point, inert unless
  ``MLA_BACKENDS_SGLANG`` is on) with the attention backend ``mla_backends``. Importing it never imports SGLang.
- :mod:`mla_backends.integrations.engine_core`: the engine-neutral part of the two engine adapters, written once
  (the request and the selection with its errors, the version gate, the engine-internals check each engine's
  ``internals`` table feeds, the scale checks, log-once, the configured backend, the per-layer cache wrappers).
"""
