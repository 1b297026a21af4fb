"""Where test cases put their tensors: CUDA when it can run compiled kernels there, else the CPU.

On a machine with CUDA and no ``TRITON_INTERPRET`` the Triton cases run on the GPU with compiled kernels; on a
CPU machine (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) they run interpreted on the CPU. No GPU check
can then fail just because a case built CPU tensors. ``tests/test_case_device.py`` proves the choice.
"""

from __future__ import annotations

import torch

from mla_backends.core.env_switches import TRITON_INTERPRET_SWITCH, switch_on

__all__ = ["case_device"]


def case_device() -> str:
    """``"cuda"`` when ``torch.cuda.is_available()`` and the switch ``TRITON_INTERPRET`` is off, else ``"cpu"``."""
    interpret = switch_on(TRITON_INTERPRET_SWITCH)
    return "cuda" if torch.cuda.is_available() and not interpret else "cpu"
