"""What tests/vllm_engine and tests/sglang_engine share, once: the prompts, the check for the engine's environment
and the collection hook that skips a folder elsewhere, the environment engine processes get, driver processes
(started together, their JSON reports read back), phases isolated in a child process, and a served engine
(started on 127.0.0.1 at a free port, waited for, queried with the ``openai`` client, stopped).

Engine tests run in the engine's own environment (``.venv-vllm``, ``.venv-sglang``) and start engines in other
processes; every wait here is bounded. tests/ is on ``sys.path`` (tests/conftest.py's folder), so both folders
import this module by name, and so do their driver processes (:func:`engine_env` puts tests/ on their path).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: the prompts every engine test generates from (3 to 37 tokens), and how many tokens each generates
PROMPTS = [[5, 17, 33, 8, 9, 100, 42], [7, 8, 9], list(range(3, 40)), [150, 3, 77, 91, 12, 5, 6, 8, 10, 11, 99]]
NEW_TOKENS = 10
#: switches and settings of the outer test run that must not leak into an engine process
LEAKY_ENV = ("MLA_BACKENDS_VLLM", "MLA_BACKENDS_SGLANG", "MLA_BACKEND", "TRITON_INTERPRET",
             "MLA_BACKENDS_THRESHOLD_TABLE", "MLA_SPY_FILE", "MLA_FAKE_QUANT")


def engine_installed(module: str) -> bool:
    """True when the engine package ``module`` is really installed here (a directory of that name on the path
    is only a namespace package: no origin)."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None


def skip_reason(engine: str, venv: str, make_target: str, folder: str) -> str:
    return (f"{engine} is not installed in this environment: tests/{folder} run in {venv} (`make {make_target}`; "
            "`make test` runs them)")


def skip_folder_elsewhere(items: Iterable[pytest.Item], folder: Path, installed: bool, reason: str) -> None:
    """The body of an engine folder's ``pytest_collection_modifyitems``: outside the engine's environment every
    test of ``folder`` is skipped with ``reason``."""
    if installed:
        return
    mark = pytest.mark.skip(reason=reason)
    for item in items:
        if folder in Path(str(item.fspath)).resolve().parents:
            item.add_marker(mark)


