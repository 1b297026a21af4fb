"""A one-line progress bar for long work (tuning sweeps, loading every layer of a checkpoint)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """A one-line progress bar on stderr (redrawn with ``\\r``); silent when disabled."""

    def __init__(
        self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()

    def update(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(self.width * frac)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {label:<36}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
