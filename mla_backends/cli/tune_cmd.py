"""``mla-backends tune``: measure where the absorbed and the expanded path of the layer cost the same.

For each available backend on this device it times both paths for query lengths ``Q`` over contexts ``S``
and prints the measured crossover next to the FLOP model's. ``--output FILE`` writes the threshold table a
layer loads (``MLAAttention(..., threshold_table=FILE)`` or ``MLA_BACKENDS_THRESHOLD_TABLE=FILE``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .args import add_model_args, check_output_file, csv_text, int_list, load_model_dims, per_rank_dims, refuse_v4

__all__ = ["register", "run_tune", "DEFAULT_TP"]

#: tune's --tp default: one rank of 8 (16 of DeepSeek-V3's 128 heads), so a CPU grid takes minutes, not hours
DEFAULT_TP = 8


def register(sub: argparse._SubParsersAction) -> None:
    from ..planning import tuning

    p = sub.add_parser(
        "tune", help="measure the absorbed/expanded crossover here and write a threshold table",
        description="Time the layer's absorbed path (folds + forward_mqa) against its expanded path (forward_mha) "
                    "for each backend that runs on this device, print the measured crossover next to the FLOP "
                    "model's, and with --output write the threshold table MLAAttention(threshold_table=FILE) "
                    "or MLA_BACKENDS_THRESHOLD_TABLE=FILE loads. The default grid takes minutes on a CPU; "
                    "--quick takes seconds.",
    )
    add_model_args(p, tp=DEFAULT_TP, tp_help="time one rank of this tensor-parallel size; unlike the other "
                                              "commands tune defaults to 8 (16 of DeepSeek-V3's 128 heads), as a "
                                              "128-head rank takes 8x longer on a CPU")
    p.set_defaults(tp=None)  # None = not given: DEFAULT_TP, and the output says it was the default
    p.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="NAME",
        help="backend to measure (repeatable; default every backend that runs here)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="model dtype (default float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument(
        "--block-size", type=int, default=None, metavar="N", help="page size (default: the backend's)"
    )
    p.add_argument(
        "--query-lens",
        type=int_list,
        default=None,
        metavar="Q[,Q...]",
        help=f"query lengths (default {csv_text(tuning.DEFAULT_QUERY_LENS)})",
    )
    p.add_argument(
        "--context",
        type=int_list,
        default=None,
        metavar="S[,S...]",
        help=f"one or a list of context lengths (default {csv_text(tuning.DEFAULT_CONTEXTS)})",
    )
    # the old spelling, kept working but no longer shown
    p.add_argument("--contexts", dest="context", type=int_list, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a small grid (Q {csv_text(tuning.QUICK_QUERY_LENS)} over S "
             f"{csv_text(tuning.QUICK_CONTEXTS)}; {tuning.QUICK_REPEATS} repeats after a warm-up; the table is "
             "marked not for use)",
    )
    p.add_argument("--repeats", type=int, default=None,
                   help=f"passes over the grid; each point keeps its best time (default {tuning.DEFAULT_REPEATS})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="write the JSON threshold table here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_tune)


def _positive(name: str, v: int | None) -> None:
    if v is not None and v <= 0:
        raise ValueError(f"{name}: got {v}; supported a positive int")


def run_tune(args: argparse.Namespace) -> int:
    import torch

    from ..planning import tuning

    check_output_file("--output", args.output)  # before minutes of measuring, not after
    dims = load_model_dims(args.model)
    refuse_v4(dims, "tune")
    for name in ("block_size", "repeats", "threads"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    tp_defaulted = args.tp is None
    tp = DEFAULT_TP if tp_defaulted else args.tp
    dims = per_rank_dims(dims, tp)
    if args.device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        from ..core.validation import require_device

        device = args.device
        if require_device("--device", device).type == "meta":  # the one device check, then: kernels must run
            raise ValueError(f"--device: got {device!r}; supported 'cpu', 'cuda' or 'cuda:N' (meta runs nothing)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..core.dtypes import parse_model_dtype

    dtype = parse_model_dtype(args.dtype, default=torch.float32 if device == "cpu" else torch.bfloat16)

    found = tuning.tunable_backends(dims, dtype, device, args.backend)
    unusable = {n: why for n, why in found.items() if why}
    if unusable:
        raise ValueError(
            "--backend: " + "; ".join(f"got {n}, which cannot run here: {why}" for n, why in unusable.items())
        )
    if not found:
        raise ValueError(
            f"--backend: none of the registered backends runs {dims.num_heads} heads in "
            f"{dtype} on {device}; supported a device where one does"
        )
    qs = args.query_lens or (tuning.QUICK_QUERY_LENS if args.quick else tuning.DEFAULT_QUERY_LENS)
    ss = args.context or (tuning.QUICK_CONTEXTS if args.quick else tuning.DEFAULT_CONTEXTS)
    repeats = args.repeats or (tuning.QUICK_REPEATS if args.quick else tuning.DEFAULT_REPEATS)
    tuning.check_grid_fits(dims, qs, ss, dtype, device, name="--context")  # before allocating anything
    progress = not args.no_progress and not args.json
    table = tuning.tune(
        dims,
        backends=sorted(found),
        query_lens=qs,
        contexts=ss,
        dtype=dtype,
        device=device,
        block_size=args.block_size,
        repeats=repeats,
        progress=progress,
        quick=bool(args.quick),
    )
    failure = _save(table, args.output) if args.output else None
    data = table.to_dict()
    if args.json:
        doc = {**data, "tp_is_default": tp_defaulted}
        if failure:  # the measurements stay in this document; the error says where the table went
            doc["error"] = {"type": "OSError", "message": failure[0], "argument": "--output"}
            doc["saved_to"] = failure[1]
        print(json.dumps(doc, indent=2))
        return 2 if failure else 0
    _print_text(data, None if failure else args.output, tp_defaulted)
    if failure:
        message, saved_to = failure
        if saved_to is None:  # nowhere to write: the table itself goes to stdout, after the report
            print(json.dumps(data, indent=2))
        print(f"mla-backends tune: error: {message}", file=sys.stderr)
        return 2
    return 0


def _save(table: Any, output: str) -> tuple[str, str | None] | None:
    """Write ``table`` to ``output``; None when written. When the write fails after the measurements (the disk
    filled, the folder went away), they are not lost: the table is written beside it (the same folder, a
    short name) or else to the temporary folder, and ``(message, where it went or None)`` is returned
    (None: no file could be written, so the caller prints the table on stdout)."""
    import contextlib
    import os
    import tempfile

    try:
        table.save(output)
        return None
    except OSError as exc:
        reason = f"--output: could not write {output!r} ({exc.strerror or exc})"
    for folder in dict.fromkeys([os.path.dirname(os.path.abspath(output)), tempfile.gettempdir()]):
        try:
            fd, fallback = tempfile.mkstemp(prefix="mla-backends-thresholds-", suffix=".json", dir=folder)
        except OSError:
            continue
        os.close(fd)
        try:
            table.save(fallback)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(fallback)
            continue
        return (f"{reason}; the measured table was written to {fallback} instead (load it from there, or "
                "move it)", fallback)
    return f"{reason}, nor to any other file; the measured table is printed on stdout", None


def _print_text(data: dict[str, Any], output: str | None, tp_defaulted: bool = False) -> None:
    m, dev = data["model"], data["device"]
    default = " (tune's default --tp; --tp 1 times every head)" if tp_defaulted else ""
    print(
        f"{m['name']} at TP={m['tp']}{default} ({m['num_heads']} heads per rank), {m['dtype']}, on "
        f"{dev['name']} ({data['date']})"
    )
    print(
        f"  modelled asymptotic threshold (FLOPs, S -> inf): "
        f"{data['modelled_asymptotic_query_threshold']:.1f}"
    )
    if data.get("quick"):
        print(f"  NOTE: {data['note']}")
    for name, res in data["backends"].items():
        print(
            f"  {name} (page {res['block_size']}; constant decode threshold "
            f"{res['constant_decode_threshold']})"
        )
        print(f"    {'context':>8} {'measured crossover Q':>21} {'modelled (causal)':>18} {'threshold':>10}")
        for c in res["crossovers"]:
            if c["measured"] is None:
                meas = (
                    f"> {max(data['grid']['query_lens'])}"
                    if c["bound"] == "above"
                    else f"< {min(data['grid']['query_lens'])}"
                )
            else:
                meas = f"{c['measured']:.1f}"
            print(f"    {c['context_len']:>8,} {meas:>21} {c['modelled']:>18.1f} {c['threshold']:>10}")
        print(
            f"    {'S':>8} {'Q':>5} {'absorbed ms':>12} {'expanded ms':>12} {'ratio':>6} "
            f"{'abs GFLOP/s':>12} {'exp GFLOP/s':>12}"
        )
        for t in res["timings"]:
            print(
                f"    {t['context_len']:>8,} {t['query_len']:>5} {1e3 * t['absorbed_s']:>12.2f} "
                f"{1e3 * t['expanded_s']:>12.2f} {t['absorbed_s'] / t['expanded_s']:>6.2f} "
                f"{t['absorbed_flops'] / t['absorbed_s'] / 1e9:>12.1f} "
                f"{t['expanded_flops'] / t['expanded_s'] / 1e9:>12.1f}"
            )
    if output:
        print(
            f"threshold table written to {output} (load it with MLAAttention(..., threshold_table=...) or "
            f"MLA_BACKENDS_THRESHOLD_TABLE)",
            file=sys.stderr,
        )
