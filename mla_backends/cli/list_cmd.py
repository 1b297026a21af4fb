"""``mla-backends list``: every registered backend, its declared capabilities, availability and plugin."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list registered backends: capabilities, availability, source plugin",
                       description="List every registered backend (built-ins and plugins) with its declared "
                                   "capabilities, whether it can run here, and any plugin that failed to load.")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    p.set_defaults(func=run)


def _configurations(cls: type) -> list[dict[str, object]] | None:
    """A backend's launch-configuration table (``cls.configurations()``, when it declares one) as data."""
    fn = getattr(cls, "configurations", None)
    if not callable(fn):
        return None
    try:
        return list(fn())
    except Exception as exc:  # a plugin's table must not break the listing
        return [{"archs": "?", "heads": "?", "operands": "?", "attention": "?", "option": "",
                 "candidates": [f"error: {exc}"]}]


def run(args: argparse.Namespace) -> int:
    from selector.explain import capability_summary

    from ..plugins import get_registry

    reg = get_registry()
    rows = []
    for e in reg.entries():
        missing = e.cls.missing_requirements()
        rows.append({"name": e.name, "source": e.source, "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
                     "available": not missing, "missing": missing,
                     "ladder_placement": None if e.placement is None else e.placement.describe(),
                     "description": e.cls.description, "capabilities": capability_summary(e.cls),
                     "configurations": _configurations(e.cls)})
    problems = [{"plugin": p.plugin, "stage": p.stage, "error": p.error} for p in reg.problems]
    if args.json:
        print(json.dumps({"backends": rows, "plugin_problems": problems}, indent=2, default=str))
        return 0
    for r in rows:
        c = r["capabilities"]
        avail = "available" if r["available"] else (
            f"not available: {', '.join(r['missing'])} missing (pip install 'mla-backends[{c['extra']}]')")
        print(f"{r['name']}  [{r['source']}]  {avail}")
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
        for p in reg.problems:
            print(f"  - {p.describe()}")
    return 0
