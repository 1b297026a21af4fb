"""``benchmarks/bench_plan_step.py --per-layer``: the per-layer overhead figures docs/performance.md quotes come
from this function; it runs at tiny sizes and reports what it names."""

from __future__ import annotations

from bench_scripts import load_benchmark


def test_per_layer_figures_time_and_count_a_layer_call_forward_mqa_and_the_kernel():
    bench = load_benchmark("bench_plan_step")
    got = bench.per_layer_figures(layers_n=2, batch=2, rounds=1)
    for name in ("layer_call", "forward_mqa", "kernel"):
        assert got[f"{name}_s"] > 0 and got[f"{name}_calls"] > 0
    # a layer call includes its forward_mqa, which includes the kernel: the contract's share is the difference
    assert got["layer_call_calls"] > got["forward_mqa_calls"] > got["kernel_calls"]
    assert got["contract_overhead_calls"] == got["forward_mqa_calls"] - got["kernel_calls"]
    assert got["contract_overhead_s"] == got["forward_mqa_s"] - got["kernel_s"]