def engine_env(folder: Path, set_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an engine process: the outer run's switches removed (:data:`LEAKY_ENV`),
    tests/ and ``folder`` put first on ``PYTHONPATH`` (so drivers, spies and this module import by name) and the
    main suite's ``.test-site`` taken off it (its deliberately broken plugin would be loaded, and logged, by every
    engine process), then ``set_env``."""
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.endswith(".test-site")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(TESTS), str(folder), *path]))
    env.update(set_env or {})
    return env


class Drivers:
    """Driver processes, one per key: all started at once (``together``: an engine leaves the cores idle at times)
    or each at its first :meth:`report` (engines too large to run side by side). :meth:`report` waits (bounded)
    for its driver and reads the JSON report it wrote to ``workdir``."""

    def __init__(self, workdir: Path, commands: Mapping[str, Sequence[str]], env: Mapping[str, str],
                 timeout_s: float, *, together: bool = True, may_fail: Iterable[str] = ()) -> None:
        self.workdir, self.timeout_s, self.commands, self.env = workdir, timeout_s, commands, dict(env)
        self.may_fail = set(may_fail)
        self.procs: dict[str, tuple[subprocess.Popen, object]] = {}
        for key in commands if together else ():
            self._start(key)
        self.reports: dict[str, dict] = {}

    def _start(self, key: str) -> None:
        log = open(self.workdir / f"driver-{key}.log", "w")
        proc = subprocess.Popen(list(self.commands[key]), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[key] = (proc, log)

    def report(self, key: str) -> dict:
        if key not in self.reports:
            if key not in self.procs:
                self._start(key)
            proc, log = self.procs[key]
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)
            log.close()  # type: ignore[attr-defined]
            text = (self.workdir / f"driver-{key}.log").read_text(errors="replace")
            path = self.workdir / f"report-{key}.json"
            if key in self.may_fail and (proc.returncode != 0 or not path.exists()):
                self.reports[key] = {"error": f"rc {proc.returncode}", "log": text[-20000:]}
                return self.reports[key]
            assert proc.returncode == 0, f"driver {key} failed (rc {proc.returncode}):\n{text[-6000:]}"
            rep = json.loads(path.read_text())
            rep["log"] = text
            self.reports[key] = rep
        return self.reports[key]

    def stop(self) -> None:
        for proc, log in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            log.close()  # type: ignore[attr-defined]


def cpu_choice() -> str:
    """The backend the selector gives the CPU on this machine: CPU_FUSED where ``mla-backends build`` made its
    kernel, else REF_TORCH (what the engines' start-up lines name)."""
    from mla_backends.cpu_fused import build

    return "CPU_FUSED" if build.is_built() else "REF_TORCH"


def nan_backends() -> list:
    """The CPU backends the adapter-level NaN tests run (TRITON_MLA interpreted; CPU_FUSED skipped where it is
    not built)."""
    from mla_backends.cpu_fused import build

    return ["REF_TORCH", "TRITON_MLA", pytest.param("CPU_FUSED", marks=pytest.mark.skipif(
        not build.is_built(), reason="CPU_FUSED is not built for this machine (mla-backends build)"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(cmd: Sequence[str], env: Mapping[str, str], log: Path, port: int, *, start_timeout_s: float,
           stop_timeout_s: float = 60) -> Iterator[Path]:
    """A server process (``cmd``, its own session) on 127.0.0.1:``port``, yielded once ``/health`` answers 200;
    stopped afterwards (terminated, then its whole session killed). Yields its log file."""
    f = open(log, "w")
    proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            assert proc.poll() is None, f"{cmd[2]} exited (rc {proc.returncode}):\n{log.read_text()[-5000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the server was not healthy in {start_timeout_s} s"
            time.sleep(2)
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the server's own session: its engine processes too
            proc.wait(timeout=stop_timeout_s)
        f.close()


def served_tokens(port: int, model: str, prompts: Sequence[Sequence[int]] = PROMPTS,
                  new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy token ids of each prompt (token ids in) from an OpenAI-compatible server (``return_token_ids``)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)
    got = []
    for prompt in prompts:
        res = client.completions.create(model=model, prompt=list(prompt), max_tokens=new_tokens, temperature=0.0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        got.append(list(res.choices[0].token_ids))
    return got


def python_cmd(script: Path, *args: object) -> list[str]:
    """``[this Python, script, *args]``."""
    return [sys.executable, str(script), *map(str, args)]


def driver_fixtures(*, folder: Path, engine: str, installed: bool, reason: str, script: Path,
                    env: Callable[[], Mapping[str, str]], timeout_s: float, together: bool,
                    isolated: Mapping[str, Sequence[str]] | None = None) -> tuple:
    """The session fixtures of an engine folder's conftest: ``workdir`` (a folder of its own under the system's
    temporary directory, removed at the end; pytest's numbered ``tmp_path`` folders are pruned by any other
    pytest session on the machine, even while this one runs), ``drivers`` (``script v2|v3 WORKDIR``, see
    :class:`Drivers`) and ``report_v2`` / ``report_v3``. Assign them to those names in the conftest.

    ``isolated``: per driver kind, the phases that run in a process of their own (``script KIND WORKDIR PHASE``,
    driver key ``KIND-PHASE``, started beside the drivers; a phase may fail: its report is then ``{"error": ...,
    "log": ...}``), found in the kind's report under the phase's name. They are the pytest process's children,
    not a driver's: an engine shut down in a driver kills every child process of that driver."""
    phases = {kind: list(names) for kind, names in (isolated or {}).items()}

    @pytest.fixture(scope="session")
    def workdir() -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix=f"mla-{engine}-tests-"))
        yield path
        if not os.environ.get("MLA_KEEP_ENGINE_WORKDIR"):
            shutil.rmtree(path, ignore_errors=True)

    @pytest.fixture(scope="session")
    def drivers(workdir: Path) -> Iterator[Drivers]:
        if not installed:
            pytest.skip(reason)
        cmds = {kind: python_cmd(script, kind, workdir) for kind in ("v2", "v3")}
        extra = {f"{kind}-{name}": python_cmd(script, kind, workdir, name) for kind, names in phases.items()
                 for name in names}
        d = Drivers(workdir, cmds | extra, engine_env(folder, env()), timeout_s, together=together, may_fail=extra)
        try:
            yield d
        finally:
            d.stop()

    def report(drivers: Drivers, kind: str) -> dict:
        return drivers.report(kind) | {name: drivers.report(f"{kind}-{name}") for name in phases.get(kind, ())}

    @pytest.fixture(scope="session")
    def report_v2(drivers: Drivers) -> dict:
        return report(drivers, "v2")

    @pytest.fixture(scope="session")
    def report_v3(drivers: Drivers) -> dict:
        return report(drivers, "v3")

    return workdir, drivers, report_v2, report_v3
