"""A stand-in for ``torchvision``, for mla-backends' SGLang tests only (installed into ``.venv-sglang`` with the
``sgl_kernel`` stand-in; see that package's docstring).

Why it exists: SGLang 0.5.23 imports ``torchvision.transforms`` and ``torchvision.io`` at start-up (its multimodal
configurations load with the package), but the index's torchvision builds are CUDA builds that fail to load
against the CPU torch SGLang's CPU engine runs on here (``operator torchvision::nms does not exist``). The text
models the tests run never use an image transform: this package provides the names SGLang imports, every callable
raising :class:`StandInError`. Its version, 0.0.0, tells transformers that no usable torchvision is installed for
its version-gated image paths.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0"


class StandInError(RuntimeError):
    """A name of the stand-in torchvision was called: an image path ran in the SGLang tests."""


def absent(qualname: str) -> Any:
    """A callable named ``qualname`` that raises :class:`StandInError`."""

    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise StandInError(f"torchvision.{qualname} was called, but this torchvision is mla-backends' test stand-in "
                           "(tests/sglang_engine/stand_in): no image path runs in the SGLang tests")

    call.__name__ = qualname.rsplit(".", 1)[-1]
    call.__qualname__ = qualname
    return call
