"""The DeepSeek-V4 conformance cases (``mla_backends.testing.v4_cases``): REF_TORCH passes every case, TRITON_MLA
runs them through ``run_v4_cases``, a backend without V4 skips them with its reasons, and backends broken on
purpose fail the cases that name their fault."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends import RefTorchBackend
from mla_backends.backends.v4_inputs import V4Keys
from mla_backends.testing.v4_cases import V4_CASES, run_v4_cases


def _statuses(backend, cases=V4_CASES):
    return {r.case: (r.status, r.detail) for r in run_v4_cases(backend, cases=cases)}


def test_ref_torch_passes_every_v4_case():
    got = _statuses("REF_TORCH")
    assert set(got) == {c.name for c in V4_CASES}
    assert all(status == "passed" for status, _ in got.values()), got


def test_triton_mla_runs_the_v4_cases_through_run_v4_cases():
    """Through ``run_v4_cases`` (the conformance classes run every case through pytest: TRITON_MLA's in
    tests/test_conformance_triton.py and tests/test_triton_rows.py): a cheap case passes and, interpreted (a CPU),
    the records case (bf16 queries) is withheld as in the MLA cases, saying why: the interpreter truncates bf16
    (a -0.27 % slope the bias criterion catches). It is judged on a GPU, and its kernel path by
    tests/test_v4_records.py against a float64 reference of the stored values."""
    got = _statuses("TRITON_MLA", tuple(c for c in V4_CASES if c.name in ("window-1", "records")))
    assert got["window-1"][0] == "passed", got["window-1"]
    status, detail = got["records"]
    if torch.cuda.is_available():
        assert status == "passed", detail
    else:
        assert status == "skipped" and "dtype: got bfloat16" in detail, detail


def test_a_backend_without_v4_skips_them_saying_why():
    got = _statuses("FLASHINFER_MLA")
    for case in V4_CASES:
        status, detail = got[case.name]
        assert status == "skipped" and "sliding window: got required; supported none" in detail
        assert ("sinks: got required; supported none" in detail) == case.sinks


class _NoSink(RefTorchBackend):
    """Declares sinks and ignores them."""

    name = "V4_NO_SINK"

    def forward_mqa_kernel(self, *args, v4=None, **kw):
        return super().forward_mqa_kernel(*args, v4=dataclasses.replace(v4, sinks=None), **kw)


class _WindowOffByOne(RefTorchBackend):
    """Sees one position more than its window."""

    name = "V4_WINDOW_PLUS_ONE"

    def forward_mqa_kernel(self, *args, v4=None, **kw):
        return super().forward_mqa_kernel(*args, v4=dataclasses.replace(v4, window=v4.window + 1), **kw)


class _PaddingAsEntry0(RefTorchBackend):
    """Reads a padded pick (-1) as entry 0: sees entries before they are visible."""

    name = "V4_PADDING_AS_ENTRY_0"

    def forward_mqa_kernel(self, *args, v4: V4Keys | None = None, **kw):
        if v4 is not None and v4.compressed is not None:
            comp = dataclasses.replace(v4.compressed, indices=v4.compressed.indices.clamp_min(0))
            v4 = dataclasses.replace(v4, compressed=comp)
        return super().forward_mqa_kernel(*args, v4=v4, **kw)


@pytest.mark.parametrize(("broken", "must_fail", "must_pass"), [
    (_NoSink, {"window-1", "window-edges", "sinks"}, {"no-sinks"}),
    (_WindowOffByOne, {"window-1", "window-edges", "no-sinks"}, {"window-wider"}),
    (_PaddingAsEntry0, {"entry-visibility", "ratio-128"}, {"window-1", "window-edges", "window-wider"}),
])
def test_broken_backends_fail_the_cases_naming_their_fault(broken, must_fail, must_pass):
    got = _statuses(broken)
    failed = {name for name, (status, _) in got.items() if status == "failed"}
    assert must_fail <= failed and not must_pass & failed, got
