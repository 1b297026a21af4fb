"""``mla-backends demo``: its numeric flags are checked by argparse before anything runs."""

from __future__ import annotations

import pytest

from mla_backends.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "0"], "argument --requests: got '0'; supported an int >= 1"),
        (["--context", "-1"], "argument --context: got '-1'; supported an int >= 0 or a comma-separated list"),
        (["--context", "300,-1"], "argument --context: got '300,-1'; supported an int >= 0"),
        (["--block-size", "0"], "argument --block-size: got '0'; supported an int >= 1"),
        (["--decode-steps", "-2"], "argument --decode-steps: got '-2'; supported an int >= 0"),
        (["--requests", "two"], "argument --requests: got 'two'; supported an int >= 1"),
        (["--prompts", "96,0"], "argument --prompts: got '96,0'; supported comma-separated positive ints"),
    ],
)
def test_bad_numbers_are_argparse_errors(capsys, argv, message):
    assert main(["demo", *argv]) == 2  # reported by main (usage line + error on stderr), not sys.exit
    assert message in capsys.readouterr().err


def test_prompts_are_parsed_to_ints():
    from mla_backends.cli import build_parser

    args = build_parser().parse_args(["demo", "--prompts", "5,3", "--context", "0"])
    assert args.prompts == [5, 3] and args.context == [0]
    assert build_parser().parse_args(["demo", "--context", "300,40"]).context == [300, 40]
    assert build_parser().parse_args(["demo"]).prompts == [96, 64, 80, 32]


def test_generate_section_agrees(capsys):
    import argparse

    pytest.importorskip("transformers")
    from mla_backends.cli.generate_demo import generate_demo

    assert generate_demo(argparse.Namespace(seed=0)) == 0
    out = capsys.readouterr().out
    assert "tokens agreeing: 100.0% of 48" in out and "speed ratio" in out
