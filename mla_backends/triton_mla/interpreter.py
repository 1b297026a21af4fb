"""The Triton interpreter switch, read in one place (no triton import).

``TRITON_INTERPRET=1`` makes Triton run kernels on the CPU, for testing only. The backend reads it to accept CPU
tensors; :mod:`.kernels` reads it once at import, as Triton's ``@jit`` decorator does, to pick its workarounds.
"""

from __future__ import annotations

from ..capabilities import env_switch_on

__all__ = ["INTERPRET_ENV", "interpreter_enabled"]

#: the environment variable Triton reads to interpret kernels on the CPU
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU (testing only)."""
    return env_switch_on(INTERPRET_ENV)
