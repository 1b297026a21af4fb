"""A recording stand-in for FlashInfer's ``BatchMLAPagedAttentionWrapper`` (no flashinfer needed to run it).

:class:`RecordingWrapper` records every ``plan()`` and ``run()`` call's keywords and writes recognisable
outputs; :func:`use_wrapper` makes ``mla_backends.flashinfer_mla.api.load_wrapper_class`` return it.
"""

from __future__ import annotations

import torch


class RecordingWrapper:
    """Records ``plan(**kw)`` in :attr:`plans` and ``run(**kw)`` in :attr:`runs`; every instance joins
    :attr:`instances`. ``run`` writes through :meth:`write`: here head ``h``'s output rows hold ``h`` and the
    LSE 1.5; a subclass overrides :meth:`write` to mark other things."""

    instances: list = []

    def __init__(self, float_workspace_buffer, backend="auto"):
        self.backend = backend
        self.workspace = float_workspace_buffer
        self.plans: list[dict] = []
        self.runs: list[dict] = []
        type(self).instances.append(self)

    def plan(self, **kwargs):
        self.plans.append(kwargs)

    def run(self, *, query, kv_cache, out, lse=None, **kwargs):
        self.runs.append(dict(query=query, kv_cache=kv_cache, out=out, lse=lse, **kwargs))
        self.write(query, out, lse)
        return (out, lse) if kwargs.get("return_lse") else out

    def write(self, query, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Head ``h`` of ``out [T, H, R]`` gets ``h``; ``lse [T, H]`` (when given) gets 1.5."""
        heads = out.shape[1]
        out.copy_(torch.arange(heads, dtype=torch.float32)[None, :, None].expand(out.shape).to(out.dtype))
        if lse is not None:
            lse.fill_(1.5)


def use_wrapper(monkeypatch, cls: type[RecordingWrapper] = RecordingWrapper) -> type[RecordingWrapper]:
    """Make ``cls`` the wrapper class the FlashInfer backends load, with an empty :attr:`instances` list."""
    from mla_backends.flashinfer_mla import api

    monkeypatch.setattr(api, "load_wrapper_class", lambda: cls)
    cls.instances = []
    return cls
