"""What the selector knows about a device: :class:`DeviceInfo`.

Built from NVML (:func:`detect_device`, see ``selector.detect``) or given for simulation (``"sm90"``,
``(10, 0)``, ``"cpu"``). This module imports nothing heavier than the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceInfo", "CPU_DEVICE"]


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the selector sees it.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        name: marketing name (``"NVIDIA H100 80GB HBM3"``) or ``"cpu"``.
        compute_capability: ``(major, minor)`` for CUDA devices, None for the CPU.
        total_memory: bytes of device memory (0 when unknown).
        index: CUDA device index (None for the CPU).
        sm_count: streaming multiprocessors (0 when unknown).
        simulated: True when described by the user rather than read from hardware.
    """

    kind: str = "cpu"
    name: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    total_memory: int = 0
    index: int | None = None
    sm_count: int = 0
    simulated: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"DeviceInfo.kind: got {self.kind!r}; supported 'cuda', 'cpu'")
        if self.kind == "cuda" and self.compute_capability is None:
            raise ValueError("DeviceInfo.compute_capability: got None for a CUDA device; supported (major, minor)")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def sm(self) -> int | None:
        """Compute capability as one number (90 for SM90), None on the CPU."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def arch_label(self) -> str:
        """``"sm90"``, ``"sm100"`` ... or ``"cpu"``."""
        return "cpu" if self.sm is None else f"sm{self.sm}"

    def describe(self) -> str:
        if not self.is_cuda:
            return "CPU" + (" (simulated)" if self.simulated else "")
        sim = " (simulated)" if self.simulated else ""
        major, minor = self.compute_capability or (0, 0)
        return f"{self.name} [SM{major}{minor}]{sim}"


CPU_DEVICE = DeviceInfo()
