"""The plugin against the installed SGLang, without an engine: the entry point SGLang loads, inert without the
switch; with it, ``mla_backends`` among ``--attention-backend``'s choices, in SGLang's backend registry and with
its DeepSeek handler; another SGLang version fails at start-up naming the supported range; a switch value that is
no on/off spelling refuses SGLang's start-up whatever attention backend is asked for, with one log line naming
the variable and the value. Each case runs in a fresh interpreter (registration is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_harness import engine_env
from sglang_env import HAVE_SGLANG, SKIP_REASON

PROBE = r"""
import json, sys
import sglang
if len(sys.argv) > 1:
    sglang.__version__ = sys.argv[1]
from sglang.srt.plugins import load_plugins
load_plugins()  # what SGLang's engine, server and scheduler run first
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
out = {"choice": "mla_backends" in ATTENTION_BACKEND_CHOICES, "registry": "mla_backends" in ATTENTION_BACKENDS,
       "handler": getattr(AttentionBackendRegistry._handlers.get("mla_backends"), "__qualname__", None)}
if out["registry"]:
    try:
        ATTENTION_BACKENDS["mla_backends"](None)
    except Exception as exc:
        out["create"] = f"{type(exc).__name__}: {exc}"
from sglang.srt.server_args import ServerArgs
try:  # what Engine(...) and launch_server do next, with SGLang's own attention backend
    ServerArgs(model_path="/nonexistent-model", attention_backend="triton", device="cpu").check_server_args()
    out["start"] = "passed"
except Exception as exc:
    out["start"] = f"{type(exc).__name__}: {exc}"
print("REPORT" + json.dumps(out))
"""


#: the probes: (switch, version) -> their report; all started at once (each is a fresh interpreter importing SGLang)
CASES = {"off": (None, None), "on": ("1", None), "other_version": ("1", "0.5.22"), "bad_switch": ("enabled", None)}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    procs = {}
    for key, (switch, version) in CASES.items():
        env = engine_env(Path(__file__).resolve().parent, {"SGLANG_USE_CPU_ENGINE": "1"})
        if switch is not None:
            env["MLA_BACKENDS_SGLANG"] = switch
        procs[key] = subprocess.Popen([sys.executable, "-c", PROBE, *([version] if version else [])],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-4000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("REPORT"))
        out[key] = json.loads(line.removeprefix("REPORT")) | {"stderr": stderr}
    return out


def test_entry_point_in_sglang_plugins_group() -> None:
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("mla_backends") == "mla_backends.integrations.sglang:register"


def test_inert_without_the_switch(probes: dict[str, dict]) -> None:
    out = probes["off"]
    assert (out["choice"], out["registry"], out["handler"]) == (False, False, None)
    assert "EnvSwitchError" not in out["start"]  # SGLang's own checks of these made-up arguments, not the plugin's
    assert "mla-backends" not in out["stderr"]


def test_a_bad_switch_value_refuses_start_up_whatever_the_backend(probes: dict[str, dict]) -> None:
    """``MLA_BACKENDS_SGLANG=enabled`` with SGLang's own attention backend: SGLang's start-up (its
    ``check_server_args``, the first thing ``Engine`` and ``launch_server`` do after loading plugins) raises the
    switch's error, and the log carries one line naming the variable and the value."""
    out = probes["bad_switch"]
    assert not out["registry"] and not out["choice"]  # nothing registered
    assert out["start"].startswith("EnvSwitchError: MLA_BACKENDS_SGLANG: got 'enabled'; supported true 1, true, yes")
    lines = [ln for ln in out["stderr"].splitlines() if "MLA_BACKENDS_SGLANG" in ln]
    assert len(lines) == 1, out["stderr"][-3000:]
    assert "got 'enabled'" in lines[0] and "SGLang's start-up is refused" in lines[0]
    assert "Traceback" not in out["stderr"] and "Failed to execute general plugin" not in out["stderr"]


def test_registered_with_the_switch(probes: dict[str, dict]) -> None:
    out = probes["on"]
    assert "EnvSwitchError" not in out["start"]
    assert out["choice"] and out["registry"] and out["handler"] == "handle_attention"
    # the real factory: handed no model runner, the start-up check of SGLang's internals refuses it by name
    assert out["create"].startswith("SGLangSelectionError: mla-backends: SGLang internal runner.device is missing")


def test_other_sglang_version_fails_at_start_up_naming_the_range(probes: dict[str, dict]) -> None:
    out = probes["other_version"]
    assert out["choice"] and out["registry"]  # so --attention-backend mla_backends reaches the factory
    assert out["create"] == ("UnsupportedSGLangVersionError: SGLang version: got 0.5.22; supported "
                             "sglang>=0.5.23,<0.5.24 (0.5.23 tested). Unset MLA_BACKENDS_SGLANG to run SGLang "
                             "without mla-backends, or install sglang==0.5.23 (`make sglang-env`).")


def test_stand_in_kernel_package_refuses_calls() -> None:
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    import sgl_kernel

    assert "no CPU build" in sgl_kernel.__doc__
    with pytest.raises(sgl_kernel.StandInKernelError, match="sgl_kernel.assign_req_to_token_pool_cpu was called"):
        sgl_kernel.assign_req_to_token_pool_cpu()


def test_env_reports_sglang_and_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    from mla_backends.cli.env_cmd import sglang_status

    monkeypatch.delenv("MLA_BACKENDS_SGLANG", raising=False)
    off = sglang_status()
    assert off["version"] == "0.5.23" and off["plugin_would_activate"] is False
    assert off["reason"] == "MLA_BACKENDS_SGLANG is off (unset); set MLA_BACKENDS_SGLANG=1 to turn the plugin on"
    monkeypatch.setenv("MLA_BACKENDS_SGLANG", "1")
    on = sglang_status()
    assert on["plugin_would_activate"] is True
    assert on["reason"] == ("MLA_BACKENDS_SGLANG='1', SGLang 0.5.23 (tested); start it with --attention-backend "
                            "mla_backends")
