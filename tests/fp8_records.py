"""DeepSeek's fp8 cache records written and read plainly, token by token, from vLLM's writers' source (not from
``mla_backends.step.records``): the byte-level reference of the record tests.

- V4 (``quantize_and_insert_k_cache`` in ``vllm/models/deepseek_v4/common/ops/cache_utils.py``, "same as the
  CUDA kernel"): per token 448 fp8 values, one scale per 64 of them, ``scale = 2 ** ceil(log2(max(amax, 1e-4) /
  448))`` stored as the byte ``exponent + 127``, values ``value / scale`` clamped to +-448 and rounded to e4m3,
  then the 64 rotated values as bf16; a page holds every token's 576 data bytes, then every token's 8 scale bytes
  (the 8th is 0), and is rounded up to a multiple of 576 bytes.
- V3.2 ``fp8_ds_mla`` (``concat_and_cache_ds_mla_kernel`` in vLLM's ``csrc/cache_kernels.cu``, CUDA only): per
  token 512 fp8 values, 4 float32 scales ``max(amax / 448, FLT_MIN)`` (one per 128), the 64 rope values as bf16,
  656 bytes one after another.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FP8_MAX = 448.0


def _e4m3_bytes(values: np.ndarray) -> list[int]:
    """float32 values (already within +-448) -> e4m3 bytes, round to nearest even (torch's conversion)."""
    return torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def ue8m0_exponent(amax: float) -> int:
    """``ceil(log2(max(amax, 1e-4) / 448))``, the division in float32 as the writer does it, the ceiling exact."""
    s = float(np.float32(max(np.float32(amax), np.float32(1e-4))) / np.float32(FP8_MAX))
    mant, exp = math.frexp(s)
    return exp - 1 if mant == 0.5 else exp


def v4_page_bytes(rows: dict[int, torch.Tensor], block_size: int) -> bytes:
    """``{position in the page: row [512]}`` (bf16 values) written to one V4 page: the page's bytes (positions
    not given stay zero)."""
    page = bytearray(-(-block_size * 584 // 576) * 576)
    for pos, row_t in rows.items():
        row = row_t.to(torch.float32).numpy()
        for g in range(7):
            vals = row[64 * g: 64 * g + 64]
            e = ue8m0_exponent(float(np.abs(vals).max()))
            q = np.clip(vals / np.float32(2.0 ** e), -FP8_MAX, FP8_MAX)
            page[pos * 576 + 64 * g: pos * 576 + 64 * g + 64] = bytes(_e4m3_bytes(q))
            page[block_size * 576 + pos * 8 + g] = e + 127
        page[pos * 576 + 448: pos * 576 + 576] = row_t[448:].to(torch.bfloat16).contiguous().view(
            torch.uint8).numpy().tobytes()
    return bytes(page)


def dsmla_record(row: torch.Tensor) -> bytes:
    """One V3.2 record from a row ``[576]`` (bf16 values: 512 latent, 64 rope)."""
    x = row.to(torch.float32).numpy()
    out = bytearray(656)
    for t in range(4):
        vals = x[128 * t: 128 * t + 128]
        s = max(np.float32(np.abs(vals).max()) / np.float32(FP8_MAX), np.finfo(np.float32).tiny)
        s = np.float32(s)
        out[128 * t: 128 * t + 128] = bytes(_e4m3_bytes(np.clip(vals / s, -FP8_MAX, FP8_MAX)))
        out[512 + 4 * t: 516 + 4 * t] = np.array([s], dtype=np.float32).tobytes()
    out[528:656] = row[512:].to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(out)


def decode_v4_row(page: bytes, pos: int, block_size: int) -> torch.Tensor:
    """Row ``pos`` of a V4 page as float64 values ``[512]``."""
    data = torch.frombuffer(bytearray(page[pos * 576: pos * 576 + 576]), dtype=torch.uint8)
    fp8 = data[:448].view(torch.float8_e4m3fn).double().view(7, 64)
    scales = torch.tensor([2.0 ** (page[block_size * 576 + pos * 8 + g] - 127) for g in range(7)],
                          dtype=torch.float64)
    return torch.cat([(fp8 * scales[:, None]).reshape(448), data[448:].view(torch.bfloat16).double()])


def decode_dsmla_record(rec: bytes) -> torch.Tensor:
    """One V3.2 record as float64 values ``[576]``."""
    data = torch.frombuffer(bytearray(rec), dtype=torch.uint8)
    fp8 = data[:512].view(torch.float8_e4m3fn).double().view(4, 128)
    scales = data[512:528].view(torch.float32).double()
    return torch.cat([(fp8 * scales[:, None]).reshape(512), data[528:].view(torch.bfloat16).double()])
