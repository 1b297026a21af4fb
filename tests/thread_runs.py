"""Running a test's target in a thread of its own, bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_thread(target: Callable[[], None], name: str | None = None, timeout: float = 60.0) -> list[BaseException]:
    """Run ``target`` in a new thread (so the test's own thread keeps no per-thread state) and return what it
    raised (empty when nothing); the thread must end within ``timeout`` seconds."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors.append(e)

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join(timeout=timeout)
    assert not t.is_alive(), f"thread {name or t.name} did not end within {timeout:g} s"
    return errors
