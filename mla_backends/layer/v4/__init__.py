"""DeepSeek-V4 attention on mla-backends: the layer (``attention``: :class:`V4Attention`), its stores
(``cache``: :class:`V4LayerCache`), the gated compressor and the CSA indexer (``compressor``) and its weights
(``weights``). The step's tables are planned in :mod:`mla_backends.step.v4`; the attention itself is the
backends' ``forward_mqa`` with sinks, a window and compressed keys (:mod:`mla_backends.backends.v4_inputs`).
"""

from __future__ import annotations

from .attention import V4Attention
from .cache import PLAIN_ROWS, CompressorStateCache, RowFormat, V4LayerCache

__all__ = ["V4Attention", "V4LayerCache", "CompressorStateCache", "RowFormat", "PLAIN_ROWS"]
