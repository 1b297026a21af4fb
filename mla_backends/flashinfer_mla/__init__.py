"""FlashInfer MLA backends: ``FLASHINFER_MLA`` (fa2/fa3 paged wrapper), ``FLASHINFER_MLA_CUTLASS``,
``FLASHINFER_MLA_TRTLLM`` and ``FLASHINFER_MLA_XQA``.

Importing this package does not import flashinfer: each backend loads its kernels on its first
``forward_mqa``. Selection-time checks read the installed version from package metadata and the entry
points from the installed source files. See docs/flashinfer.md.
"""

from .paged import FlashInferCutlassMLABackend, FlashInferMLABackend
from .trtllm import FlashInferTrtllmMLABackend
from .xqa import FlashInferXqaMLABackend

__all__ = [
    "FlashInferMLABackend",
    "FlashInferCutlassMLABackend",
    "FlashInferTrtllmMLABackend",
    "FlashInferXqaMLABackend",
]
