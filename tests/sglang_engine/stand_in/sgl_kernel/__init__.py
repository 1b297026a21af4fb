"""A stand-in for SGLang's kernel package ``sgl_kernel``, for mla-backends' SGLang tests only.

Why it exists: SGLang 0.5.23 imports ``sgl_kernel`` at start-up even on its CPU engine, and no CPU build of that
package (``sgl-kernel`` / ``sglang-kernel``) is published: the index's builds are CUDA-only (sm90/sm100). For the
dense tiny DeepSeek models the tests run (no AMX, no quantisation), the CPU engine imports the names below (and the
submodules ``scalar_type`` and ``allreduce``) and calls none of them. This package provides exactly those names,
each one raising :class:`StandInKernelError` if it is ever called, so a test can never pass on a kernel that did
nothing.

It is a fixture under tests/sglang_engine, installed only into ``.venv-sglang`` by ``tools/sglang_env.sh``; it is
no part of mla-backends and is never shipped to users (on a GPU, SGLang's real kernel package is installed).
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+mla-backends-stand-in"
__all__: list[str] = []


class StandInKernelError(RuntimeError):
    """A name of the stand-in ``sgl_kernel`` was called: SGLang ran a CUDA kernel path on this CPU."""


def _absent(qualname: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise StandInKernelError(
            f"sgl_kernel.{qualname} was called, but this sgl_kernel is mla-backends' test stand-in "
            "(tests/sglang_engine/stand_in): no CPU build of SGLang's kernel package is published, and this "
            "stand-in only lets SGLang's CPU engine import. Install SGLang's real kernel package on a GPU.")

    call.__name__ = qualname.rsplit(".", 1)[-1]
    call.__qualname__ = qualname
    return call


def _provide(namespace: dict[str, Any], module: str, names: tuple[str, ...]) -> None:
    for name in names:
        namespace[name] = _absent(f"{module}.{name}" if module else name)
        namespace.setdefault("__all__", []).append(name)


#: the top-level names SGLang 0.5.23's CPU engine imports for a dense DeepSeek model (found by running it with an
#: import recorder in place of this package)
NAMES: tuple[str, ...] = ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                          "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu",
                          "copy_all_layer_kv_cache_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
                          "verify_tree_greedy_cpu")
_provide(globals(), "", NAMES)
