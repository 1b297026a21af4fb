"""Issue 21, plugin faults: each runs in a fresh interpreter with a timeout, so a hang fails the test.

Classes: (1) a plugin calling the registry API while plugins load (used to hang on a non-reentrant lock);
(2) a plugin's registration problems (field types, reserved names, name clashes, late ``register()``) are
recorded against the offending plugin and never raised into ``list`` or ``select``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = '''
import types, torch, dataclasses
import mla_backends.plugins.loading as plugins
from mla_backends.plugins.hookspecs import hookimpl
from mla_backends.ref_torch import RefTorchBackend

class EP:  # a stand-in for an importlib.metadata entry point
    def __init__(self, name, load):
        self.name, self._load = name, load
    def load(self):
        return self._load()

def plugin_module(module_name, hook):
    mod = types.ModuleType(module_name)
    mod.register_mla_backends = hookimpl(hook)
    return mod

def backend(name, module, **caps):
    c = dataclasses.replace(RefTorchBackend.capabilities)
    for k, v in caps.items():
        object.__setattr__(c, k, v)  # what a plugin can do to a frozen declaration (or a subclass of it)
    return type(name.title(), (RefTorchBackend,), {"name": name, "capabilities": c, "__module__": module})

def install(*eps):
    plugins._entry_points = lambda: list(eps)
    plugins.reset_registry(None)
'''


def _run(body: str, timeout: float = 60) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD", None)
    code = PRELUDE + textwrap.dedent(body)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                             env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"plugin loading hung (no answer in {timeout} s)") from None
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_registry_calls_while_plugins_load_never_hang():
    """Class 1: the read API answers from the registry being filled; the write API is refused and recorded."""
    out = _run('''
        seen = {}
        def on_import():
            seen["import"] = sorted(plugins.registered_backends())   # a plugin module using the API at import
            return plugin_module("reader_pkg", hook)
        def hook(register):
            seen["hook"] = plugins.get_backend("ref_torch").name
            register(backend("READER_MLA", "reader_pkg"))
        def writer_hook(register):
            plugins.register_backend(backend("SNEAKY_MLA", "writer_pkg"))
        install(EP("reader", on_import), EP("writer", lambda: plugin_module("writer_pkg", writer_hook)))
        names = plugins.registered_backends()
        assert "REF_TORCH" in seen["import"] and seen["hook"] == "REF_TORCH", seen
        assert "READER_MLA" in names and "SNEAKY_MLA" not in names, names
        probs = [p for p in plugins.get_registry().problems if p.plugin == "writer"]
        assert len(probs) == 1 and probs[0].stage == "hook", probs
        assert "RegistrationError: register_backend: got a call while plugins load" in probs[0].error, probs
        print("ok")
    ''')
    assert out.strip() == "ok"


def test_plugin_registration_problems_are_recorded_against_the_offender():
    """Class 2: malformed fields, reserved names, clashes and late register() calls are the offender's problem,
    and `mla-backends list` / select still work."""
    out = _run('''
        import io, contextlib, json
        from mla_backends.cli import main
        from selector.select import select_backend
        victim_cls = backend("VICTIM_MLA", "victim_pkg.backends")
        late = []
        def bad_hook(register):
            register(backend("BADREQ_MLA", "bad_pkg", requires=(5,)))
            register(backend("BADHEADS_MLA", "bad_pkg", max_num_heads=2.5))
            register(backend("BADBOOL_MLA", "bad_pkg", cpu="yes"))
            register(backend("AUTO", "bad_pkg"))
            register(victim_cls)                      # another package's backend, under its name
            late.append(register)
        def victim_hook(register):
            register(victim_cls)
        install(EP("aaa_bad", lambda: plugin_module("bad_pkg", bad_hook)),
                EP("victim", lambda: plugin_module("victim_pkg.plugin", victim_hook)))
        reg = plugins.get_registry()
        names = reg.names()
        for n in ("BADREQ_MLA", "BADHEADS_MLA", "BADBOOL_MLA", "AUTO"):
            assert n not in names, n
        assert reg.entry("VICTIM_MLA").source == "victim"
        errors = {p.error.split(":")[0]: p for p in reg.problems}
        assert not [p for p in reg.problems if p.plugin == "victim"], reg.problems
        bad = " | ".join(p.error for p in reg.problems if p.plugin == "aaa_bad")
        for text in ("requires: got (5,)", "max_num_heads: got 2.5", "cpu: got 'yes'", "name: got 'AUTO'",
                     "VICTIM_MLA: name: got a class of package 'victim_pkg'"):
            assert text in bad, (text, bad)
        try:
            late[0](backend("LATE_MLA", "bad_pkg"))
        except ValueError as exc:  # RegistrationError
            assert type(exc).__name__ == "RegistrationError" and "register: got a call" in str(exc)
        else:
            raise AssertionError("register() after the hook returned was silently dropped")
        assert "LATE_MLA" not in plugins.registered_backends()
        assert any("after the register_mla_backends hook returned" in p.error for p in reg.problems
                   if p.plugin == "aaa_bad")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["list", "--json"])
        assert rc == 0, rc
        listed = json.loads(buf.getvalue())
        assert any("requires" in p["error"] for p in listed["plugin_problems"])
        from mla_backends.cpu_fused import build
        # the built-in CPU choice, the broken plugins skipped
        assert select_backend("deepseek-v3", device="cpu").name == ("CPU_FUSED" if build.is_built() else "REF_TORCH")
        print("ok")
    ''')
    assert out.strip() == "ok"
