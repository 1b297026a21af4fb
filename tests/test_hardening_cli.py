"""Issue 21, the command line: with ``--json`` every error is one JSON object on stdout (exit 2), never a
traceback; outputs and sizes are checked before work; a conformance run in which no output test ran fails."""

from __future__ import annotations

import json

import pytest
import torch
from test_dims import DEEPSEEK_V3_CONFIG

from mla_backends.cli import main


def _json_error(capsys, *argv):
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    doc = json.loads(out)
    assert set(doc) == {"error"} and set(doc["error"]) == {"type", "message", "argument"}, doc
    return doc["error"]


def test_every_cli_error_is_json_with_the_argument(capsys, tmp_path):
    """Class: CLI errors (argument errors, configs that fail, outputs and sizes refused before work)."""
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2, 3]")
    err = _json_error(capsys, "select", "--model", str(listing))
    assert err["type"] == "TypeError" and err["argument"] == "--model" and "JSON list" in err["message"]
    bad_rope = tmp_path / "rope.json"
    bad_rope.write_text(json.dumps(dict(DEEPSEEK_V3_CONFIG, rope_scaling="yarn")))
    err = _json_error(capsys, "select", "--model", str(bad_rope))
    assert err["argument"] == "--model" and "config.rope_scaling" in err["message"]
    err = _json_error(capsys, "select", "--tp", "x")  # an argparse error
    assert err == {"type": "ArgumentError", "argument": "--tp", "message": "argument --tp: invalid int value: 'x'"}
    err = _json_error(capsys, "select", "--no-such-flag")
    assert err["type"] == "ArgumentError" and err["argument"] == "--no-such-flag"
    err = _json_error(capsys, "tune", "--model", "deepseek-v2-lite", "--tp", "1", "--quick",
                      "--output", str(tmp_path / "missing" / "table.json"))
    assert err["argument"] == "--output" and "does not exist" in err["message"]
    err = _json_error(capsys, "tune", "--model", "deepseek-v2-lite", "--tp", "1", "--quick", "--device", "cpu",
                      "--context", "999999999")
    assert err["argument"] == "--context" and "GiB" in err["message"]
    assert main(["select", "--tp", "x"]) == 2  # without --json: argparse's usage and message on stderr
    assert "argument --tp: invalid int value" in capsys.readouterr().err


def test_conformance_fails_when_no_output_test_ran(capsys):
    """Class: a conformance run that checked nothing against the reference is not a pass."""
    code = main(["conformance", "REF_TORCH", "--quick", "--device", "cpu", "--", "-k", "declared", "-q"])
    out, err = capsys.readouterr()
    assert code == 1 and "no output test ran (no output case was selected)" in out, out[-2000:]
    if not torch.cuda.is_available():
        code = main(["conformance", "REF_TORCH", "--quick", "--device", "cuda", "--", "-q", "-x"])
        out, _ = capsys.readouterr()
        assert code == 1 and "output case(s) were skipped, the first because" in out, out[-2000:]
        assert "no CUDA device" in out
    code = main(["conformance", "REF_TORCH", "--quick", "--device", "cpu", "--", "--collect-only", "-q"])
    out, err = capsys.readouterr()  # listing the cases is not a pass (issue 28, item 16)
    assert code == 5 and "REF_TORCH not checked: no tests ran" in err and "passed" not in err, (out + err)[-2000:]


@pytest.mark.parametrize("argv", [["list"], ["select", "--device", "cpu"]])
def test_good_json_commands_still_exit_0(capsys, argv):
    assert main([*argv, "--json"]) == 0
    assert "error" not in json.loads(capsys.readouterr().out)
