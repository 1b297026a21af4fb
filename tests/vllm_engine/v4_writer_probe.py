"""Run vLLM's own DeepSeek-V4 cache writer kernel (``quantize_and_insert_k_kernel`` of
``vllm/models/deepseek_v4/common/ops/cache_utils.py``) on the CPU under Triton's interpreter.

    TRITON_INTERPRET=1 python v4_writer_probe.py IN.pt OUT.pt

``IN.pt`` holds ``{"k": [n, 512] bf16, "slots": [n] int64, "num_blocks": int, "block_size": int}``; ``OUT.pt``
gets the cache bytes ``[num_blocks, page_bytes]`` uint8 the kernel wrote. vLLM disables Triton on a CPU (its
``triton_utils`` placeholders), so the kernel's source is read from vLLM's file and compiled here by Triton's
interpreter unchanged. One interpreter fault is mended: its float -> fp8 e4m3 conversion rounds half up and
loses the carry (``triton/runtime/interpreter.py``, ``_convert_float``); GPUs convert with ``cvt.rn.satfinite``
(round to nearest even, saturating), which torch's conversion matches for the clamped values the kernel passes.
"""

from __future__ import annotations

import ast
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its own @jit helpers must be interpreted

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def vllm_writer_kernel():
    """vLLM's kernel function, compiled by Triton's interpreter from vLLM's source."""
    import vllm.models.deepseek_v4.common.ops.cache_utils as cache_utils

    with open(cache_utils.__file__) as f:
        source = f.read()
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "quantize_and_insert_k_kernel")
    fn.decorator_list = []  # vLLM's decorator is its CPU placeholder; the interpreter wraps the function below
    namespace = {"triton": triton, "tl": tl}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), cache_utils.__file__, "exec"), namespace)
    return interpreter.InterpretedFunction(namespace["quantize_and_insert_k_kernel"])


def _round_to_e4m3(self, src, dst_type, rounding_mode, _orig=interpreter.InterpreterBuilder.create_fp_to_fp):
    if dst_type.scalar != tl.float8e4nv:
        return _orig(self, src, dst_type, rounding_mode)
    data = src.data
    if src.dtype.scalar == tl.bfloat16:  # held as uint16 bits
        data = (data.astype(np.uint32) << 16).view(np.float32)
    t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.float8_e4m3fn).view(torch.uint8)
    return interpreter.TensorHandle(t.numpy(), dst_type.scalar)


def main(argv: list[str]) -> int:
    inputs = torch.load(argv[1])
    k, slots, bs = inputs["k"], inputs["slots"], int(inputs["block_size"])
    page = -(-bs * 584 // 576) * 576
    cache = torch.zeros(int(inputs["num_blocks"]), page, dtype=torch.uint8)
    interpreter.InterpreterBuilder.create_fp_to_fp = _round_to_e4m3
    kernel = vllm_writer_kernel()
    n = int(slots.shape[0])
    kernel[(n,)](k, slots, cache, n, input_dim=512, fp8_dim=448, bf16_dim=64, scale_dim=8, quant_block=64,
                 cache_block_size=bs, token_data_size=576, block_stride=cache.stride(0),
                 fp8_max=float(torch.finfo(torch.float8_e4m3fn).max), n_quant_blocks=8)
    torch.save(cache, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
