"""Which tensor-core instructions a compiled ``TRITON_MLA`` kernel runs, per role, and how its warps split them.

Used by ``triton_compile_report.py`` (fields ``mma_instructions`` and ``mma_tiles``); standard library only,
so the tests run it on small SASS and TTGIR excerpts as well as on the committed reports.

* **Roles.** In an attention kernel a dot whose result is ``[rows, BLOCK_N]`` is a *score* dot (queries x
  cache tile, over the 576 columns); the others are *output* dots (probabilities x latent tile). Every MMA
  of a merge kernel (``mla_decode_merge``, ``mla_decode_stage2``) is *merge* (there are none today).
* **Instructions** come from the SASS (``cuobjdump -sass``), counted by opcode and shape
  (``HGMMA.64x16x16``, ``QGMMA.64x16x32``, ``HMMA.16816``), in the kernel's code: every warpgroup runs that
  code, so a count is per warpgroup per loop iteration (the loop body is not unrolled) plus any prologue
  or epilogue copy. An instruction shape is given to the role whose TTGIR layout (``instrShape``) has that
  shape; a shape two roles share (``mma.sync``'s ``HMMA.16816`` of the portable kernel) is listed under
  ``"score+output"``, since the SASS alone does not tell them apart.
* **Tiles** come from the TTGIR layout of each dot's result (``#ttg.nvidia_mma<{versionMajor, warpsPerCTA,
  instrShape}>``): for Hopper's ``wgmma`` (version 3) the four warps of a warpgroup stack along the rows, so
  ``warpsPerCTA = [wm, wn]`` puts ``wm / 4`` warpgroups along the rows and ``wn`` along the columns; a tile
  smaller than the warpgroups' span is computed by each of them in full (``copies`` > 1: duplicated work).
  For ``mma.sync`` (version 2) the same is given per warp (16 x 8 the smallest piece).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MERGE_KERNELS", "ROLES", "sass_mma_counts", "ttgir_dots", "mma_summary"]

#: kernels whose MMAs (if any) are the merge's
MERGE_KERNELS = ("mla_decode_merge", "mla_decode_stage2")
#: the roles always present in ``mma_instructions`` / ``mma_tiles`` (possibly empty)
ROLES = ("score", "output", "merge")

_SASS_MMA = re.compile(r"\b([A-Z]*MMA)\.(\d+(?:x\d+)*)\b")
_LAYOUT = re.compile(r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, "
                     r"warpsPerCTA = \[([\d, ]+)\].*?instrShape = \[([\d, ]+)\]", re.M)
_DOT = re.compile(r"(?:tt\.dot|ttng\.warp_group_dot) [^\n]*?:\s*(?:!ttg\.memdesc|tensor)<(\d+)x(\d+)x\w+[^\n]*?"
                  r"->\s*tensor<(\d+)x(\d+)x\w+, #(\w+)>")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def sass_mma_counts(sass: str) -> dict[str, int]:
    """``{"HGMMA.64x16x16": 72, ...}``: every tensor-core instruction of ``sass`` by opcode and shape."""
    counts: dict[str, int] = {}
    for line in sass.splitlines():
        m = _SASS_MMA.search(line.split(";")[0])
        if m:
            key = f"{m.group(1)}.{m.group(2)}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def ttgir_dots(ttgir: str) -> list[dict[str, Any]]:
    """Every dot of ``ttgir``: ``{"m", "n", "k", "version", "warps_per_cta", "instr_shape"}`` (``m x n`` the
    result tile, ``k`` the reduction length, the rest from the result's ``nvidia_mma`` layout)."""
    layouts = {m.group(1): (int(m.group(2)), _ints(m.group(3)), _ints(m.group(4)))
               for m in _LAYOUT.finditer(ttgir)}
    dots = []
    for m in _DOT.finditer(ttgir):
        a_m, k, r_m, r_n, name = int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5)
        if name not in layouts:  # an FMA dot (fp32 "ieee"): no tensor-core layout
            continue
        version, warps, instr = layouts[name]
        dots.append({"m": r_m, "n": r_n, "k": k if a_m == r_m else None, "version": version,
                     "warps_per_cta": warps, "instr_shape": instr})
    return dots


def _role(kernel: str, dot: dict[str, Any], block_n: int | None) -> str:
    if kernel in MERGE_KERNELS:
        return "merge"
    return "score" if dot["n"] == block_n else "output"


def _split(dot: dict[str, Any], num_warps: int) -> dict[str, Any]:
    """Rows x columns each warpgroup (``wgmma``) or warp (``mma.sync``) computes of one dot's result."""
    m, n = dot["m"], dot["n"]
    wm, wn = dot["warps_per_cta"]
    if dot["version"] >= 3:  # a warpgroup's 4 warps stack along the rows: 64 rows at least
        units, along_m, min_m, key = num_warps // 4, max(wm // 4, 1), 64, "per_warpgroup"
    else:
        units, along_m, min_m, key = num_warps, wm, 16, "per_warp"
    rows = max(m // along_m, min(m, min_m))
    cols = max(n // wn, min(n, dot["instr_shape"][1]))
    return {key: [rows, cols], "copies": rows * cols * units / (m * n)}


def _instr_matches(key: str, dot: dict[str, Any]) -> bool:
    shape = key.split(".", 1)[1]
    instr = dot["instr_shape"]
    if "x" in shape:  # wgmma: 64 x N x K
        _, n, k = (int(v) for v in shape.split("x"))
        return dot["version"] >= 3 and len(instr) == 3 and (instr[1], instr[2]) == (n, k)
    m_n = shape[:3]  # mma.sync: "16816" = m16 n8 k16, "1688" = m16 n8 k8
    return dot["version"] == 2 and [int(m_n[:2]), int(m_n[2:])] == list(instr[:2])


def mma_summary(kernel: str, ttgir: str, sass: str, block_n: int | None,
                num_warps: int) -> tuple[dict[str, dict[str, int]], dict[str, list[dict[str, Any]]]]:
    """``(mma_instructions, mma_tiles)`` of one compiled kernel.

    ``mma_instructions``: ``{role: {"HGMMA.64x16x16": count, ...}}`` from the SASS, roles as above (plus
    ``"score+output"`` or ``"other"`` where the layouts cannot tell). ``mma_tiles``: ``{role: [{"dots",
    "tile": [rows, cols], "k" (each dot's reduction length), "warps_per_cta", "instr_shape",
    "per_warpgroup" | "per_warp": [rows, cols], "copies"}]}``, one entry per distinct (tile, layout) of the
    role's dots.
    """
    dots = [dict(d, role=_role(kernel, d, block_n)) for d in ttgir_dots(ttgir)]
    instructions: dict[str, dict[str, int]] = {r: {} for r in ROLES}
    for key, count in sass_mma_counts(sass).items():
        roles = sorted({d["role"] for d in dots if _instr_matches(key, d)}, key=lambda r: (ROLES + (r,)).index(r))
        role = "+".join(roles) if roles else "other"
        instructions.setdefault(role, {})[key] = count
    tiles: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
    for d in dots:
        entry = {"tile": [d["m"], d["n"]], "k": [d["k"]], "warps_per_cta": d["warps_per_cta"],
                 "instr_shape": d["instr_shape"], **_split(d, num_warps)}
        same = [e for e in tiles[d["role"]] if {k: v for k, v in e.items() if k not in ("dots", "k")}
                == {k: v for k, v in entry.items() if k != "k"}]
        if same:
            same[0]["dots"] += 1
            same[0]["k"].append(d["k"])
        else:
            tiles[d["role"]].append({"dots": 1, **entry})
    return instructions, tiles
