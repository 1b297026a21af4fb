"""The spy backends the engine tests hand to an engine through ``MLA_BACKEND=engine_spy:SpyBackend`` (this module
is on the engine processes' path: :func:`engine_harness.engine_env`).

:class:`SpyBackend` is REF_TORCH that appends one line per ``forward_mqa`` it runs to ``$MLA_SPY_FILE``, so a test
proves that the engine's attention went through mla-backends, with how many heads per rank, how many requests and
query tokens, and which fp8 scale the cache was read with. :class:`FakeQuantSpy` also rounds the live rows of a
full-precision cache to an fp8 format (``$MLA_FAKE_QUANT``: ``fp8_e4m3`` or ``fp8_e5m2``, optionally
``:<scale>``; or ``file:<path>``, a file holding that, read at every call, empty for no rounding: a driver turns it
on and off while the engine runs) before each call reads them: a run whose decode sees exactly the values an fp8
cache written with that scale holds, computed without fp8 storage.
"""

from __future__ import annotations

import os

from mla_backends.ref_torch import RefTorchBackend

#: the fields of one spy line, in order
FIELDS = ("pid", "heads", "requests", "configured_heads", "max_query_len", "cache_scale")


def spy_calls(lines: list[str]) -> list[dict[str, str]]:
    """The spy file's lines as dicts of :data:`FIELDS`."""
    return [dict(zip(FIELDS, line.split(), strict=True)) for line in lines]


class SpyBackend(RefTorchBackend):
    """REF_TORCH that writes one line of :data:`FIELDS` per call to ``$MLA_SPY_FILE``."""

    name = "SPY_REF"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw):  # type: ignore[no-untyped-def]
        path = os.environ.get("MLA_SPY_FILE")
        if path:
            configured = self.layer_spec.num_heads if self.layer_spec is not None else -1
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {q_latent.shape[1]} {meta.num_requests} {configured} "
                        f"{max(meta.query_lens_list)} {cache.scale_value!r}\n")
        return super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)


class FakeQuantSpy(SpyBackend):
    """The spy on a full-precision cache whose live rows are rounded to fp8 in place before each call reads them
    (``value / scale`` saturated and rounded to the format, times ``scale``, as :meth:`LatentKVCache.quantize`
    and ``dequantize`` do). Rounding is idempotent, so rows rounded at an earlier step stay as they are; the
    engines' cold prefills never read the cache."""

    name = "SPY_FAKE_QUANT"

    def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw):  # type: ignore[no-untyped-def]
        import torch

        spec = os.environ["MLA_FAKE_QUANT"]
        if spec.startswith("file:"):
            with open(spec[5:]) as f:
                spec = f.read().strip()
            if not spec:
                return super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)
        fmt, _, scale = spec.partition(":")
        dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
        s = torch.tensor(float(scale or 1.0), dtype=torch.float32)
        pages = torch.unique(meta.block_table.long().clamp(min=0))
        rows = cache.data[pages]
        fmax = torch.finfo(dtype).max
        cache.data[pages] = ((rows.float() / s).clamp(-fmax, fmax).to(dtype).float() * s).to(rows.dtype)
        return super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)
