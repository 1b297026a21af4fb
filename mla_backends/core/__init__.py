"""The foundation every other layer builds on: MLA shapes (``dims``), dtype names (``dtypes``), RoPE (``rope``),
input checks (``validation``), the error shape (``errors``), the shared attention math (``attention_math``),
device descriptions and the GPU table (``device``, ``gpus``), config reads (``config_fields``), memory checks
(``memory``), the progress bar (``progress``) and the host-sync guard (``host_sync``).

Imports: torch and the standard library only, and each other; nothing above.
"""
