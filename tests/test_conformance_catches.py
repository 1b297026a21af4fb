"""Proof that the conformance suite can fail: it reports every deliberately broken backend.

The real suite runs (``pytest.main`` on a generated module of ``BackendConformance`` subclasses, one per
broken backend from :mod:`mla_backends.testing.broken`, plus an unbroken control) and each broken backend must
fail the check that names its bug. A few checks are also called directly to pin their diagnostics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import broken, build_matrix, checks

# class in the generated module -> (broken backend, tests to run (-k), the test that must fail)
EXPECTED = {
    "TestNextPage": ("NextPageBackend", "output and ctx", "test_output_matches_reference"),
    "TestLatentScale": ("LatentScaleBackend", "output and ctx", "test_output_matches_reference"),
    "TestAbsorbedWidthScale": ("AbsorbedWidthScaleBackend", "output and ctx", "test_output_matches_reference"),
    "TestNoMscale": ("NoMscaleBackend", "output and ctx", "test_output_matches_reference"),
    "TestLog2eScale": ("Log2eScaleBackend", "output and ctx", "test_output_matches_reference"),
    "TestBase2Lse": ("Base2LseBackend", "output and (ctx or heads)", "test_output_matches_reference"),
    "TestIgnoresFp8Scale": (
        "IgnoresFp8ScaleBackend",
        "output and (fp8 or ctx)",
        "test_output_matches_reference",
    ),
    "TestWritesCache": ("WritesCacheBackend", "inputs_not_written", "test_inputs_not_written"),
    "TestWritesPastOut": ("WritesPastOutBackend", "out_rows", "test_out_rows_outside_batch_untouched"),
    "TestNondeterministic": ("NondeterministicBackend", "deterministic", "test_deterministic"),
    "TestPaddedHeads": ("PaddedHeadsBackend", "output and ctx", "test_output_matches_reference"),
    "TestLyingDeclarations": (
        "LyingDeclarationsBackend",
        "declared or undeclared",
        "test_undeclared_combinations_rejected",
    ),
    "TestHostSync": ("HostSyncBackend", "no_host_sync", "test_no_host_sync"),
    # a base-2 LSE weights the shares of a context split wrongly, so their merge misses the reference
    "TestBase2LseSplit": ("Base2LseBackend", "context_split", "test_context_split_merge"),
}


class _Recorder:
    """Collects the outcome and failure text of every test phase."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.reports[report.nodeid] = (report.outcome, report.longreprtext)


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    root: Path = tmp_path_factory.mktemp("broken_suite")
    lines = ["from mla_backends.testing import BackendConformance, broken", ""]
    selections = []
    for cls_name, (backend, k, _) in EXPECTED.items():
        lines += [
            f"class {cls_name}(BackendConformance):",
            f"    backend = broken.{backend}",
            "    quick = True",
            '    device = "cpu"',
            "",
        ]
        selections.append(f"({cls_name} and ({k}))")
    lines += [
        "class TestControl(BackendConformance):",
        '    backend = "REF_TORCH"',
        "    quick = True",
        '    device = "cpu"',
        "",
    ]
    selections.append(
        "(TestControl and (output_matches and ctx or inputs or out_rows or deterministic or declared))"
    )
    module = root / "test_generated_broken.py"
    module.write_text("\n".join(lines))
    recorder = _Recorder()
    threads = torch.get_num_threads()  # a module fixture runs before the tests' own thread settings
    torch.set_num_threads(1)  # small kernels on a loaded 2-core machine: hand-offs cost more than they win
    try:
        code = _run(module, root, selections, recorder)
    finally:
        torch.set_num_threads(threads)
    assert code in (0, 1), f"the generated suite did not run (exit {code})"
    return recorder.reports


def _run(module: Path, root: Path, selections: list[str], recorder: _Recorder) -> int:
    return pytest.main(
        [
            str(module),
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "-o",
            "addopts=",
            "--rootdir",
            str(root),
            "-k",
            " or ".join(selections),
        ],
        plugins=[recorder],
    )


def _of(results: dict[str, tuple[str, str]], cls_name: str) -> dict[str, tuple[str, str]]:
    return {k.split("::", 2)[2]: v for k, v in results.items() if f"::{cls_name}::" in k}


@pytest.mark.parametrize("cls_name", sorted(EXPECTED))
def test_suite_reports_broken_backend(suite_results: dict[str, tuple[str, str]], cls_name: str) -> None:
    _, _, must_fail = EXPECTED[cls_name]
    results = _of(suite_results, cls_name)
    assert results, f"no tests of {cls_name} ran"
    failed = [name for name, (outcome, _) in results.items() if outcome == "failed"]
    assert any(name.startswith(must_fail) for name in failed), (
        f"{cls_name}: expected {must_fail} to fail; outcomes: {[(n, o) for n, (o, _) in results.items()]}"
    )


