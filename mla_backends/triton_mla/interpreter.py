"""The Triton interpreter switch, read in one place (a leaf module: no triton import, nothing of ours).

``TRITON_INTERPRET=1`` makes Triton run kernels on the CPU, for testing only. The backend reads it to accept CPU
tensors; :mod:`.kernels` reads it once at import, as Triton's ``@jit`` decorator does, to pick its workarounds.
"""

from __future__ import annotations

import os

__all__ = ["INTERPRET_ENV", "interpreter_enabled"]

#: the environment variable Triton reads to interpret kernels on the CPU
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU (testing only)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")
