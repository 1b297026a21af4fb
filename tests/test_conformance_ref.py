"""REF_TORCH passes the full conformance suite (cases from its declared capabilities), and so does a float64-only
variant's out=/lse_out= buffer check (the suite allocates LSE buffers in ``lse_dtype``)."""

from __future__ import annotations

import dataclasses

import torch

from mla_backends.core.dtypes import lse_dtype
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import BackendConformance, build_matrix
from mla_backends.testing.checks import check_out_rows_untouched, check_output


class TestRefTorchConformance(BackendConformance):
    backend = "REF_TORCH"
    quick = False
    device = "cpu"


class Float64OnlyRef(RefTorchBackend):
    """REF_TORCH declaring only float64 queries and cache: its LSE is float64 (``dtypes.lse_dtype``)."""

    name = "REF_TORCH_FLOAT64_ONLY"
    capabilities = dataclasses.replace(RefTorchBackend.capabilities, dtypes=frozenset({torch.float64}),
                                       kv_cache_dtypes=frozenset({"float64"}))


def test_a_float64_only_backend_passes_the_out_buffer_checks():
    # the suite's lse_out= buffers follow the LSE contract (lse_dtype(q dtype)), not a fixed float32
    matrix = build_matrix(Float64OnlyRef, quick=True)
    cpu = torch.device("cpu")
    assert matrix.guard and all(c.dtype == torch.float64 for c in matrix.guard + matrix.output)
    assert lse_dtype(torch.float64) == torch.float64
    for case in matrix.guard:
        check_out_rows_untouched(Float64OnlyRef, case, cpu)
    for case in [c for c in matrix.output if not c.rejected][:2]:
        check_output(Float64OnlyRef, case, cpu)
