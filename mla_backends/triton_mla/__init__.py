"""``TRITON_MLA``: split-KV paged MLA decode in Triton (the portable GPU backend).

Importing this package does not import triton; the kernels load on the first ``forward_mqa`` call.
"""

from .backend import TritonMLABackend, interpreter_enabled
from .splits import SCRATCH, choose_num_kv_splits

__all__ = ["TritonMLABackend", "choose_num_kv_splits", "interpreter_enabled", "SCRATCH"]
