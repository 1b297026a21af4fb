"""docs/selection.md is generated from the data; it must match."""

from __future__ import annotations

from docgen.selection import DOC_PATH, main, render_selection_doc
from selector.ladders import LADDERS


def test_selection_doc_matches_the_data():
    assert DOC_PATH.exists(), "run: python -m docgen.selection"
    stale = "docs/selection.md is stale: run python -m docgen.selection"
    assert DOC_PATH.read_text() == render_selection_doc(), stale


def test_doc_contains_every_ladder_and_the_check_mode_fails_on_drift(tmp_path):
    text = render_selection_doc()
    for lad in LADDERS:
        assert f"### {lad.family} " in text and lad.why in text
    stale = tmp_path / "selection.md"
    stale.write_text(text.replace("REF_TORCH", "REF_TORCHX", 1))
    assert main(["--check", "--path", str(stale)]) == 1
    assert main(["--path", str(stale)]) == 0 and main(["--check", "--path", str(stale)]) == 0
