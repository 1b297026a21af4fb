"""Every Python and shell block of README.md and docs/*.md marked ``<!-- runnable -->`` runs as written.

The marker is an HTML comment (invisible when rendered) on the line before the block's opening fence, blank
lines allowed in between. A Python or shell block that cannot run here (it needs a checkpoint, a GPU, an
engine, a second process, a plugin package, minutes, or it installs or builds environments) says so instead:
``<!-- not runnable: <why> -->``, so that no block is left unmarked by accident. Each runnable block runs from
an empty folder, with the repository on the path and none of the test suite's environment switches
(``TRITON_INTERPRET``, ``MLA_BACKEND``), as a reader who pastes it would run it: a Python block in a fresh
interpreter, a shell block in ``bash -e`` with this interpreter's ``bin`` folder (the ``mla-backends``
command) first on ``PATH``. Other blocks (``text`` output, ``toml`` configuration) are shown, not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUNNABLE = "<!-- runnable -->"
NOT_RUNNABLE = re.compile(r"^<!-- not runnable: .+ -->$")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, the line of its opening fence (1-based), language, marker and code."""

    page: Path
    line: int
    language: str
    marker: str | None
    code: str

    @property
    def label(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of a markdown page, with the HTML-comment marker before it (None when none)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        before = lines[k].strip() if k >= 0 else ""
        marker = before if before.startswith("<!--") else None
        blocks.append(Block(page, start + 1, m.group(1), marker, "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return blocks


#: the languages of blocks meant to be run (each must be marked runnable or not runnable)
RUN_LANGUAGES = ("python", "bash")


def code_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page) if b.language in RUN_LANGUAGES]


def python_blocks() -> list[Block]:
    return [b for b in code_blocks() if b.language == "python"]


RUNNABLE_BLOCKS = [b for b in code_blocks() if b.marker == RUNNABLE]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MLA_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=[b.label for b in RUNNABLE_BLOCKS])
def test_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    suffix = ".py" if block.language == "python" else ".sh"
    script = tmp_path / (block.page.stem + f"_{block.line}{suffix}")
    script.write_text(block.code)
    cmd = [sys.executable, str(script)] if block.language == "python" else ["bash", "-e", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_every_python_and_shell_block_is_marked() -> None:
    unmarked = [b.label for b in code_blocks()
                if b.marker != RUNNABLE and not (b.marker and NOT_RUNNABLE.match(b.marker))]
    assert not unmarked, (f"python and bash blocks without {RUNNABLE} or '<!-- not runnable: why -->' before "
                          "them: " + ", ".join(unmarked))


def test_the_host_engine_program_and_the_layer_page_are_runnable() -> None:
    """The README's engine program shows the whole step (both paths), reading the split from the plan and writing
    the cache through it; layer.md's API block runs too."""
    readme = [b for b in RUNNABLE_BLOCKS if b.page.name == "README.md"]
    assert any("forward_mqa" in b.code and "forward_mha" in b.code and "select_backend" in b.code
               and "plan.runs_of(backend)" in b.code and "cache.write(kv_c, k_pe, plan)" in b.code
               and "select_requests" not in b.code for b in readme)
    assert any("random_hf_state_dict" in b.code and "preferred_block_size" in b.code
               for b in RUNNABLE_BLOCKS if b.page.name == "layer.md")


def test_the_extractor_reads_markers_and_fences(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- runnable -->\n\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
                    "<!-- not runnable: needs a GPU -->\n```python\nz = 3\n```\n```bash\nls\n```\n")
    blocks = fenced_blocks(page)
    assert [(b.language, b.marker, b.code) for b in blocks] == [
        ("python", RUNNABLE, "x = 1\n"), ("python", None, "y = 2\n"),
        ("python", "<!-- not runnable: needs a GPU -->", "z = 3\n"), ("bash", None, "ls\n")]
    assert [b.line for b in blocks] == [4, 8, 12, 15]
