"""Where test cases put their tensors: CUDA when it can run compiled kernels there, else the CPU.

On a machine with CUDA and no ``TRITON_INTERPRET`` the Triton cases run on the GPU with compiled kernels; on a
CPU machine (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) they run interpreted on the CPU. No GPU check
can then fail just because a case built CPU tensors. ``tests/test_case_device.py`` proves the choice.
"""

from __future__ import annotations

import os

import torch

__all__ = ["case_device"]


def case_device() -> str:
    """``"cuda"`` when ``torch.cuda.is_available()`` and ``TRITON_INTERPRET`` is unset (or ``0``), else ``"cpu"``."""
    interpret = os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0")
    return "cuda" if torch.cuda.is_available() and not interpret else "cpu"
