"""Generate the cost-model figures in docs/ (matplotlib; ``pip install 'mla-backends[dev]'``).

    .venv/bin/python docs/plots.py                      # uses docs/data/tune-cpu.json for the measured side
    .venv/bin/python docs/plots.py --table my-gpu.json  # plot another `mla-backends tune --output` file

Writes docs/kv-cache-bytes.png (latent vs expanded vs GQA cache per sequence against context length),
docs/dcp-tokens.png (tokens a DeepSeek-V3 deployment on 8 H200 holds under DCP 1/2/4/8 and DP-attention) and
docs/crossover.png (modelled vs measured absorbed/expanded crossover). Every modelled number comes from
mla_backends.planning.costs; the measured ones are read from the threshold table, never re-measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mla_backends.cli.reports import deployment_report  # noqa: E402
from mla_backends.core.dims import MLADims  # noqa: E402
from mla_backends.core.gpus import gpu_spec  # noqa: E402
from mla_backends.planning import costs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = costs.GiB


def _label(ax, *, xlabel: str | None, ylabel: str, title: str, grid_axis: str = "both", **legend) -> None:
    """Axis labels, title, a light grid (``grid_axis``: ``both``, ``x`` or ``y``) and a small legend."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", axis=grid_axis, alpha=0.25)
    ax.legend(**{"fontsize": 8, **legend})


