"""A REF_TORCH subclass given to the vLLM plugin through ``MLA_BACKEND=spy_backend:SpyBackend``: it records every
``forward_mqa`` it runs (process id, heads, requests) to ``$MLA_SPY_FILE``, so a test can prove that vLLM's
decode went through mla-backends, and which head count each tensor-parallel rank saw."""

from __future__ import annotations

import os

from mla_backends.ref_torch import RefTorchBackend


class SpyBackend(RefTorchBackend):
    """REF_TORCH that writes ``"<pid> <heads> <requests> <configured heads>"`` per call to ``$MLA_SPY_FILE``."""

    name = "SPY_REF"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw):  # type: ignore[no-untyped-def]
        path = os.environ.get("MLA_SPY_FILE")
        if path:
            configured = self.layer_spec.num_heads if self.layer_spec is not None else -1
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {q_latent.shape[1]} {meta.num_requests} {configured}\n")
        return super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)
