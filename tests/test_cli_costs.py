"""``mla-backends kv-cache`` and ``mla-backends crossover``, with and without ``--json``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from mla_backends.cli import main, reports
from mla_backends.core.dims import MLADims
from mla_backends.planning import costs


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_kv_cache_json_v3(capsys):
    rc, out, _ = _run(capsys, "kv-cache", "--model", "deepseek-v3", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["kv_cache_dtype"] == "bfloat16"  # "auto", resolved against --dtype
    assert rep["bytes_per_token_per_layer"] == 1_152
    assert rep["bytes_per_token"] == 70_272
    assert rep["expanded_bytes_per_token"] == 4_997_120
    assert round(rep["expanded_ratio"], 2) == 71.11
    assert rep["indexer_bytes_per_token"] == 0
    assert rep["gqa_bytes_per_token"] == 327_680
    assert round(rep["decode_arithmetic_intensity"]) == 242


def test_kv_cache_json_v32_with_memory(capsys):
    rc, out, _ = _run(
        capsys, "kv-cache", "--model", "deepseek-v3.2", "--context", "4096", "--cache-memory", "80", "--json"
    )
    assert rc == 0
    rep = json.loads(out)
    assert rep["indexer_bytes_per_token"] == 8_052
    assert rep["tokens_that_fit"] == 80 * 2**30 // (70_272 + 8_052)
    assert rep["sequences_that_fit"] == 80 * 2**30 // (4096 * 78_324)


def test_kv_cache_text_fp8_tp8(capsys):
    rc, out, _ = _run(capsys, "kv-cache", "--kv-cache-dtype", "fp8", "--tp", "8", "--cache-memory", "40")
    assert rc == 0
    assert "576 B/token/layer" in out and "35,136 B/token" in out
    assert "fp8_e4m3" in out and "TP=8" in out
    assert f"{40 * 2**30 // 35_136:,} tokens" in out
    v3 = MLADims.deepseek_v3()
    break_even = costs.tp_break_even(v3, dtype_bytes=1)  # fp8 on both sides
    assert f"{break_even:.1f}" == "4.7" and "sharded GQA cache at TP ~ 4.7\n" in out
    intensity = costs.decode_arithmetic_intensity(v3, 1, tp=8)
    assert round(intensity) == 60 and "decode arithmetic intensity 60 FLOP/B per rank" in out


def test_kv_cache_from_config_json(tmp_path, capsys):
    cfg = {
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_size": 2048,
        "num_hidden_layers": 27,
        "model_type": "deepseek_v2",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "kv-cache", "--model", str(path), "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["bytes_per_token"] == 27 * 1_152
    assert rep["expanded_bytes_per_token"] == 27 * 16 * 320 * 2


def test_kv_cache_counts_only_indexing_layers(tmp_path, capsys):
    base = MLADims.deepseek_v32()
    cfg = {
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_size": 7168,
        "num_hidden_layers": base.num_layers,
        "index_topk": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk_pattern": "FS" * 30 + "F",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "kv-cache", "--model", str(path), "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["indexing_layers"] == 31
    assert rep["indexer_bytes_per_token"] == 31 * 132


def test_crossover_json_and_text(capsys):
    rc, out, _ = _run(capsys, "crossover", "--model", "v3", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert round(rep["asymptotic_query_threshold"]) == 171
    assert rep["up_projection_flops_per_context_token"] == 33_554_432
    assert rep["absorbed_core_flops_per_context_token"] == 278_528
    assert rep["min_context_for_single_query_absorption"] == 2
    rc, out, _ = _run(capsys, "crossover", "--context", "512,4096", "--query-lens", "1,128,200")
    assert rc == 0
    assert "170.67" in out and "3.4x" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()[:1].isdigit()}
    # Q=1 absorbed at both contexts; Q=128 ties at 512 (expanded) and is absorbed at 4096; Q=200 expanded
    assert rows == {"512": ["128.0", "abs", "exp", "exp"], "4,096": ["163.8", "abs", "abs", "exp"]}


def _doc_examples() -> list[tuple[list[str], list[str]]]:
    """The ``$ mla-backends ...`` blocks of docs/cost-model.md: (argv, the output lines shown under it)."""
    lines = (Path(__file__).resolve().parents[1] / "docs" / "cost-model.md").read_text().splitlines()
    examples = []
    for i, line in enumerate(lines):
        if line.startswith("    $ mla-backends "):
            shown = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("    "):
                    break
                shown.append(follow[4:])
            examples.append((shlex.split(line[len("    $ mla-backends ") :]), shown))
    return examples


def test_cost_model_doc_examples_match_the_commands(capsys):
    examples = _doc_examples()
    assert [argv[0] for argv, _ in examples] == ["crossover", "kv-cache", "kv-cache"]
    for argv, shown in examples:
        rc, out, _ = _run(capsys, *argv)
        assert rc == 0 and out.splitlines() == shown, argv


@pytest.mark.parametrize(
    "argv, message",
    [
        (["kv-cache", "--model", "gpt-2"], "--model: got 'gpt-2'"),
        (["kv-cache", "--model", "missing/config.json"], "does not exist"),
        (["kv-cache", "--tp", "3"], "--tp: got 3"),
        (["kv-cache", "--kv-cache-dtype", "int4"], "--kv-cache-dtype: got 'int4'"),
        (["kv-cache", "--cache-memory", "0"], "--cache-memory: got '0'"),
        (["kv-cache", "--gpu-memory", "0"], "--gpu-memory: got '0'"),
        (["kv-cache", "--gpu", "h200"], "--tp: got 1; deepseek-v3's weights"),
        (["kv-cache", "--gpu", "h200", "--tp", "8", "--dcp", "3"], "--dcp: got 3"),
        (["kv-cache", "--gpu", "x9"], "--gpu: got 'x9'"),
        (["crossover", "--tp", "0"], "--tp: got 0"),
    ],
)
def test_errors(capsys, argv, message):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    assert message in err


def test_help_shows_the_default_grid(capsys):
    with pytest.raises(SystemExit):
        main(["crossover", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(default {','.join(map(str, reports.DEFAULT_CONTEXTS))})" in out
    assert f"(default {','.join(map(str, reports.DEFAULT_QUERY_LENS))})" in out


@pytest.mark.parametrize("argv", [["crossover", "--context", "4096,abc"], ["kv-cache", "--context", "-5"]])
def test_bad_list_is_an_argparse_error(capsys, argv):
    assert main(argv) == 2  # reported by main, not argparse's sys.exit
    assert "comma-separated positive ints" in capsys.readouterr().err


def test_kv_cache_takes_one_context_or_a_list(capsys):
    """--context means the same in kv-cache, crossover and tune: one length or a comma-separated list."""
    rc, out, _ = _run(capsys, "kv-cache", "--context", "4096,32768", "--cache-memory", "40", "--json")
    rep = json.loads(out)
    assert rc == 0 and [s["context_len"] for s in rep["sequences"]] == [4096, 32768]
    cell = rep["total_bytes_per_token"]
    assert [s["bytes_per_sequence"] for s in rep["sequences"]] == [4096 * cell, 32768 * cell]
    assert rep["sequences"][1]["sequences_that_fit"] == 40 * 2**30 // (32768 * cell)
    assert rep["context_len"] == 4096  # the first one also at the top level, as with a single value
    rc, out, _ = _run(capsys, "kv-cache", "--context", "4096,32768", "--cache-memory", "40")
    assert "one 32,768-token sequence" in out and f"{40 * 2**30 // (32768 * cell):,} sequences of 32,768" in out
