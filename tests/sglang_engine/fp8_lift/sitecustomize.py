"""A test fixture (tests/sglang_engine only; never shipped): lifts SGLang 0.5.23's CPU refusal of ``fp8_e5m2`` KV
caches, so the fp8 phase of sglang_driver.py can run the adapter's fp8 path end to end on this CPU.

SGLang refuses fp8 caches for MLA models on the CPU itself (``--kv-cache-dtype fp8_e5m2 is not supported on CPU``
in ``configure_kv_cache_dtype``; for ``fp8_e4m3``, ``CPU FP8 KV cache is only supported for MHA`` in its KV-cache
configurator): its own CPU attention kernels cannot read them. With ``--attention-backend mla_backends`` the rows
are written and read by mla-backends, so the test lifts the first check, and only for ``fp8_e5m2``, by an SGLang
hook registered when a process of the fp8 phase starts (this folder is on that phase's ``PYTHONPATH``; Python
imports ``sitecustomize`` at start-up). Users on SGLang 0.5.23's CPU engine cannot turn fp8 caches on
(docs/integrations.md, "SGLang", fp8 caches).
"""


def _lift() -> None:
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("server_args_kv_cache_dtype") == "fp8_e5m2" and not kwargs.get("is_draft_worker"):
            return None, torch.float8_e5m2
        return original(*args, **kwargs)

    HookRegistry.register("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", around, HookType.AROUND)


_lift()
