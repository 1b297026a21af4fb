"""The description of a device that backends, the layer and the selector share: :class:`DeviceInfo`.

Built from a torch device (:func:`device_info_for`), from NVML (``selector.detect.detect_device``, the
selector's probe) or given for simulation (``"sm90"``, ``(10, 0)``, ``"cpu"``, or a product name from the
GPU table such as ``"h200"`` or ``"rtx-pro-6000"``; :func:`parse_device_spec`). A bottom module of
``mla_backends``: it imports only the standard library and :mod:`mla_backends.core.gpus` (torch only when
:func:`cuda_device_index` / :func:`device_info_for` run). ``selector.device`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .gpus import gpu_spec, known_gpu_names

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceInfo", "CPU_DEVICE", "SIMULATED_NAMES", "simulated_device", "simulated_gpu",
           "parse_device_spec", "cuda_device_index", "device_info_for"]


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
            raise ValueError("DeviceInfo.compute_capability: got None for a CUDA device; "
                             "supported (major, minor)")

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


def cuda_device_index(device: torch.device) -> int:
    """The index of a torch ``cuda`` device: its own, else torch's current device (what ``"cuda"`` means)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def device_info_for(device: torch.device) -> DeviceInfo:
    """:class:`DeviceInfo` of a real torch device (read from torch; no NVML needed)."""
    if device.type != "cuda":
        return CPU_DEVICE
    import torch

    idx = cuda_device_index(device)
    props = torch.cuda.get_device_properties(idx)
    return DeviceInfo(kind="cuda", name=props.name, compute_capability=(props.major, props.minor),
                      total_memory=props.total_memory, index=idx, sm_count=props.multi_processor_count)


#: marketing names used for simulated devices (what a user asking "what would I get on X" most likely has)
SIMULATED_NAMES: dict[tuple[int, int], str] = {
    (8, 0): "NVIDIA A100",
    (8, 6): "NVIDIA RTX A6000 / RTX 3090",
    (8, 9): "NVIDIA L40S / RTX 4090",
    (9, 0): "NVIDIA H100 / H200",
    (10, 0): "NVIDIA B200 / GB200",
    (10, 3): "NVIDIA B300 / GB300",
    (11, 0): "NVIDIA Jetson Thor",
    (12, 0): "NVIDIA RTX PRO 6000 / RTX 5090",
    (12, 1): "NVIDIA DGX Spark GB10",
}

_SUPPORTED_FORMS = ("'auto', 'cpu', 'cuda[:N]', an int index, 'sm90'/'sm_100a', a GPU product name ("
                    + ", ".join(known_gpu_names()) + "), a (major, minor) tuple or a DeviceInfo")


def simulated_device(major: int, minor: int) -> DeviceInfo:
    """A CUDA device described by compute capability only (for "what would I get on an SM100?")."""
    for label, v in (("major", major), ("minor", minor)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"device compute capability {label}: got {type(v).__name__}; supported int")
    if not (5 <= major <= 15 and 0 <= minor <= 9):
        raise ValueError(f"device: got compute capability ({major}, {minor}); "
                         "supported major 5..15, minor 0..9")
    name = SIMULATED_NAMES.get((major, minor), f"SM{major}{minor} GPU")
    return DeviceInfo(kind="cuda", name=name, compute_capability=(major, minor), simulated=True)


def simulated_gpu(product: str) -> DeviceInfo:
    """A simulated CUDA device for a product of the GPU table (``"h200"``, ``"B200"``, ``"rtx-pro-6000"``):
    its marketing name, compute capability, memory (bytes) and SM count from :mod:`mla_backends.core.gpus`.

    Raises TypeError for a non-string and ValueError naming the known products for an unknown name.
    """
    row = gpu_spec(product)
    return DeviceInfo(kind="cuda", name=row.name, compute_capability=row.compute_capability,
                      total_memory=row.memory_bytes, sm_count=row.sms, simulated=True)


def parse_device_spec(device: object) -> DeviceInfo | int | None:
    """Turn a user's device argument into a :class:`DeviceInfo`, or into a CUDA index to probe.

    Returns a DeviceInfo for simulated devices (``"sm90"``, ``(9, 0)``, ``"cpu"``, a product name of the GPU
    table: ``"h100"``, ``"b200"``, ``"rtx5090"``, see :func:`simulated_gpu`) and for DeviceInfo input;
    an int (the CUDA device index) for ``"cuda"``, ``"cuda:N"`` or ``N``; None for ``None``/``"auto"``
    (probe device 0). Raises ValueError/TypeError naming the argument for anything else.
    """
    if device is None or isinstance(device, DeviceInfo):
        return device
    if isinstance(device, bool):
        raise TypeError(f"device: got bool; supported {_SUPPORTED_FORMS}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device: got index {device}; supported an index >= 0")
        return device
    if isinstance(device, tuple):
        if len(device) != 2:
            raise ValueError(f"device: got tuple {device!r}; supported (major, minor)")
        return simulated_device(*device)
    if not isinstance(device, str):
        raise TypeError(f"device: got {type(device).__name__}; supported {_SUPPORTED_FORMS}")
    text = device.strip().lower()
    if text in ("", "auto"):
        return None
    if text == "cpu":
        return CPU_DEVICE
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():  # "cuda:²" is not an index
        return int(text[5:])
    sm = text.removeprefix("sm").removeprefix("_").rstrip("af")
    if text.startswith("sm") and sm.isascii() and sm.isdigit() and len(sm) in (2, 3):  # "sm9²" is no arch
        return simulated_device(int(sm[:-1]), int(sm[-1]))
    try:
        return simulated_gpu(text)
    except ValueError:
        raise ValueError(f"device: got {device!r}; supported {_SUPPORTED_FORMS}") from None
