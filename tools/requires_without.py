"""Write an installed distribution's Requires-Dist lines, minus extras and the named packages, to a file.

Usage (from tools/engine_env.sh): ``python tools/requires_without.py DIST OUT NAME [NAME ...]``. Names compare
lower-cased with ``_`` read as ``-``; the engine environments leave out torch (installed first, CPU), its media
packages (CUDA builds on the index) and, for SGLang, the CUDA-only kernel packages."""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires


def main(argv: list[str]) -> int:
    dist, out, *skip_names = argv
    skip = {n.lower().replace("_", "-") for n in skip_names}
    keep = []
    for line in requires(dist) or []:
        if "extra ==" in line:
            continue
        name = re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0].lower().replace("_", "-")
        if name not in skip:
            keep.append(line)
    with open(out, "w") as f:
        f.write("\n".join(keep) + "\n")
    print(f"{dist} Requires-Dist: {len(keep)} kept; left out: {', '.join(sorted(skip))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
