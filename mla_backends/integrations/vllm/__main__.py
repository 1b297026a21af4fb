"""``python -m mla_backends.integrations.vllm serve MODEL ...``: vLLM's CLI (see :mod:`.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
