"""Issue 28 item 8 and issue 25 item 3: user code reached through an import path or a plugin cannot end the
caller's process, and an import path that is not found says where it was searched and how to add the folder.
Also issue 28's missing test for ``aliases.py``: no alias note for a name that is registered.

Classes: (1) ``SystemExit`` from any plugin code (an import path's module, a plugin's import, its hook, a
``module:Class`` target it registers) is the project's error or a recorded plugin problem, while
``KeyboardInterrupt`` still stops the caller; (2) the import-path error of a module that is not on
``sys.path`` names the folders searched and suggests ``PYTHONPATH=.`` / ``python -m mla_backends``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

import mla_backends.plugins.loading as plugins
from mla_backends import get_backend
from mla_backends.cli import main
from mla_backends.core.dims import MLADims
from mla_backends.plugins.aliases import alias_note
from mla_backends.plugins.hookspecs import hookimpl
from mla_backends.ref_torch import RefTorchBackend
from selector.select import BackendNotSupportedError, clear_cache, select_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V3 = MLADims.deepseek_v3()


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A module ``name`` written into a folder put on ``sys.path`` (for this test only)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.mark.parametrize("code, shown", [("3", "sys.exit(3)"), ("", "sys.exit()"), ("'bye'", "sys.exit('bye')")])
def test_an_import_path_whose_module_exits_is_a_value_error(tmp_path, monkeypatch, code, shown):
    mod = _module(tmp_path, monkeypatch, f"exits_on_import_{len(code)}", f"import sys\nsys.exit({code})\n")
    with pytest.raises(ValueError, match=re.escape(f"backend: got '{mod}:Backend', which cannot be imported "
                                                   f"(SystemExit: the code called {shown})")):
        get_backend(f"{mod}:Backend")


def test_ctrl_c_during_an_import_still_stops_the_caller(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "interrupted_on_import", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        get_backend(f"{mod}:Backend")


def test_mla_backend_naming_a_module_that_exits_makes_select_fail_with_status_2(tmp_path, monkeypatch, capsys):
    """It used to end `mla-backends select` with status 0 and no output."""
    mod = _module(tmp_path, monkeypatch, "exits_for_select", "import sys\nsys.exit(0)\n")
    monkeypatch.setenv("MLA_BACKEND", f"{mod}:Backend")
    clear_cache()
    try:
        assert main(["select", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "MLA_BACKEND environment variable: backend: got" in err and "sys.exit(0)" in err, err
        assert main(["select", "--device", "cpu", "--json"]) == 2
        assert '"type": "ValueError"' in capsys.readouterr().out
    finally:
        clear_cache()


def test_plugin_code_that_exits_is_recorded_not_raised(tmp_path, monkeypatch):
    """A hook calling sys.exit(), and a 'module:Class' target whose module does, are the plugin's problems."""
    mod = _module(tmp_path, monkeypatch, "exits_as_target", "import sys\nsys.exit(4)\n")
    reg = plugins.load_registry(autoload=False)

    def exiting_hook(register):
        sys.exit(5)

    def target_hook(register):
        register(f"{mod}:Backend", name="TARGET_MLA")

    for name, hook in (("exiting_hook", exiting_hook), ("exiting_target", target_hook)):
        plugin = types.ModuleType(name)
        plugin.register_mla_backends = hookimpl(hook)
        assert plugins.run_plugin(reg, name, plugin) is False
    errors = {p.plugin: (p.stage, p.error) for p in reg.problems}
    assert errors["exiting_hook"] == ("hook", "SystemExit: the code called sys.exit(5)")
    assert errors["exiting_target"] == ("register", "TARGET_MLA: SystemExit: the code called sys.exit(4)")
    assert reg.entry("TARGET_MLA") is None


def test_plugin_whose_import_exits_is_recorded(monkeypatch):
    class EP:
        name = "exits_on_load"

        def load(self):
            raise SystemExit(6)

    monkeypatch.setattr(plugins, "_entry_points", lambda: [EP()])
    reg = plugins.load_registry(autoload=True)
    assert [(p.plugin, p.stage, p.error) for p in reg.problems] == [
        ("exits_on_load", "import", "SystemExit: the code called sys.exit(6)")]
    assert reg.entry("REF_TORCH") is not None


# ---- an import path from the current folder (issue 25 item 3) -------------------------------------------------
RUNNER = """
import sys
from mla_backends.cli import main

rc = main(["conformance", "my_mla:MyMLABackend", "--quick"])  # the module is in the current folder
sys.path.insert(0, ".")  # what PYTHONPATH=. does
rc2 = main(["select", "--device", "cpu", "--backend", "my_mla:MyMLABackend"])
print("status", rc, rc2)
"""

MY_MLA = """
from mla_backends.ref_torch import RefTorchBackend

class MyMLABackend(RefTorchBackend):
    name = "MY_MLA"
"""


