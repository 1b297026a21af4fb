"""Project-wide test set-up.

Without CUDA, Triton kernels can only run under the interpreter, and ``TRITON_INTERPRET`` must be set before
any ``@triton.jit`` module is imported, so it is set here, first. Tests that check the selector's behaviour
without the interpreter remove it with ``monkeypatch.delenv``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache"))
