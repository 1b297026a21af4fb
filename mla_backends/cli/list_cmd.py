"""``mla-backends list``: every registered backend, its declared capabilities, whether it is importable and
whether it runs on this (or a simulated) device, and its plugin.

"Importable" means the packages it needs are installed (``importlib.util.find_spec``; nothing is imported);
"runs here" adds the device: a FlashInfer backend is importable on a machine without a GPU but does not run
there. ``--json`` gives the capabilities as data (lists, ints, bools), not display strings.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.errors import USER_CODE_FAILURES, failure_text, plugin_call


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list registered backends: capabilities, importable / runs here, plugin",
                       description="List every registered backend (built-ins and plugins) with its declared "
                                   "capabilities, whether its packages are importable, whether it runs on this "
                                   "device (or --device), and any plugin that failed to load.")
    p.add_argument("--device", default="auto",
                   help="the device 'runs here' refers to: auto (GPU 0 via NVML, else the CPU; the default), "
                        "cuda:N, cpu, smXY or a GPU product name (h100, b200, ...)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    p.set_defaults(func=run)


def _row(entry: Any, device: Any) -> dict[str, Any]:
    from selector.explain import capability_data

    cls = entry.cls
    missing = cls.missing_requirements()
    device_reasons = [str(r) for r in cls.device_reasons(device)]
    # a compiled backend (CPU_FUSED) says whether its kernel is built for this machine (file checks only)
    build_reasons = [str(r) for r in cls.build_reasons()] if callable(getattr(cls, "build_reasons", None)) else []
    return {"name": entry.name, "source": entry.source, "class": f"{cls.__module__}.{cls.__qualname__}",
            "importable": not missing, "missing": missing,
            "runs_here": not missing and not device_reasons and not build_reasons,
            "device_reasons": device_reasons, "build_reasons": build_reasons,
            "ladder_placement": None if entry.placement is None else entry.placement.describe(),
            "description": cls.description, "capabilities": capability_data(cls),
            "configurations": _configurations(cls)}


def _status(r: dict[str, Any], extra: str | None) -> str:
    if not r["importable"]:
        how = f" (pip install 'mla-backends[{extra}]')" if extra else ""
        return f"not importable: {', '.join(r['missing'])} missing{how}"
    if r["runs_here"]:
        return "importable, runs here"
    return "importable; does not run here: " + "; ".join(r["device_reasons"] + r["build_reasons"])


def _configurations(cls: type) -> list[dict[str, object]] | None:
    """A backend's launch-configuration table (``cls.configurations()``, when it declares one) as data."""
    fn = getattr(cls, "configurations", None)
    if not callable(fn):
        return None
    try:
        with plugin_call(cls, "configurations()"):
            return list(fn())
    except USER_CODE_FAILURES as exc:  # a plugin's table must not break (or end) the listing
        return [{"archs": "?", "heads": "?", "operands": "?", "attention": "?", "option": "",
                 "candidates": [f"error: {failure_text(exc)}"]}]


def run(args: argparse.Namespace) -> int:
    from selector.detect import resolve_device
    from selector.explain import capability_summary, device_dict

    from ..plugins.loading import get_registry
    from ..plugins.registry import PluginProblem

    device = resolve_device(args.device)
    reg = get_registry()
    described = []  # (entry, row, capability summary) of every backend that could be described
    shown = list(reg.problems)
    for e in reg.entries():
        try:  # a plugin's class that breaks while being described is shown as its problem, never raised
            with plugin_call(e.cls, "being described"):
                described.append((e, _row(e, device), capability_summary(e.cls)))
        except USER_CODE_FAILURES as exc:
            if e.source == "builtin":
                raise
            shown.append(PluginProblem(plugin=e.source, stage="list", error=f"{e.name}: {failure_text(exc)}"))
    problems = [{"plugin": p.plugin, "stage": p.stage, "error": p.error} for p in shown]
    rows = [r for _, r, _ in described]
    if args.json:
        print(json.dumps({"device": device_dict(device), "backends": rows, "plugin_problems": problems},
                         indent=2, default=str))
        return 0
    print(f"Device: {device.describe()} ('runs here' refers to it; --device to ask about another)")
    for _, r, c in described:
        print(f"{r['name']}  [{r['source']}]  {_status(r, c['extra'])}")
        if r["description"]:
            print(f"    {r['description']}")
        print(f"    devices: {c['devices']}   dtypes: {', '.join(c['dtypes'])}")
        fp8 = c["fp8_min_compute_capability"]
        fp8_text = f" (fp8 from SM{fp8[0]}{fp8[1]})" if fp8 else ""
        print(f"    kv cache: {', '.join(c['kv_cache_dtypes'])}{fp8_text}   pages: {c['page_sizes']} "
              f"(preferred {c['preferred_page_size']})")
        lse = "yes" if c["returns_lse"] else "no"
        print(f"    dims: {c['dims']}   heads: {c['num_heads']}   query: {c['query_len']} "
              f"(decode threshold {c['decode_threshold']})   {c['attention']}   LSE: {lse}")
        for row in r.get("configurations") or ():
            print(f"    config: {row['archs']:9s} heads {row['heads']:5s} {row['operands']:5s} {row['attention']:12s}"
                  f"{(' [' + row['option'] + ']') if row['option'] else ''} -> {', '.join(row['candidates'])}")
        if r["source"] != "builtin":
            print(f"    ladder: {r['ladder_placement'] or 'none (select it with --backend / MLA_BACKEND)'}")
    if problems:
        print("\nPlugin problems (ignored):")
        for p in shown:
            print(f"  - {p.describe()}")
    return 0