def _save(fig, path: str) -> None:
    """Lay out, write ``path`` at 120 dpi and close the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bytes(path: str) -> None:
    v3, v32 = MLADims.deepseek_v3(), MLADims.deepseek_v32()
    ctx = np.logspace(np.log10(1024), np.log10(163_840), 60)
    series = [
        ("DeepSeek-V3 expanded K+V, bf16", costs.expanded_bytes_per_token(v3, 2), "tab:red", "--"),
        (
            f"{costs.LLAMA3_70B.name} GQA-8, bf16",
            costs.gqa_bytes_per_token(costs.LLAMA3_70B, 2),
            "tab:orange",
            "-",
        ),
        (
            "DeepSeek-V3.2 latent + indexer, bf16",
            costs.cache_bytes_per_token(v32, 2),
            "tab:purple",
            ":",
        ),
        ("DeepSeek-V3 latent, bf16", costs.latent_bytes_per_token(v3, 2), "tab:blue", "-"),
        ("DeepSeek-V3 latent, fp8", costs.latent_bytes_per_token(v3, 1), "tab:cyan", "-"),
    ]
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, per_token, color, style in series:
        ax.plot(
            ctx,
            ctx * per_token / GiB,
            style,
            color=color,
            lw=2,
            label=f"{label}: {per_token:,} B/token",
        )
    for gib in (80, 141):
        ax.axhline(gib, color="grey", lw=0.8, ls=":")
        ax.text(ctx[0], gib * 1.08, f"{gib} GiB", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _label(ax, xlabel="context length (tokens, one sequence)",
           ylabel="KV cache for the sequence, all layers (GiB, one rank at TP=1)",
           title="Cache per sequence: MLA latent vs expanded heads vs GQA", loc="lower right")
    _save(fig, path)


#: the shapes a threshold table records under "model" (``tuning.tune``); the modelled curves use exactly these
TABLE_DIMS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size")


def table_dims(m: dict) -> MLADims | None:
    """The per-rank dims a threshold table was measured with, or None when its "model" lacks a shape."""
    if "tp" not in m or any(k not in m for k in TABLE_DIMS):
        return None
    shapes = {k: m[k] for k in TABLE_DIMS}
    shapes["num_heads"] *= m["tp"]  # the table records one rank's heads
    return MLADims(**shapes, name=m.get("name", "custom")).tensor_parallel(m["tp"])


def plot_crossover(path: str, table_path: str) -> bool:
    """Write the crossover figure; False (nothing written) when the table does not record its shapes."""
    with open(table_path, encoding="utf-8") as fh:
        table = json.load(fh)
    m = table["model"]
    dims = table_dims(m)
    if dims is None:
        return False
    grid = table["grid"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))

    s = np.logspace(np.log10(16), np.log10(1 << 20), 200)
    ax.plot(
        s,
        [costs.crossover_query_len(dims, int(x), causal=True) for x in s],
        color="black",
        lw=2,
        label="modelled (FLOPs, causal block)",
    )
    ax.plot(
        s,
        [costs.crossover_query_len(dims, int(x)) for x in s],
        color="grey",
        lw=1,
        ls="--",
        label="modelled (FLOPs, rectangular block)",
    )
    asym = costs.asymptotic_query_threshold(dims)
    ax.axhline(asym, color="grey", ls=":", lw=1)
    ax.text(s[0], asym * 1.04, f"asymptote {asym:.1f}", color="grey", fontsize=8)
    markers = iter("osD^v")
    for name, res in table["backends"].items():
        mk = next(markers)
        xs = [c["context_len"] for c in res["crossovers"]]
        ys = [c["measured"] if c["measured"] is not None else c["threshold"] for c in res["crossovers"]]
        ax.plot(xs, ys, mk + "-", ms=8, label=f"measured: {name}")
        for c in res["crossovers"]:
            if c["bound"]:
                ax.annotate(
                    ">" if c["bound"] == "above" else "<",
                    (c["context_len"], c["threshold"]),
                    textcoords="offset points",
                    xytext=(6, 6),
                )
    ax.set_xscale("log")
    ax.set_ylim(
        0,
        max(
            [asym * 1.3] + [c["threshold"] * 1.2 for r in table["backends"].values() for c in r["crossovers"]]
        ),
    )
    _label(ax, xlabel="cached context S (tokens)", ylabel="query length Q where both paths cost the same",
           title="Absorbed/expanded crossover: absorbed wins below the line", loc="lower right")

    name = "REF_TORCH" if "REF_TORCH" in table["backends"] else next(iter(table["backends"]))
    res = table["backends"][name]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, sctx in enumerate(grid["contexts"]):
        rows = [t for t in res["timings"] if t["context_len"] == sctx]
        qs = [t["query_len"] for t in rows]
        col = colors[i % len(colors)]
        ax2.plot(
            qs,
            [t["absorbed_s"] / t["expanded_s"] for t in rows],
            "o-",
            color=col,
            label=f"measured, S={sctx}",
        )
        qq = np.array(sorted(set(qs)))
        model = [
            costs.absorbed_path_flops(dims, int(q), sctx, causal=True)
            / costs.expanded_path_flops(dims, int(q), sctx, causal=True)
            for q in qq
        ]
        ax2.plot(qq, model, "--", color=col, alpha=0.7, label=f"FLOP model, S={sctx}")
    ax2.axhline(1.0, color="black", lw=1)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    _label(ax2, xlabel="query length Q", ylabel="absorbed / expanded (time or FLOPs)",
           title=f"{name}: below 1 the absorbed path is cheaper", fontsize=7, ncol=2)
    dev = table["device"]
    fig.suptitle(
        f"{m['name']} at TP={m['tp']} ({m['num_heads']} heads), {m['dtype']}, on {dev['name']} "
        f"({dev.get('cpu_count', '?')} cores, torch threads: {dev.get('torch_threads', '?')}), "
        f"{table['date'][:10]}",
        fontsize=10,
    )
    _save(fig, path)
    return True


def plot_dcp(path: str) -> None:
    """``cluster_tokens`` of DeepSeek-V3 on 8 H200 at TP=8 (weights as published, utilization 0.9)."""
    v3, h200 = MLADims.deepseek_v3(), gpu_spec("h200")
    layouts = [("DCP=1", 1, False), ("DCP=2", 2, False), ("DCP=4", 4, False), ("DCP=8", 8, False),
               ("DP-attention", 1, True)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(len(layouts))
    for k, (cache, color) in enumerate((("bfloat16", "tab:blue"), ("fp8_e4m3", "tab:cyan"))):
        tokens = [deployment_report(v3, gpu_memory_bytes=h200.memory_bytes, gpu_name=h200.name, tp=8, dcp=d,
                                    dp_attention=dp, kv_cache_dtype=cache)["cluster_tokens"]
                  for _, d, dp in layouts]
        bars = ax.bar(x + (k - 0.5) * 0.38, np.array(tokens) / 1e6, 0.38, color=color, label=f"{cache} cache")
        ax.bar_label(bars, [f"{t / 1e6:.2f}M" for t in tokens], fontsize=7)
    ax.set_xticks(x, [name for name, _, _ in layouts])
    _label(ax, xlabel=None, ylabel="tokens of context the deployment holds (millions)",
           title="DeepSeek-V3 on 8 x H200, TP=8, fp8 weights: cluster_tokens", grid_axis="y", loc="upper left")
    _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table",
        default=os.path.join(HERE, "data", "tune-cpu.json"),
        help="threshold table from `mla-backends tune --output` (default docs/data/tune-cpu.json)",
    )
    p.add_argument("--out-dir", default=HERE, help="where the PNGs go (default docs/)")
    args = p.parse_args(argv)
    plot_bytes(os.path.join(args.out_dir, "kv-cache-bytes.png"))
    plot_dcp(os.path.join(args.out_dir, "dcp-tokens.png"))
    if os.path.isfile(args.table):
        if not plot_crossover(os.path.join(args.out_dir, "crossover.png"), args.table):
            print(
                f"{args.table} does not record the model's shapes ({', '.join(TABLE_DIMS)}, tp); skipped "
                f"crossover.png",
                file=sys.stderr,
            )
    else:
        print(
            f"no threshold table at {args.table}; skipped crossover.png (run `mla-backends tune --output "
            f"{args.table}`)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
