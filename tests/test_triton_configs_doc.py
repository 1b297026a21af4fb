"""``docs/triton-configs.md`` is generated from the configuration table and the committed compile reports, and
those reports cover what the table can choose (no triton needed: it reads JSON)."""

from __future__ import annotations

from docgen.triton_configs import CONFIGS_DOC_PATH, compile_reports, main, render_configs_doc
from mla_backends.triton_mla.configs import CONFIG_TABLE


def test_configs_doc_matches_the_table_and_reports(tmp_path):
    assert CONFIGS_DOC_PATH.read_text() == render_configs_doc(), (
        "docs/triton-configs.md is stale: python -m docgen.triton_configs")
    stale = tmp_path / "triton-configs.md"
    stale.write_text(render_configs_doc().replace("sm90-rows64-n32-s3", "sm90-rows64-n64-s2", 1))
    assert main(["--check", "--path", str(stale)]) == 1
    assert main(["--path", str(stale)]) == 0 and main(["--check", "--path", str(stale)]) == 0


def test_rendering_without_reports_says_so(tmp_path):
    assert "No compile report is committed." in render_configs_doc(tmp_path)


def test_committed_sm90_reports_cover_every_rows_candidate_without_spills():
    """A change to the table's SM90 candidates must come with fresh compile reports (Triton 3.6, the device
    image's, and the installed one): each candidate compiled at 16, 64 and 128 heads with no spills (fp8 scores:
at most 32 bytes, docs/triton.md)."""
    reports = [d for d in compile_reports() if d["arch"] == "sm90a"]
    assert {d["triton"].rsplit(".", 1)[0] for d in reports} >= {"3.6", "3.9"}, [d["triton"] for d in reports]
    rows_names = {c.name for rule in CONFIG_TABLE if rule.archs == (9,) for c in rule.candidates
                  if c.kernel == "rows"}
    for doc in reports:
        rows = [c for c in doc["configs"] if c["kernel"] == "mla_decode_rows"]
        assert {c["config"] for c in rows} == rows_names, (doc["triton"], rows_names)
        for name in rows_names:
            heads = {h for c in rows if c["config"] == name for h in (c["heads"], *c["also_heads"])}
            assert heads == {16, 64, 128}, (doc["triton"], name, heads)
        # no spills, except the fp8-score kernels of the committed reports, compiled with the promoted accumulator
        # (QK_FP8_PROMOTE = 128, off by default since; docs/triton.md): <= 32 B
        assert all(c["spills"] <= (32 if c["fp8_qk"] else 0) and c["uses_wgmma"] for c in rows), doc["triton"]
        assert all(c["shared_bytes"] <= c["shared_limit"] for c in doc["configs"]), doc["triton"]
