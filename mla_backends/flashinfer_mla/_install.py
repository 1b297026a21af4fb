"""What is installed: the flashinfer-python version and the entry points its source defines.

Nothing here imports flashinfer (importing it takes seconds and initialises CUDA-side state). The version
comes from the package metadata; the presence of an entry point is read from the installed source files,
located with ``importlib.util.find_spec``. Results are cached for the life of the process; tests reset them
with :func:`clear_caches`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from ..backends.reasons import Reason, ReasonKind

__all__ = [
    "DISTRIBUTION",
    "MIN_VERSION",
    "MAX_VERSION_EXCLUSIVE",
    "TESTED_RANGE_TEXT",
    "NOT_INSTALLED_REASON",
    "installed_version",
    "parse_version",
    "version_reasons",
    "source_defines",
    "clear_caches",
]

#: the PyPI distribution that provides the ``flashinfer`` module
DISTRIBUTION = "flashinfer-python"
#: oldest release whose API this package is written against (``MLAPlanMetadata``, structural
#: ``query=``/``kv_cache=`` inputs, ``lse_mode``, ``return_lse_base``): the one verified here
MIN_VERSION: tuple[int, int, int] = (0, 7, 4)
#: first release outside the tested range (FlashInfer changes MLA keywords between minor releases)
MAX_VERSION_EXCLUSIVE: tuple[int, int, int] = (0, 8, 0)
TESTED_RANGE_TEXT = ">=0.7.4,<0.8.0"
NOT_INSTALLED_REASON = "package: flashinfer-python is not installed: pip install 'mla-backends[flashinfer]'"


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"0.7.4"`` / ``"0.7.4.post1"`` / ``"0.8.0rc1"`` -> ``(0, 7, 4)`` ...; None when unparseable."""
    m = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)


@functools.lru_cache(maxsize=1)
def installed_version() -> str | None:
    """The installed flashinfer-python version string, or None when the distribution is absent."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_reasons(version: str | None) -> list[Reason]:
    """Reasons (kind ``VERSION``) a flashinfer-python version is unusable (empty inside the tested range)."""
    what = "flashinfer-python version"
    if version is None:
        return [Reason(ReasonKind.VERSION, what, "unknown (no package metadata)", TESTED_RANGE_TEXT)]
    parsed = parse_version(version)
    if parsed is None:
        return [Reason(ReasonKind.VERSION, what, f"{version!r} (unparseable)", TESTED_RANGE_TEXT)]
    if parsed < MIN_VERSION:
        return [Reason(ReasonKind.VERSION, what, version,
                       f"{TESTED_RANGE_TEXT} (older releases lack the MLA API used here)")]
    if parsed >= MAX_VERSION_EXCLUSIVE:
        return [Reason(ReasonKind.VERSION, what, version, f"{TESTED_RANGE_TEXT} (newer releases are untested)")]
    return []


@functools.lru_cache(maxsize=1)
def _package_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=64)
def source_defines(relative_path: str, name: str) -> bool:
    """True when the installed ``flashinfer/<relative_path>`` defines or re-exports ``name``.

    Reads the file as text (no import): a ``def name(``, ``class name``, or ``name as name``/``import name``
    occurrence counts. False when flashinfer or the file is missing.
    """
    root = _package_dir()
    if root is None:
        return False
    path = root / relative_path
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    if name not in text:  # cheap pre-check: the regex below is slow on large files
        return False
    n = re.escape(name)
    pattern = rf"(^\s*(async\s+)?def\s+{n}\s*\()|(^\s*class\s+{n}\b)|(\b{n}\s+as\s+{n}\b)"
    return re.search(pattern, text, flags=re.MULTILINE) is not None


def clear_caches() -> None:
    """Forget cached answers (tests that monkeypatch the version or the package location call this)."""
    installed_version.cache_clear()
    _package_dir.cache_clear()
    source_defines.cache_clear()
