"""``mla-backends build``: compile the CPU_FUSED kernel for this machine into the per-machine cache (once; later
runs find it there). ``--check`` only says whether it is built; ``--force`` rebuilds. ``make install`` runs
this; without a C++ compiler it fails with what to install, and ``REF_TORCH`` keeps serving the CPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="compile the CPU_FUSED kernel for this machine (cached; once per machine)",
                       description="Compile CPU_FUSED's C++ kernel for this CPU's instruction set against the "
                                   "installed torch, into the per-machine cache ($MLA_BACKENDS_CACHE_DIR, else "
                                   "~/.cache/mla-backends). Selection never builds: until this has run (or a "
                                   "CpuFusedBackend made by hand ran once), REF_TORCH serves the CPU.")
    p.add_argument("--check", action="store_true", help="only report whether it is built (exit 1 when not)")
    p.add_argument("--force", action="store_true", help="rebuild even when a library is cached")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def status_dict() -> dict[str, Any]:
    """The build's state as plain data (also ``mla-backends env``'s ``cpu_fused`` entry); nothing is built or
    loaded."""
    from ..cpu_fused import build

    st = build.build_status()
    return {"built": st.built, "path": str(st.path), "key": build.build_key(), "compiler": st.compiler,
            "missing": list(st.missing), "build_seconds": st.build_seconds}


def run(args: argparse.Namespace) -> int:
    import time

    from ..cpu_fused import build

    if args.check:
        rep = status_dict()
        if args.json:
            print(json.dumps(rep, indent=2))
        else:
            print(f"CPU_FUSED: {'built' if rep['built'] else 'not built'} ({rep['path']})")
        return 0 if rep["built"] else 1
    was_built = build.is_built() and not args.force
    t0 = time.perf_counter()
    path = build.build(force=args.force)
    seconds = time.perf_counter() - t0
    info = build.load(build_if_missing=False)
    rep = {**status_dict(), "was_cached": was_built, "seconds": round(seconds, 1), "build_info": info}
    if args.json:
        print(json.dumps(rep, indent=2))
    elif was_built:
        print(f"CPU_FUSED: already built for this machine: {path} ({info})")
    else:
        print(f"CPU_FUSED: built in {seconds:.1f} s: {path} ({info})")
    return 0
