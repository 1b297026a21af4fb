"""The command line names what the user typed: DCP/DP-attention only where they apply, unknown options as
usage errors before ``--`` (conformance too), JSON errors whose ``argument`` is the flag, a global ``--json``."""

from __future__ import annotations

import json

import pytest

from mla_backends.cli import main
from mla_backends.cli.flags import flag_error, flag_for


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json_error(capsys, *argv: str) -> dict:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    return json.loads(out)["error"]


# ---- --dcp / --dp-attention need --gpu or --gpu-memory -----------------------------------------------------
@pytest.mark.parametrize("flags, flag", [(["--dcp", "2"], "--dcp"), (["--dp-attention"], "--dp-attention"),
                                         (["--max-num-batched-tokens", "4096"], "--max-num-batched-tokens"),
                                         (["--reserve", "1GB"], "--reserve")])
@pytest.mark.parametrize("memory", [["--cache-memory", "40"], []])
def test_dcp_and_dp_attention_without_a_gpu_are_refused(capsys, flags, flag, memory):
    rc, out, err = _run(capsys, "kv-cache", "--tp", "8", *flags, *memory)
    assert rc == 2 and out == ""
    assert err.startswith(f"mla-backends kv-cache: error: {flag}: got") and "--gpu or --gpu-memory" in err
    e = _json_error(capsys, "kv-cache", "--tp", "8", *flags, *memory, "--json")
    assert e["argument"] == flag and "--gpu or --gpu-memory" in e["message"]


def test_dcp_and_dp_attention_with_a_gpu_still_size_the_deployment(capsys):
    for flags in (["--dcp", "2"], ["--dp-attention"]):
        for gpu in (["--gpu", "h200"], ["--gpu-memory", "141GB"]):
            rc, out, _ = _run(capsys, "kv-cache", "--tp", "8", *flags, *gpu, "--json")
            assert rc == 0 and json.loads(out)["cluster_tokens"] > 0
    rc, _, _ = _run(capsys, "kv-cache", "--tp", "8", "--dcp", "1", "--cache-memory", "40")
    assert rc == 0  # DCP=1 is the replicated cache the report shows


def test_kv_cache_help_says_dcp_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        main(["kv-cache", "--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens too
    assert out.count("needs--gpuor--gpu-memory") == 4  # --dcp, --dp-attention, --max-num-batched-tokens, --reserve


# ---- conformance: only what follows -- goes to pytest -------------------------------------------------------
@pytest.mark.parametrize("bad", ["--quik", "--json", "-x"])
def test_conformance_unknown_option_before_the_separator_is_a_usage_error(capsys, bad):
    rc, out, err = _run(capsys, "conformance", "REF_TORCH", bad)
    assert rc == 2 and f"unrecognized arguments: {bad}" in out + err  # --json: as a JSON error on stdout
    assert "matrix, device" not in out + err  # pytest never ran (no banner)


def test_conformance_unknown_option_is_a_json_error_with_json(capsys):
    e = _json_error(capsys, "conformance", "REF_TORCH", "--quik", "--json")
    assert e["type"] == "ArgumentError" and e["argument"] == "--quik"


def test_pass_through_is_refused_by_commands_that_take_none(capsys):
    e = _json_error(capsys, "list", "--json", "--", "-x")
    assert e["type"] == "ArgumentError" and "unrecognized arguments: -- -x" in e["message"]


# ---- JSON errors name the flag -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["kv-cache", "--cache-memory", "nan"], "--cache-memory"),
        (["kv-cache", "--gpu", "h999"], "--gpu"),
        (["kv-cache", "--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["kv-cache", "--tp", "0"], "--tp"),
        (["select", "--device", "sm999"], "--device"),
        (["select", "--block-size", "0"], "--block-size"),
        (["kv-cache", "--device", "sm999"], "--device"),  # unknown to kv-cache: argparse's own wording
    ],
)
def test_json_error_argument_is_the_flag(capsys, argv, flag):
    e = _json_error(capsys, *argv, "--json")
    assert e["argument"] == flag, e
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and flag in err


def test_message_leads_with_the_flag_not_the_library_name(capsys):
    e = _json_error(capsys, "kv-cache", "--cache-memory", "nan", "--json")
    assert e["message"].startswith("--cache-memory: got 'nan'") and "gpu_memory_gib" not in e["message"]
    e = _json_error(capsys, "select", "--block-size", "0", "--json")
    assert e["message"].startswith("--block-size: got 0")
    e = _json_error(capsys, "kv-cache", "--gpu", "h999", "--json")
    assert e["message"].startswith("--gpu: got 'h999'")


def test_flag_mapping_only_names_flags_the_command_has():
    assert flag_for("block_size", {"--block-size"}) == "--block-size"
    assert flag_for("gpu_memory_gib", {"--cache-memory"}) == "--cache-memory"
    assert flag_for("context_len", {"--contexts"}) == "--contexts"
    assert flag_for("block_size", {"--tp"}) is None
    assert flag_error("scale: got -1.0; supported > 0", {"--tp"}) == ("scale: got -1.0; supported > 0", "scale")
    assert flag_error("no name here", {"--tp"}) == ("no name here", None)
    assert flag_error("argument --tp: invalid int value: 'x'", {"--tp"})[1] == "--tp"


# ---- --json before the command ---------------------------------------------------------------------------
def test_json_before_the_command_means_the_same(capsys):
    rc, before, _ = _run(capsys, "--json", "list")
    rc2, after, _ = _run(capsys, "list", "--json")
    assert rc == rc2 == 0 and json.loads(before) == json.loads(after)
    e = _json_error(capsys, "--json", "kv-cache", "--tp", "3")
    assert e["argument"] == "--tp"


def test_json_before_a_command_without_json_output_is_refused(capsys):
    e = _json_error(capsys, "--json", "demo")
    assert e["type"] == "ArgumentError" and e["argument"] == "--json" and "no JSON output" in e["message"]
