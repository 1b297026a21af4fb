"""A REF_TORCH subclass given to the SGLang plugin through ``MLA_BACKEND=sglang_spy:SpyBackend``: it appends one
line per ``forward_mqa`` it runs (process id, query heads, requests, largest query length) to ``$MLA_SPY_FILE``,
so a test can prove that SGLang's absorbed attention went through mla-backends, and with how many heads per rank."""

from __future__ import annotations

import os

from mla_backends.ref_torch import RefTorchBackend


class SpyBackend(RefTorchBackend):
    """REF_TORCH that writes ``"<pid> <heads> <requests> <max query len>"`` per call to ``$MLA_SPY_FILE``."""

    name = "SPY_REF"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw):  # type: ignore[no-untyped-def]
        path = os.environ.get("MLA_SPY_FILE")
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {q_latent.shape[1]} {meta.num_requests} {max(meta.query_lens_list)}\n")
        return super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)
