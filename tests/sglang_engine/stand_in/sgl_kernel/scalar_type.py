"""``sgl_kernel.scalar_type`` of the stand-in (see the package docstring): SGLang's quantisation modules read the
four ``scalar_types`` members below at import time to build lookup tables; nothing here is a working type."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ScalarType", "scalar_types"]


@dataclass(frozen=True)
class ScalarType:
    """A name only: the stand-in's quantised types carry no layout (no quantised model runs on it)."""

    name: str


class scalar_types:  # noqa: N801 - the name SGLang imports
    """The members SGLang 0.5.23's CPU engine reads at import time."""

    uint4 = ScalarType("uint4")
    uint4b8 = ScalarType("uint4b8")
    uint8 = ScalarType("uint8")
    uint8b128 = ScalarType("uint8b128")