def test_import_path_from_the_current_folder_names_the_folders_and_suggests_pythonpath(tmp_path):
    """Run as a console script is (the script's own folder on sys.path, not the current one), from the folder
    holding my_mla.py: the error names that folder and the folders searched, and PYTHONPATH=. then works."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "my_mla.py").write_text(MY_MLA)
    (bin_dir / "runner.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": ROOT, "MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("MLA_BACKEND", None)
    done = subprocess.run([sys.executable, str(bin_dir / "runner.py")], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "status 2 0" in done.stdout, (done.stdout, done.stderr)
    err = done.stderr
    assert "No module named 'my_mla'" in err, err
    assert f"the current folder {os.path.realpath(work)} holds my_mla.py but is not searched" in err \
        or f"the current folder {work} holds my_mla.py but is not searched" in err, err
    assert "PYTHONPATH=. mla-backends" in err and "python -m mla_backends" in err, err
    assert f"searched the folders {bin_dir}" in err or f"searched the folders {os.path.realpath(bin_dir)}" in err
    assert "Traceback" not in err
    assert "MY_MLA" in done.stdout  # found once the folder is searched


def test_a_missing_module_elsewhere_gets_the_pythonpath_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the module is not here either
    with pytest.raises(ValueError, match=r"No module named 'no_such_mla_module'\); set PYTHONPATH to the folder "
                                         r"holding no_such_mla_module.py .*; searched the folders "):
        get_backend("no_such_mla_module:Backend")
    with pytest.raises(ValueError) as info:  # a missing submodule of an existing package: no folder hint
        get_backend("mla_backends.no_such_module:Backend")
    assert "searched the folders" not in str(info.value)


def test_docs_show_the_current_folder_fix():
    for doc in ("plugins.md", "conformance.md"):
        with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as fh:
            text = fh.read()
        assert "PYTHONPATH=. mla-backends conformance my_mla:MyMLABackend" in text, doc
        assert "python -m mla_backends conformance my_mla:MyMLABackend" in text, doc


# ---- aliases.py: the note for a name that is registered (issue 28, tests the suite lacks) ----------------------
def test_no_alias_note_for_a_registered_name():
    """A name that is both ours and another project's (TRITON_MLA: vLLM's too) is not 'an alias of itself'."""
    assert alias_note("TRITON_MLA") is None
    assert alias_note("triton-mla") is None
    assert alias_note("triton") == "'triton' is SGLang's name for TRITON_MLA"
    assert alias_note("CUTLASS_MLA") == "'CUTLASS_MLA' is vLLM and SGLang's name for FLASHINFER_MLA_CUTLASS"
    clear_cache()
    assert select_backend(V3, device="cpu", backend="REF_TORCH").notes == ()
    assert select_backend(V3, device="cpu", backend="torch_native").notes == (
        "'torch_native' is SGLang's name for REF_TORCH.",)


def test_no_alias_note_when_a_plugin_registered_the_alias_name(monkeypatch):
    """A plugin may register CUTLASS_MLA itself: forcing that name selects the plugin, with no note."""
    from selector_fakes import install

    reg = install(monkeypatch, plugins.load_registry(autoload=False))
    plugin_cls = type("CutlassPlugin", (RefTorchBackend,), {"name": "CUTLASS_MLA"})
    reg.add(plugin_cls, source="a_plugin")
    sel = select_backend(V3, device="cpu", backend="cutlass_mla")
    assert sel.backend is plugin_cls and sel.notes == ()


def test_a_backend_whose_own_code_exits_is_shown_not_obeyed(tmp_path, monkeypatch, capsys):
    """The same class past registration: a plugin backend's capability check, its launch-configuration table
    and the package probe of its ``requires`` (``"pkg.sub"`` imports ``pkg``) each call sys.exit()."""
    import dataclasses

    from selector_fakes import install

    pkg = tmp_path / "exits_as_parent"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import sys\nsys.exit(8)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "exits_as_parent", raising=False)

    class ExitingCheck(RefTorchBackend):
        name = "EXITING_CHECK"

        @classmethod
        def not_supported_reasons(cls, spec):
            sys.exit(7)

    class ExitingTable(RefTorchBackend):
        name = "EXITING_TABLE"

        @classmethod
        def configurations(cls):
            sys.exit(9)

    class ExitingProbe(RefTorchBackend):
        name = "EXITING_PROBE"
        capabilities = dataclasses.replace(RefTorchBackend.capabilities, requires=("exits_as_parent.sub",))

    reg = install(monkeypatch, plugins.load_registry(autoload=False))
    for cls in (ExitingCheck, ExitingTable, ExitingProbe):
        reg.add(cls, source="a_plugin")
    with pytest.raises(BackendNotSupportedError, match="capability check: got SystemExit: the code called sys.exit") \
            as info:
        select_backend(V3, device="cpu", backend="EXITING_CHECK")
    assert "sys.exit(7)" in str(info.value)
    assert ExitingProbe.missing_requirements() == ["exits_as_parent.sub"]
    assert main(["list", "--device", "cpu", "--json"]) == 0
    listed = capsys.readouterr().out
    table = next(b["configurations"] for b in json.loads(listed)["backends"] if b["name"] == "EXITING_TABLE")
    assert table[0]["candidates"] == ["error: SystemExit: the code called sys.exit(9)"], table
