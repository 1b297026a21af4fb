"""Every on/off environment switch is parsed one way (mla_backends.core.env_switches): the documented spellings mean
what they say, anything else is refused naming the variable, the value and the spellings; the callers
(vLLM plugin, plugin autoload, the Triton interpreter switch, the SGLang switch) all go through it, and
``mla-backends env`` quotes the value it read and its parsed state."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mla_backends.backends.capabilities import env_switch_on
from mla_backends.core import env_switches as sw
from mla_backends.plugins.loading import autoload_enabled

ROOT = Path(__file__).resolve().parents[1]
TRUE = ["1", "true", "True", "TRUE", "yes", "YES", "on", "On"]
FALSE = ["0", "false", "False", "no", "NO", "off", "Off", ""]
BAD = ["00", "2", "-1", "y", "n", " 1", "1 ", "enabled", "disable", "tru"]


@pytest.mark.parametrize("name", sorted(sw.SWITCHES))
def test_every_switch_reads_the_same_spellings(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(name, raising=False)
    assert sw.switch_on(name) is False  # unset
    for v in TRUE:
        assert sw.switch_on(name, {name: v}) is True, v
    for v in FALSE:
        assert sw.switch_on(name, {name: v}) is False, v
    for v in BAD:
        with pytest.raises(sw.EnvSwitchError) as exc:
            sw.switch_on(name, {name: v})
        msg = str(exc.value)
        assert msg.startswith(f"{name}: got {v!r}; supported true 1, true, yes, on; false 0, false, no, off"), msg
        assert isinstance(exc.value, ValueError)


def test_the_sglang_switch_is_declared() -> None:
    assert sw.SGLANG_SWITCH == "MLA_BACKENDS_SGLANG" and sw.SGLANG_SWITCH in sw.SWITCHES
    assert sw.switch_on("MLA_BACKENDS_SGLANG", {"MLA_BACKENDS_SGLANG": "off"}) is False


def test_parse_switch_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="name: got ''"):
        sw.parse_switch("", "1")
    with pytest.raises(TypeError, match="X: got int; supported a string"):
        sw.parse_switch("X", 1)  # type: ignore[arg-type]
    assert sw.describe_switch("X", {"X": "2"}) == {"value": "2", "on": None,
                                                   "error": str(_err("X", "2"))}


def _err(name: str, value: str) -> sw.EnvSwitchError:
    try:
        sw.parse_switch(name, value)
    except sw.EnvSwitchError as exc:
        return exc
    raise AssertionError("not refused")


@pytest.mark.parametrize("value,autoload", [("false", True), ("off", True), ("no", True), ("0", True),
                                            ("1", False), ("true", False), ("ON", False)])
def test_autoload_switch(value: str, autoload: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", value)
    assert autoload_enabled() is autoload


@pytest.mark.parametrize("value", ["2", "00", "y"])
def test_autoload_switch_refuses_unknown_spellings(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", value)
    with pytest.raises(sw.EnvSwitchError, match=f"MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD: got {value!r}"):
        autoload_enabled()


@pytest.mark.parametrize("value,on", [("false", False), ("off", False), ("no", False), ("0", False),
                                      ("1", True), ("true", True)])
def test_triton_interpret_switch(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.triton_mla.interpreter import interpreter_enabled

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env_switch_on("TRITON_INTERPRET") is on
    assert interpreter_enabled() is on


def test_triton_interpret_false_keeps_triton_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRITON_INTERPRET=false`` means off to Triton; the selection must not take the CPU as interpreted."""
    from selector import select_backend
    from selector.select import SelectionError, clear_cache

    monkeypatch.setenv("MLA_BACKEND", "TRITON_MLA")
    for value in ("false", "off"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        clear_cache()
        with pytest.raises(SelectionError, match="device: got CPU"):
            select_backend("deepseek-v3", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "2")
    clear_cache()
    with pytest.raises(sw.EnvSwitchError, match="TRITON_INTERPRET: got '2'"):
        select_backend("deepseek-v3", device="cpu")
    clear_cache()


#: names a module might use for a switch's variable
_SWITCH_CONSTANTS = {"ENV_VAR", "VLLM_SWITCH", "SGLANG_SWITCH", "AUTOLOAD_OFF_SWITCH", "TRITON_INTERPRET_SWITCH",
                     "DISABLE_AUTOLOAD_ENV", "INTERPRET_ENV"}


def _reads_a_switch(node: ast.AST) -> bool:
    def names_switch(arg: ast.AST) -> bool:
        return ((isinstance(arg, ast.Constant) and arg.value in sw.SWITCHES)
                or (isinstance(arg, (ast.Name, ast.Attribute))
                    and (arg.id if isinstance(arg, ast.Name) else arg.attr) in _SWITCH_CONSTANTS))

    if isinstance(node, ast.Call) and node.args:
        f = ast.unparse(node.func)
        if f.endswith(("environ.get", "getenv")) and names_switch(node.args[0]):
            return True
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return ast.unparse(node.value).endswith("environ") and names_switch(node.slice)
    return False


def test_no_module_reads_a_switch_by_itself() -> None:
    """Only mla_backends/core/env_switches.py (and capabilities.env_switch_on's snapshot) read a switch's value."""
    offenders = []
    for base in ("mla_backends", "selector"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("mla_backends/core/env_switches.py",):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if _reads_a_switch(node):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"switch values read outside mla_backends.core.env_switches: {offenders}"


def test_the_scan_finds_a_private_reader() -> None:
    tree = ast.parse('import os\nv = os.environ.get("MLA_BACKENDS_VLLM", "0") not in ("", "0")\n'
                     'w = os.environ[ENV_VAR]\n')
    assert sum(_reads_a_switch(n) for n in ast.walk(tree)) == 2


def test_env_command_quotes_values_and_states(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from mla_backends.cli import main

    monkeypatch.setenv("MLA_BACKENDS_VLLM", "false")
    monkeypatch.setenv("MLA_BACKENDS_SGLANG", "00")
    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", "off")
    assert main(["env", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    env = rep["environment"]
    assert env["MLA_BACKENDS_VLLM"]["value"] == "false" and env["MLA_BACKENDS_VLLM"]["on"] is False
    assert env["MLA_BACKENDS_SGLANG"]["on"] is None and "got '00'" in env["MLA_BACKENDS_SGLANG"]["error"]
    assert env["MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD"]["on"] is False
    assert rep["vllm"]["plugin_would_activate"] is False
    assert "MLA_BACKENDS_VLLM=1" not in rep["vllm"]["reason"]
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "  MLA_BACKENDS_VLLM=false  (off; " in text
    assert "  MLA_BACKENDS_SGLANG=00  (REFUSED: MLA_BACKENDS_SGLANG: got '00'; supported" in text
    assert "would activate" not in text


def test_env_command_reports_a_bad_autoload_switch_instead_of_failing(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys) -> None:  # type: ignore[no-untyped-def]
    from mla_backends.cli import main
    from mla_backends.plugins.loading import reset_registry

    monkeypatch.setenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", "2")
    reset_registry()
    try:
        assert main(["env"]) == 0
        text = capsys.readouterr().out
        assert "problem: plugin '(none loaded)' (environment): MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD: got '2'" in text
        assert "  MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD=2  (REFUSED: " in text
        assert main(["list"]) != 0  # commands that need the registry refuse it
        assert "MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD: got '2'" in capsys.readouterr().err
    finally:
        monkeypatch.delenv("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD")
        reset_registry()
