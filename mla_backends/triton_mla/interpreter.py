"""The Triton interpreter switch, read in one place (no triton import).

``TRITON_INTERPRET=1`` makes Triton run kernels on the CPU, for testing only. The backend reads it to accept CPU
tensors; :mod:`.kernels` reads it once at import, as Triton's ``@jit`` decorator does, to pick its workarounds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..backends.capabilities import env_switch_on
from ..core.host_sync import host_sync_allowed

__all__ = ["INTERPRET_ENV", "interpreter_enabled", "INTERPRETER_LOCK", "launch_guard"]

#: one process-wide lock around every interpreted launch: Triton's interpreter is not thread-safe (its grid
#: state is module-global and it copies arguments to the host and back), so interpreted launches run one at
#: a time; compiled launches take no lock
INTERPRETER_LOCK = threading.Lock()

#: the environment variable Triton reads to interpret kernels on the CPU
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU (testing only)."""
    return env_switch_on(INTERPRET_ENV)


@contextlib.contextmanager
def launch_guard(interpreted: bool) -> Iterator[None]:
    """Wrap one kernel launch: interpreted launches hold :data:`INTERPRETER_LOCK` and pause
    :func:`~mla_backends.core.host_sync.no_host_sync` (the interpreter copies to the host by design); compiled
    launches pass straight through."""
    if not interpreted:
        yield
        return
    with INTERPRETER_LOCK, host_sync_allowed():
        yield