def test_control_passes_the_same_checks(suite_results: dict[str, tuple[str, str]]) -> None:
    results = _of(suite_results, "TestControl")
    assert len(results) >= 5
    assert all(outcome == "passed" for outcome, _ in results.values()), results


def test_padded_heads_is_caught_by_the_base_class_naming_the_backend(
        suite_results: dict[str, tuple[str, str]]) -> None:
    texts = [text for outcome, text in _of(suite_results, "TestPaddedHeads").values() if outcome == "failed"]
    assert texts and all("BROKEN_PADDED_HEADS broke the forward_mqa contract" in t for t in texts), texts


def test_every_broken_backend_is_exercised() -> None:
    assert {b for b, _, _ in EXPECTED.values()} == {c.__name__ for c in broken.BROKEN_BACKENDS}


def test_base2_lse_is_reported_as_lse_not_output(suite_results: dict[str, tuple[str, str]]) -> None:
    texts = [text for outcome, text in _of(suite_results, "TestBase2Lse").values() if outcome == "failed"]
    assert texts and all("LSE (natural log)" in t for t in texts)
    assert all("output (latent space)" not in t.split("AssertionError")[-1] for t in texts)
    assert any("base-2" in t for t in texts)


# each softmax-scale mistake -> words its hint must contain (the hint is only given when the recomputed
# reference under that mistake matches the backend's output, so it names the mistake, not a guess)
SCALE_HINTS = {
    "TestLatentScale": "kv_lora_rank ** -0.5 = ",
    "TestAbsorbedWidthScale": "(kv_lora_rank + qk_rope_head_dim) ** -0.5 = ",
    "TestNoMscale": "missing DeepSeek-YaRN's mscale ** 2",
    "TestLog2eScale": "off by a constant factor 1.443 = log2(e)",
}


@pytest.mark.parametrize("cls_name", sorted(SCALE_HINTS))
def test_scale_mistakes_get_a_hint_naming_the_mistake(suite_results: dict[str, tuple[str, str]],
                                                      cls_name: str) -> None:
    texts = [text for outcome, text in _of(suite_results, cls_name).values() if outcome == "failed"]
    assert texts, f"{cls_name}: no failure to read"
    for text in texts:
        assert "output (latent space)" in text and SCALE_HINTS[cls_name] in text, text[-600:]
        others = [h for c, h in SCALE_HINTS.items() if c != cls_name and h not in SCALE_HINTS[cls_name]]
        assert not any(h in text for h in others), text[-600:]


def test_no_scale_hint_for_a_mistake_that_is_not_a_scale(suite_results: dict[str, tuple[str, str]]) -> None:
    texts = [text for outcome, text in _of(suite_results, "TestNextPage").values() if outcome == "failed"]
    assert texts and not any("softmax scale" in t for t in texts)


def test_fp8_scale_bug_fails_exactly_the_fp8_cases(suite_results: dict[str, tuple[str, str]]) -> None:
    results = _of(suite_results, "TestIgnoresFp8Scale")
    fp8 = {n: o for n, (o, _) in results.items() if "fp8" in n}
    other = {n: o for n, (o, _) in results.items() if "fp8" not in n}
    assert fp8 and all(o == "failed" for o in fp8.values()), fp8
    assert other and all(o == "passed" for o in other.values()), other


def test_guard_bugs_leave_the_output_correct(suite_results: dict[str, tuple[str, str]]) -> None:
    """The cache writer and the past-the-end writer compute the right values: only the guard checks fail."""
    for cls_name in ("TestWritesCache", "TestWritesPastOut"):
        texts = [t for o, t in _of(suite_results, cls_name).values() if o == "failed"]
        assert texts and not any("output (latent space)" in t for t in texts), cls_name
    assert any("cache.data" in t for o, t in _of(suite_results, "TestWritesCache").values() if o == "failed")


def test_checks_raise_assertion_error_directly() -> None:
    """The check functions are usable without pytest collection and raise AssertionError with a diagnosis."""
    matrix = build_matrix(RefTorchBackend, True)
    case = matrix.guard[0]
    cpu = torch.device("cpu")
    checks.check_output(RefTorchBackend, case, cpu)
    with pytest.raises(AssertionError, match=r"output \(latent space\).*worst element at index"):
        checks.check_output(broken.LatentScaleBackend, case, cpu)
    with pytest.raises(AssertionError, match="differ bitwise"):
        checks.check_deterministic(broken.NondeterministicBackend, matrix.determinism[0], cpu)


def test_reference_is_independent_of_ref_torch() -> None:
    """The suite's reference module imports no backend code."""
    import mla_backends.testing.reference as ref

    source = Path(ref.__file__).read_text()
    assert "ref_torch" not in source and "forward_mqa(" not in source
