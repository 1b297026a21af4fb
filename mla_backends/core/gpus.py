"""The package's one GPU table: per NVIDIA product, used for rooflines, device names and deployment sizing.

**Memory** is what the driver reports as the device's total (``nvidia-smi``'s ``Memory-Usage`` total, NVML's
``memory.total``), in MiB as published driver output shows it: an H200 is 143,771 MiB = 150,754,820,096
bytes, not the 141 GB on its data sheet. That is the figure an engine's memory fraction applies to, so the
deployment sizing (``mla-backends kv-cache --gpu``) starts from it; ``--gpu-memory`` overrides it. Each row
names where its figure comes from (``memory_source``); ``memory_confirmed`` is False where no published driver
output was found to cite, and the row says what it holds instead. The other figures are the vendor's *spec*
(never a measurement): bandwidth in bytes/s, tensor-core rates in dense TFLOP/s (sparsity figures halved).
GeForce rates are the FP32-accumulate ones (what attention kernels use; GeForce runs FP32 accumulation at half
the FP16-accumulate rate). ``fp8_tflops`` is None where the part has no fp8 tensor cores (Ampere).

    >>> gpu_spec("H200").bandwidth_bytes_per_s
    4800000000000.0
    >>> gpu_spec("rtx_pro_6000").compute_capability
    (12, 0)

Look-ups: :func:`gpu_spec` by key or alias (case, ``-``, ``_`` and spaces ignored);
:func:`gpu_spec_for_device_name` by the name a driver reports (``"NVIDIA H100 80GB HBM3"``).
``docs/gpus.md`` is generated from :data:`GPU_TABLE` (``python -m docgen.gpus``).
This module imports only the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GpuSpec", "GPU_TABLE", "gpu_spec", "gpu_spec_for_device_name", "known_gpu_names"]


@dataclass(frozen=True)
class GpuSpec:
    """One product's vendor-stated figures.

    Attributes:
        key: canonical lookup name (``"h200"``).
        aliases: other accepted names (``"h200-sxm"``).
        name: marketing name (``"NVIDIA H200 SXM"``).
        architecture: ``"Ampere"``, ``"Ada"``, ``"Hopper"``, ``"Blackwell"``, ``"Blackwell Ultra"``.
        compute_capability: ``(major, minor)``.
        sms: streaming multiprocessors enabled on the product.
        memory_bytes: device memory in bytes: the driver-reported total (``nvidia-smi`` MiB x 2**20).
        memory_type: ``"HBM3e"``, ``"GDDR7"``, ...
        bandwidth_bytes_per_s: peak memory bandwidth in bytes/s.
        bf16_tflops: dense bf16 tensor-core rate, TFLOP/s (FP32 accumulate).
        fp8_tflops: dense fp8 (e4m3) tensor-core rate, TFLOP/s; None without fp8 tensor cores.
        device_names: regular expressions matched (case-insensitive) against a driver-reported name.
        note: where a figure needs a word (derivation, variant).
        memory_source: where ``memory_bytes`` comes from (a published ``nvidia-smi`` output, or why none).
        memory_confirmed: True when ``memory_bytes`` is a driver figure from a published, citable output.
        datasheet_memory_gb: the data sheet's memory in GB (10**9 bytes), for reference (141 for the H200).
    """

    key: str
    aliases: tuple[str, ...]
    name: str
    architecture: str
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    memory_type: str
    bandwidth_bytes_per_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    device_names: tuple[str, ...]
    note: str = ""
    memory_source: str = ""
    memory_confirmed: bool = False
    datasheet_memory_gb: float = 0.0

    @property
    def sm_label(self) -> str:
        """``"sm90"``, ``"sm100"``, ... (the selector's simulated-device spelling)."""
        major, minor = self.compute_capability
        return f"sm{major}{minor}"

    def tensor_flops_per_s(self, fp8_mma: bool = False) -> float:
        """Peak dense tensor rate in FLOP/s: bf16, or fp8 when ``fp8_mma`` (falls back to bf16 without fp8)."""
        tflops = self.fp8_tflops if (fp8_mma and self.fp8_tflops) else self.bf16_tflops
        return tflops * 1e12

    def ridge_flop_per_byte(self, fp8_mma: bool = False) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound on this part."""
        return self.tensor_flops_per_s(fp8_mma) / self.bandwidth_bytes_per_s


MiB = 1 << 20


def _g(key: str, aliases: tuple[str, ...], name: str, arch: str, cc: tuple[int, int], sms: int, gb: float,
       mem: str, tb_s: float, bf16: float, fp8: float | None, names: tuple[str, ...], note: str = "") -> GpuSpec:
    """``gb``: the data sheet's memory (GB = 10**9); the row holds the driver's figure from :data:`_DRIVER_MEMORY`
    where one was found, else the data sheet's."""
    mib, source, confirmed = _DRIVER_MEMORY[key]
    nbytes = mib * MiB if mib is not None else int(round(gb * 1e9))
    return GpuSpec(key, aliases, name, arch, cc, sms, nbytes, mem, tb_s * 1e12, bf16, fp8, names, note,
                   source, confirmed, gb)


_SEEN = "nvidia-smi listing seen"
_UNSOURCED = ("no published driver output found: the data sheet's GB (10**9 bytes), which undercounts what "
              "the driver reports")
#: key -> (MiB the driver reports, None where none was found; source; confirmed).
#: Sources are public nvidia-smi outputs (GitHub issues/PRs); "seen" rows are figures read in public
#: nvidia-smi listings whose origin could not be pinned to a citable thread: not confirmed.
_DRIVER_MEMORY: dict[str, tuple[int | None, str, bool]] = {
    "a100": (81920, "nvidia-smi 81920MiB (A100 80GB): modal-labs/modal-client#2797", True),
    "a100-pcie": (None, _UNSOURCED, False),
    "a100-40gb": (40960, "nvidia-smi 40960MiB: modal-labs/modal-client#2797", True),
    "a10": (23028, "nvidia-smi 23028MiB: modal-labs/modal-client#2797", True),
    "l4": (23034, "nvidia-smi 23034MiB: modal-labs/modal-client#2797", True),
    "l40s": (46068, "nvidia-smi 46068MiB: modal-labs/modal-client#2797", True),
    "rtx4090": (24564, "nvidia-smi 24564MiB: vllm-project/vllm#7553", True),
    "h100": (81559, "nvidia-smi 81559MiB: NVIDIA/nccl#1264, modal-labs/modal-client#2797", True),
    "h100-pcie": (None, _UNSOURCED, False),
    "h100-nvl": (95830, f"{_SEEN} (95830MiB), no citable thread", False),
    "h800": (81559, f"{_SEEN} (81559MiB, as the H100 SXM), no citable thread", False),
    "h20": (97871, "nvidia-smi 97871MiB: deepseek-ai/DeepGEMM#268", True),
    "h200": (143771, "nvidia-smi 143771MiB: sgl-project/sglang#3196", True),
    "b200": (183359, "nvidia-smi 183359MiB: NVIDIA/TensorRT-LLM#10278", True),
    "gb200": (189471, f"{_SEEN} (189471MiB), no citable thread", False),
    "b300": (275040, f"{_SEEN} (275040MiB, 'B300 SXM6 AC'), no citable thread", False),
    "gb300": (284208, f"{_SEEN} (284208MiB), no citable thread", False),
    "rtx-pro-6000": (97887, "nvidia-smi 97887MiB (Server Edition): vllm-project/vllm#43412", True),
    "rtx5090": (32607, "nvidia-smi 32607MiB: noonghunna/club-3090#617", True),
}


#: one row per product, oldest architecture first
GPU_TABLE: tuple[GpuSpec, ...] = (
    _g("a100", ("a100-sxm", "a100-80gb", "a100-sxm4-80gb"), "NVIDIA A100 SXM4 80GB", "Ampere", (8, 0), 108,
       80, "HBM2e", 2.039, 312.0, None, (r"A100", r"A100-SXM4-80GB")),
    _g("a100-pcie", ("a100-80gb-pcie",), "NVIDIA A100 80GB PCIe", "Ampere", (8, 0), 108, 80, "HBM2e", 1.935,
       312.0, None, (r"A100 80GB PCIe",)),
    _g("a100-40gb", ("a100-sxm4-40gb",), "NVIDIA A100 SXM4 40GB", "Ampere", (8, 0), 108, 40, "HBM2", 1.555,
       312.0, None, (r"A100-(SXM4|PCIE)-40GB",)),
    _g("a10", (), "NVIDIA A10", "Ampere", (8, 6), 72, 24, "GDDR6", 0.600, 125.0, None, (r"\bA10\b",)),
    _g("l4", (), "NVIDIA L4", "Ada", (8, 9), 58, 24, "GDDR6", 0.300, 121.0, 242.5, (r"\bL4\b",)),
    _g("l40s", (), "NVIDIA L40S", "Ada", (8, 9), 142, 48, "GDDR6", 0.864, 362.05, 733.0, (r"\bL40S\b",)),
    _g("rtx4090", ("geforce-rtx-4090",), "NVIDIA GeForce RTX 4090", "Ada", (8, 9), 128, 24, "GDDR6X", 1.008,
       165.2, 330.3, (r"RTX 4090",), "GeForce: FP32-accumulate rates"),
    _g("h100", ("h100-sxm", "h100-sxm5", "h100-80gb"), "NVIDIA H100 SXM5 80GB", "Hopper", (9, 0), 132, 80,
       "HBM3", 3.35, 989.4, 1978.9, (r"H100",)),
    _g("h100-pcie", (), "NVIDIA H100 PCIe", "Hopper", (9, 0), 114, 80, "HBM2e", 2.0, 756.5, 1513.0,
       (r"H100 PCIe",)),
    _g("h100-nvl", (), "NVIDIA H100 NVL", "Hopper", (9, 0), 132, 94, "HBM3", 3.9, 835.5, 1670.5,
       (r"H100 NVL",)),
    _g("h800", ("h800-sxm",), "NVIDIA H800 SXM5", "Hopper", (9, 0), 132, 80, "HBM3", 3.35, 989.4, 1978.9,
       (r"H800",)),
    _g("h20", (), "NVIDIA H20", "Hopper", (9, 0), 78, 96, "HBM3", 4.0, 148.0, 296.0, (r"\bH20\b",)),
    _g("h200", ("h200-sxm",), "NVIDIA H200 SXM", "Hopper", (9, 0), 132, 141, "HBM3e", 4.8, 989.4, 1978.9,
       (r"(?<!G)H200",)),
    _g("b200", ("hgx-b200", "dgx-b200"), "NVIDIA B200", "Blackwell", (10, 0), 148, 180, "HBM3e", 8.0, 2250.0,
       4500.0, (r"(?<!G)B200",), "HGX B200 figures per GPU (8 TB/s as first stated; later sheets say 7.7)"),
    _g("gb200", (), "NVIDIA GB200 (per GPU)", "Blackwell", (10, 0), 148, 186, "HBM3e", 8.0, 2500.0, 5000.0,
       (r"GB200",), "GB200 NVL72 figures divided by 72"),
    _g("b300", ("hgx-b300", "dgx-b300", "b300-sxm"), "NVIDIA B300", "Blackwell Ultra", (10, 3), 148, 288,
       "HBM3e", 8.0, 2250.0, 4500.0, (r"(?<!G)B300",),
       "HGX B300 figures per GPU; SM count as enabled on B200 (the full die has 160)"),
    _g("gb300", (), "NVIDIA GB300 (per GPU)", "Blackwell Ultra", (10, 3), 148, 288, "HBM3e", 8.0, 2500.0,
       5000.0, (r"GB300",), "GB300 NVL72 figures divided by 72; SM count as for B300"),
    _g("rtx-pro-6000", ("rtx-pro-6000-blackwell", "rtx-pro-6000-server"), "NVIDIA RTX PRO 6000 Blackwell",
       "Blackwell", (12, 0), 188, 96, "GDDR7", 1.792, 503.8, 1007.6, (r"RTX PRO 6000",),
       "Workstation / Server Edition (the Max-Q edition clocks lower)"),
    _g("rtx5090", ("geforce-rtx-5090",), "NVIDIA GeForce RTX 5090", "Blackwell", (12, 0), 170, 32, "GDDR7",
       1.792, 209.5, 419.0, (r"RTX 5090",), "GeForce: FP32-accumulate rates"),
)


def _norm(text: str) -> str:
    return re.sub(r"[-_\s]", "", text.strip().lower())


_BY_NAME: dict[str, GpuSpec] = {_norm(n): g for g in GPU_TABLE for n in (g.key, *g.aliases)}
#: (pattern, row) with the longest (most specific) pattern first: "H100 PCIe" is tried before "H100"
_PATTERNS: tuple[tuple[re.Pattern[str], GpuSpec], ...] = tuple(
    (re.compile(p, re.IGNORECASE), g)
    for p, g in sorted(((p, g) for g in GPU_TABLE for p in g.device_names), key=lambda pg: -len(pg[0]))
)


def known_gpu_names() -> tuple[str, ...]:
    """Every key of :data:`GPU_TABLE`, in table order (aliases not included)."""
    return tuple(g.key for g in GPU_TABLE)


def gpu_spec(name: str) -> GpuSpec:
    """The row for a product key or alias (``"h200"``, ``"H200"``, ``"rtx_pro_6000"``, ``"RTX-5090"``).

    Raises TypeError for a non-string and ValueError naming the known keys for an unknown name.
    """
    if not isinstance(name, str):
        raise TypeError(f"gpu name: got {type(name).__name__}; supported str (one of {', '.join(known_gpu_names())})")
    row = _BY_NAME.get(_norm(name))
    if row is None:
        raise ValueError(f"gpu name: got {name!r}; supported {', '.join(known_gpu_names())} "
                         "(case, '-', '_' and spaces ignored)")
    return row


def gpu_spec_for_device_name(device_name: str) -> GpuSpec | None:
    """The row whose driver-name pattern matches ``device_name`` (``"NVIDIA H100 PCIe"`` -> ``h100-pcie``).

    The most specific pattern wins; None when no row matches (an unknown part: pass the peaks by hand).
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name: got {type(device_name).__name__}; supported str")
    for pattern, row in _PATTERNS:
        if pattern.search(device_name):
            return row
    return None
