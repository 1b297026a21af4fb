"""Issue 37, part 7 (first two items): a stdout that cannot be written ends every command quietly with 141.

- A pipe whose reader is gone before the first write: argparse's ``--help`` / ``--version`` swallow the write
  error when the stream is unbuffered (``PYTHONUNBUFFERED=1``), so they exited 0; they must give 141 either way,
  as the commands do.
- A stdout closed outright (``>&-``: Python has no ``sys.stdout``): every command, ``--help`` and ``--version``
  end with 141 and print nothing (no traceback, and no help sent to stderr instead).

These run real processes: the pipe's read end is closed before the child starts, so every write fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def _into_closed_pipe(argv: list[str], unbuffered: bool) -> tuple[int, str]:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the child writes anything
    env = {**ENV, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})}
    try:
        proc = subprocess.run([sys.executable, "-m", "mla_backends", *argv], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, env=env, timeout=300)
    finally:
        os.close(write)
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["kv-cache", "--help"], ["--version"], ["--help"], ["list", "--help"],
                                  ["select", "-h"]])
def test_help_and_version_into_a_closed_pipe_exit_141(argv: list[str], unbuffered: bool) -> None:
    rc, err = _into_closed_pipe(argv, unbuffered)
    assert rc == 141 and err == "", (rc, err[-2000:])


def _with_stdout_closed(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", 'exec "$0" -m mla_backends "$@" >&-', sys.executable, *argv], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.parametrize("argv", [["kv-cache"], ["env"], ["--version"], ["--help"], ["kv-cache", "--help"],
                                  ["list", "--json"], ["select", "--device", "cpu"], ["crossover"],
                                  ["demo", "--help"], ["conformance", "--help"], ["tune", "--help"],
                                  ["kv-cache", "--bogus"], []])
def test_a_stdout_closed_outright_ends_every_command_quietly(argv: list[str]) -> None:
    proc = _with_stdout_closed(argv)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr[-2000:])


def test_a_command_with_stdout_closed_does_no_work(tmp_path: Path) -> None:
    """Nothing runs whose output nobody could see: ``tune --output`` writes no file."""
    out = tmp_path / "t.json"
    proc = _with_stdout_closed(["tune", "--model", "deepseek-v2-lite", "--backend", "REF_TORCH", "--quick",
                                "--query-lens", "1", "--context", "8", "--no-progress", "--output", str(out)])
    assert proc.returncode == 141 and proc.stderr == "" and not out.exists()


def test_stdout_missing_reads_the_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.cli import pipes

    monkeypatch.setattr(sys, "stdout", None)
    assert pipes.stdout_missing()
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    assert not pipes.stdout_missing()
    os.close(write)  # the descriptor under the stream is gone
    try:
        assert pipes.stdout_missing()
    finally:
        os.close(read)
        try:
            stream.close()
        except OSError:
            pass
