"""DeepSeek-V4 deployment sizing (``mla_backends.planning.v4_costs`` and ``mla-backends kv-cache``) against vLLM's
own figures: its spec classes' page sizes and per-request bounds, recorded by ``benchmarks/v4_vllm_sizing.py`` in
``benchmarks/results/v4-vllm-sizing.json`` (``tests/vllm_engine/test_v4_vllm_sizing.py`` recomputes them live)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mla_backends.cli import main
from mla_backends.core.v4dims import CSA, HCA, SLIDING, V4Dims
from mla_backends.planning.v4_costs import v4_pools, v4_report, v4_request_bytes

RECORDED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "v4-vllm-sizing.json"


def _flash_with_every_kind() -> V4Dims:
    """V4-Flash's geometry with its first layer window-only, so that every pool of every kind is sized."""
    flash = V4Dims.deepseek_v4_flash()
    return dataclasses.replace(flash, layer_types=(SLIDING,) + flash.layer_types[1:])


def test_every_pool_matches_vllms_recorded_figures():
    doc = json.loads(RECORDED.read_text())
    assert doc["vllm"].startswith("0.32")
    dims = _flash_with_every_kind()
    compared = 0
    for case in doc["cases"]:
        ours = {(p.kind, p.name): p for p in v4_pools(dims, kv_cache_dtype=case["cache"])}
        assert len(ours) == len(case["pools"]) == 9
        for row in case["pools"]:
            p = ours[(row["kind"], row["pool"])]
            assert (p.page_tokens, p.page_bytes) == (row["page_tokens"], row["page_bytes"]), row
            assert p.bytes_per_request(case["max_model_len"], case["in_flight_tokens"]) == row["bytes_per_request"]
            compared += 1
    assert compared == 27


def test_per_token_and_per_request_follow_from_pages():
    dims = V4Dims.deepseek_v4_flash()
    pools = {(p.kind, p.name): p for p in v4_pools(dims)}
    comp = pools[(CSA, "compressed")]
    assert (comp.rows_per_page, comp.row_bytes, comp.bytes_per_token) == (64, 1024, 256.0)  # 1 KiB per 4 tokens
    assert pools[(HCA, "compressed")].bytes_per_token == 8.0  # 2 entries of 1 KiB per 256 tokens
    assert pools[(CSA, "indexer_keys")].page_bytes == 8704  # 64 x 132 B, rounded up to 512
    assert pools[(CSA, "window")].bytes_per_token == 0.0  # a window does not grow
    # a windowed pool: ceil((window - 1 + in flight) / page) + 1 pages, whatever the sequence length
    w = pools[(CSA, "window")]
    assert w.pages_per_request(1 << 20, 8192) == -(-(128 - 1 + 8192) // 64) + 1 == w.pages_per_request(1 << 16, 8192)
    rep = v4_report(dims, max_model_len=65536, in_flight_tokens=8192, cache_memory_bytes=40 << 30)
    assert rep["bytes_per_request"] == v4_request_bytes(v4_pools(dims), 65536, 8192)
    assert rep["requests_that_fit"] == (40 << 30) // rep["bytes_per_request"]
    # what grows per token: CSA entries and indexer keys (20 layers), HCA entries (23 layers)
    assert rep["bytes_per_token"] == pytest.approx(20 * (65536 + 8704) / 256 + 23 * 2048 / 256)


def test_fp8_records_and_refusals():
    dims = V4Dims.deepseek_v4_flash()
    fp8 = {(p.kind, p.name): p for p in v4_pools(dims, kv_cache_dtype="fp8_ds_mla")}
    assert fp8[(CSA, "window")].row_bytes == 584 and fp8[(CSA, "window")].page_bytes == 37440  # 65 x 576
    with pytest.raises(ValueError, match="kv_cache_dtype: got 'fp8_e5m2'"):
        v4_pools(dims, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="hca_ratio: got 64"):
        v4_pools(dataclasses.replace(dims, hca_ratio=64))


def test_the_kv_cache_command_sizes_v4(capsys):
    assert main(["kv-cache", "--model", "deepseek-v4-flash", "--context", "65536", "--cache-memory", "40GiB",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == "deepseek-v4-flash" and len(rep["pools"]) == 8  # no window-only layer in Flash
    assert rep["requests_that_fit"] == (40 << 30) // rep["bytes_per_request"]
    assert main(["kv-cache", "--model", "v4", "--kv-cache-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "fp8_ds_mla rows" in text and "indexer_keys" in text
    assert main(["kv-cache", "--model", "v4", "--gpu", "h200"]) == 2
    assert "--gpu: got h200 for DeepSeek-V4" in capsys.readouterr().err
    assert main(["crossover", "--model", "v4"]) == 2
    assert "DeepSeek-V4" in capsys.readouterr().err
