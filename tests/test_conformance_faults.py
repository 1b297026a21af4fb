"""The suite catches every fault of 1 % or more, in every dtype, with the right hint or none (issue 43).

The fault table (``mla_backends.testing.calibration``: each fault a one-change REF_TORCH subclass from
``mla_backends.testing.broken``, run through the suite's own output check on the quick matrix's decode sweep,
multi-token and one-head cases in float32, float16, bfloat16 and bf16 over an fp8 e4m3 cache) is computed once
for the module. ``docs/conformance.md`` holds the same table (``python -m mla_backends.testing.calibration
faults``); its verdicts and hints must be the ones computed here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mla_backends.testing import broken, calibration

pytestmark = pytest.mark.usefixtures("one_thread")
DOC = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"


@pytest.fixture(scope="module")
def table() -> list[calibration.Cell]:
    n = torch.get_num_threads()  # module fixtures are made before the tests' one_thread fixture
    torch.set_num_threads(1)
    try:
        return calibration.fault_table()
    finally:
        torch.set_num_threads(n)


def test_every_fault_row_is_a_broken_backend_and_every_column_runs(table) -> None:
    assert {f.backend for f in calibration.FAULTS} <= set(broken.FAULT_BACKENDS) | set(broken.BROKEN_BACKENDS)
    assert {c.column for c in table} == set(calibration.COLUMNS)
    assert all(len(c.outcomes) == 3 for c in table)


def test_every_fault_of_one_percent_or_more_is_caught_in_every_dtype(table) -> None:
    missed = [(c.fault.label, c.column, o.case, o.effect) for c in table for o in c.missed]
    assert not missed, missed


def test_no_fault_gets_a_wrong_hint(table) -> None:
    wrong = [(c.fault.label, c.column, h) for c in table for h in c.wrong_hints]
    assert not wrong, wrong


def test_each_fault_moves_the_result_where_it_applies(table) -> None:
    """The table means something only if the faults are real in each column: every fault moves some case by
    more than 1 % in every dtype, except the fp8 scale, which only an fp8 cache has."""
    for cell in table:
        fp8_only = cell.fault.backend is broken.IgnoresFp8ScaleBackend
        if fp8_only and not cell.column.startswith("fp8"):
            assert cell.effect == 0, (cell.fault.label, cell.column)
        else:
            assert cell.required, (cell.fault.label, cell.column, cell.effect)


def test_the_diagnosable_faults_are_diagnosed_somewhere(table) -> None:
    """A right hint is given for each fault that has one, in at least one case (none is always acceptable, but a
    hint machinery that never speaks would pass the test above)."""
    for fault in calibration.FAULTS:
        if fault.hints:
            given = [o.hint for c in table if c.fault is fault for o in c.outcomes if o.hint]
            assert any(fault.right(h) for h in given), (fault.label, given)


def _cells(text: str) -> list[list[str]]:
    """The table's rows with the numbers taken out (effects may move in a last digit between machines)."""
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return [[re.sub(r"[-+0-9.e]+ %|NaN|\b\d[\d.e+]*\b", "#", cell.strip()) for cell in row.split("|")[1:-1]]
            for row in rows]


def test_the_docs_show_this_table(table) -> None:
    doc = DOC.read_text()
    start = doc.index("<!-- fault-table -->")
    end = doc.index("<!-- /fault-table -->")
    assert _cells(doc[start:end]) == _cells(calibration.format_fault_table(table))
