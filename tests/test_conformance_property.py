"""The property run (``--seeds N``): random cases drawn inside a backend's declarations, from seeds alone.

A random case depends on its seed and the declarations, never on the backend's name; a failed one names the
command line that reruns it; the quick matrix always holds two requests of equal length side by side, so a
batching bug that answers request ``i`` with request ``i + 1``'s context is caught on every run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.cli import main
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.testing import broken, build_matrix, checks
from mla_backends.testing.cases import declared_reasons
from mla_backends.testing.matrix import PROPERTY_CASES, PROPERTY_ROW_BUDGET, PROPERTY_SEED, _Builder
from mla_backends.testing.peers.vllm_peers import VllmCpuMLADecode, VllmTritonMLADecode
from mla_backends.triton_mla import TritonMLABackend

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.mark.parametrize("cls", [RefTorchBackend, TritonMLABackend.interpreted(), VllmTritonMLADecode.interpreted(),
                                 VllmCpuMLADecode])
def test_random_cases_stay_inside_the_declarations(cls) -> None:
    props = [c for c in build_matrix(cls, True).output if c.name.startswith("prop")]
    assert len(props) == PROPERTY_CASES and [c.draw for c in props] == list(range(PROPERTY_SEED,
                                                                                  PROPERTY_SEED + PROPERTY_CASES))
    assert not [c for c in build_matrix(cls, False).output if c.name.startswith("prop")]  # quick only by default
    drawn = build_matrix(cls, False, seeds=24, seed=5).output
    props += [c for c in drawn if c.name.startswith("prop")]
    for c in props:
        assert not declared_reasons(cls, c.spec())  # accepted on the (simulated) device it was placed on
        assert cls.capabilities.page_size_reason(c.block_size) is None
        assert c.dtype in cls.capabilities.dtypes and c.kv_cache_dtype in cls.capabilities.kv_cache_dtypes
        assert sum(c.seq_lens) * c.num_heads <= PROPERTY_ROW_BUDGET
        assert all(s >= q >= 1 for s, q in zip(c.seq_lens, c.query_lens, strict=True))
    # shapes vary: page sizes, head counts, batch sizes, dtypes
    assert len({(c.block_size, c.num_heads, len(c.seq_lens), c.dtype, c.kv_cache_dtype) for c in props}) > 8


def test_random_cases_depend_on_the_seed_not_on_the_backend_name() -> None:
    renamed = type("Renamed", (RefTorchBackend,), {"name": "SOMETHING_ELSE"})
    a = build_matrix(RefTorchBackend, False, seeds=6, seed=40).output
    b = build_matrix(renamed, False, seeds=6, seed=40).output
    assert [c.id for c in a] == [c.id for c in b] and [c.seq_lens for c in a] == [c.seq_lens for c in b]
    again = _Builder(RefTorchBackend, False).property_cases(range(40, 46))
    assert [c.id for c in again] == [c.id for c in a if c.draw is not None]
    other = build_matrix(RefTorchBackend, False, seeds=6, seed=46).output
    assert {c.id for c in other if c.draw} != {c.id for c in a if c.draw}
    # one seed alone is the same case as in a longer run (what the reproduction line relies on)
    (alone,) = [c for c in build_matrix(RefTorchBackend, False, seeds=1, seed=43).output if c.draw]
    assert alone == next(c for c in a if c.draw == 43)


def test_seeds_are_validated() -> None:
    with pytest.raises(ValueError, match="seeds: got -1; supported an int >= 0"):
        build_matrix(RefTorchBackend, True, seeds=-1)
    with pytest.raises(ValueError, match="seed: got 'x'"):
        build_matrix(RefTorchBackend, True, seeds=2, seed="x")


def _equal_neighbours(case) -> bool:
    pairs = list(zip(case.seq_lens, case.query_lens, strict=True))
    return any(a == b for a, b in zip(pairs, pairs[1:], strict=False))


@pytest.mark.parametrize("cls", [RefTorchBackend, TritonMLABackend.interpreted(), VllmTritonMLADecode.interpreted(),
                                 VllmCpuMLADecode])
def test_the_quick_matrix_always_holds_requests_of_equal_length_side_by_side(cls) -> None:
    quick = [c for c in build_matrix(cls, True, seeds=0).output if not c.rejected]
    assert any(_equal_neighbours(c) for c in quick)


def test_a_batching_bug_on_equal_lengths_fails_the_quick_matrix_without_random_help() -> None:
    quick = [c for c in build_matrix(RefTorchBackend, True, seeds=0).output if _equal_neighbours(c) and not c.topk]
    case = min(quick, key=lambda c: sum(c.seq_lens) * c.num_heads)
    with pytest.raises(checks.ComparisonFailure):
        checks.check_output(broken.NextRequestBackend, case, CPU)
    distinct = dataclasses.replace(case, seq_lens=tuple(s + i for i, s in enumerate(case.seq_lens)))
    checks.check_output(broken.NextRequestBackend, distinct, CPU)  # the bug hides without an equal pair


def test_random_cases_pass_a_correct_backend_and_catch_a_wrong_page_walk() -> None:
    props = [c for c in build_matrix(RefTorchBackend, False, seeds=8, seed=11).output if c.draw is not None]
    for case in props:
        checks.check_output(RefTorchBackend, case, CPU)
    case = min((c for c in props if any(s > c.block_size for s in c.seq_lens)),
               key=lambda c: sum(c.seq_lens) * c.num_heads)
    with pytest.raises(AssertionError, match=rf"drawn from seed {case.draw}: rerun with --seeds 1 --seed"):
        checks.check_output(broken.NextPageBackend, case, CPU)


def test_a_failed_random_case_prints_the_command_that_reruns_it(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["conformance", "mla_backends.testing.broken:NextPageBackend", "--seeds", "2", "--seed", "11",
                 "--device", "cpu", "--", "-q", "-k", "output_matches and prop"])
    out = capsys.readouterr()
    assert code == 1
    assert ("reproduce: mla-backends conformance mla_backends.testing.broken:NextPageBackend --seeds 1 --seed 1"
            in out.out + out.err)


@pytest.mark.parametrize("argv, words", [
    (["conformance", "REF_TORCH", "--seed", "3"], "--seed: got it without --seeds"),
    (["conformance", "REF_TORCH", "--seeds", "-2"], "--seeds: got -2; supported an int >= 0"),
])
def test_seed_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert words in captured.out + captured.err and "Traceback" not in captured.out + captured.err
