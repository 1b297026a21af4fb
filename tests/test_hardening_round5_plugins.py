"""Issue 48 class 4: plugin code never ends or unwinds the caller, wherever the library runs it, and a hook
written so that it registers nothing is the plugin's recorded problem.

Classes: (1) ``sys.exit()``, ``GeneratorExit`` and other ``BaseException``s (Ctrl-C excepted) from a backend's
``prepare``, ``prepare_key``, kernel, ``__init__`` and ``configure`` become ``PluginCodeError`` naming the
backend; its ``Exception``s pass as they are, with a note naming it; (2) a plugin's checks (``backend_reasons``,
``missing_requirements``) that raise anything or return something that is not a list of reasons are a
``CHECK_FAILED`` reason: selection goes on to the next backend and the layer names the failure; (3) an ``async
def`` hook, a generator hook and a hook returning its classes are recorded against the plugin, saying what the
hook must do; a hook raising a bare ``BaseException`` is recorded too.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings

import pytest
import torch

import mla_backends.plugins.loading as plugins
from mla_backends import BatchMetadata, LatentKVCache, MLAAttention, MLADims, plan_step
from mla_backends.backends.reasons import ReasonKind
from mla_backends.core.errors import PluginCodeError
from mla_backends.plugins.hookspecs import hookimpl
from mla_backends.ref_torch import RefTorchBackend
from selector.select import BackendNotSupportedError, select_backend

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS = MLADims(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               q_lora_rank=None, hidden_size=32, num_layers=1)


class Abort(BaseException):
    """What a plugin may derive from BaseException (neither an Exception nor Ctrl-C)."""


def _exit():
    sys.exit(3)


def _abort():
    raise Abort("stop everything")


def _generator_exit():
    raise GeneratorExit


def _interrupt():
    raise KeyboardInterrupt


#: (how the plugin code fails, the text the error shows of it)
UNWINDING = [(_exit, "SystemExit: the code called sys.exit(3)"), (_abort, "Abort: stop everything"),
             (_generator_exit, "GeneratorExit")]


def _backend(name: str, **methods) -> type[RefTorchBackend]:
    return type(name.title().replace("_", ""), (RefTorchBackend,), {"name": name, "__module__": "my_plugin.mla",
                                                                    **methods})


def _step(seed: int = 0):
    """A small decode + extend step on REF_TORCH-shaped inputs: ``(cache, meta, q_latent, q_rope)``."""
    g = torch.Generator().manual_seed(seed)
    cache = LatentKVCache(6, 4, 16, 8, model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 3], [5, 2], [[0, 1, -1], [2, 3, -1]], 4)
    T = meta.num_tokens
    return cache, meta, torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 8, generator=g)


# ---- (1) a backend's prepare, kernel, __init__ and configure -----------------------------------------------
@pytest.mark.parametrize("fail, shown", UNWINDING, ids=["sys.exit", "BaseException", "GeneratorExit"])
def test_prepare_that_exits_is_a_plugin_code_error_naming_the_backend(fail, shown):
    backend = _backend("EXITS_IN_PREPARE", prepare=lambda self, meta: fail())()
    cache, meta, q_latent, q_rope = _step()
    with pytest.raises(PluginCodeError) as info:
        plan_step(meta, [backend])
    text = str(info.value)
    assert "backend EXITS_IN_PREPARE (my_plugin.mla.ExitsInPrepare), prepare()" in text and shown in text, text
    assert isinstance(info.value.failure, BaseException) and info.value.__cause__ is info.value.failure
    assert isinstance(info.value, RuntimeError)  # an Exception: a caller's `except Exception` sees it


@pytest.mark.parametrize("fail, shown", UNWINDING, ids=["sys.exit", "BaseException", "GeneratorExit"])
def test_kernel_that_exits_is_a_plugin_code_error_and_ctrl_c_still_stops(fail, shown):
    cache, meta, q_latent, q_rope = _step()

    def kernel(self, *args, **kw):
        fail()

    backend = _backend("EXITS_IN_KERNEL", forward_mqa_kernel=kernel)()
    with pytest.raises(PluginCodeError, match=r"backend EXITS_IN_KERNEL .*forward_mqa_kernel\(\)") as info:
        backend.forward_mqa(q_latent, q_rope, cache, meta, scale=0.25)
    assert shown in str(info.value)
    interrupted = _backend("INTERRUPTED_KERNEL", forward_mqa_kernel=lambda self, *a, **k: _interrupt())()
    with pytest.raises(KeyboardInterrupt):
        interrupted.forward_mqa(q_latent, q_rope, cache, meta, scale=0.25)


def test_a_plugins_exceptions_keep_their_type_with_a_note_naming_the_backend():
    cache, meta, q_latent, q_rope = _step()

    def kernel(self, *args, **kw):
        raise ValueError("my kernel refuses this")

    backend = _backend("RAISES_IN_KERNEL", forward_mqa_kernel=kernel)()
    with pytest.raises(ValueError, match="my kernel refuses this") as info:
        backend.forward_mqa(q_latent, q_rope, cache, meta, scale=0.25)
    assert any("RAISES_IN_KERNEL" in note and "forward_mqa_kernel()" in note for note in info.value.__notes__)
    prepares = _backend("RAISES_IN_PREPARE", prepare=lambda self, meta: {}["missing"])()
    with pytest.raises(KeyError) as info:
        plan_step(meta, [prepares])
    assert any("RAISES_IN_PREPARE" in note and "prepare()" in note for note in info.value.__notes__)


def test_prepare_key_that_exits_is_a_plugin_code_error():
    backend = _backend("EXITS_IN_KEY", prepare_key=lambda self: _exit())()
    cache, meta, q_latent, q_rope = _step()
    with pytest.raises(PluginCodeError, match=r"EXITS_IN_KEY .*prepare_key\(\): SystemExit"):
        plan_step(meta, [backend])


@pytest.mark.parametrize("where", ["__init__", "configure"])
def test_a_layer_whose_backend_exits_while_built_raises_a_plugin_code_error(where):
    def exiting(self, *args, **kw):
        sys.exit(4)

    cls = _backend("EXITS_IN_" + where.strip("_").upper(), **{where: exiting})
    with pytest.raises(PluginCodeError, match=r"sys\.exit\(4\)") as info:
        MLAAttention(DIMS, backend=cls, dtype=torch.float32)
    assert cls.name in str(info.value)


def test_a_layer_whose_backend_exits_in_configure_at_allocate_cache_raises_a_plugin_code_error():
    state = {"built": False}

    def configure(self, spec, scale):
        if state["built"]:
            raise Abort("no cache for you")
        RefTorchBackend.configure(self, spec, scale)

    layer = MLAAttention(DIMS, backend=_backend("EXITS_LATER", configure=configure), dtype=torch.float32)
    state["built"] = True
    with pytest.raises(PluginCodeError, match=r"EXITS_LATER .*configure\(\): Abort: no cache for you"):
        layer.allocate_cache(4, 4)


# ---- (2) a plugin's checks never break selection -------------------------------------------------------------
async def _async_reasons(cls, spec):
    return []


CHECKS = {
    "sys.exit": (classmethod(lambda cls, spec: _exit()), "SystemExit: the code called sys.exit(3)"),
    "BaseException": (classmethod(lambda cls, spec: _abort()), "Abort: stop everything"),
    "a str": (classmethod(lambda cls, spec: "no way"), "backend_reasons: returned str; supported a list"),
    "None": (classmethod(lambda cls, spec: None), "backend_reasons: returned NoneType; supported a list"),
    "a coroutine": (classmethod(_async_reasons), "backend_reasons: returned a coroutine"),
    "a bad item": (classmethod(lambda cls, spec: [3]), "reason: got 3; supported a Reason or a non-empty str"),
}


@pytest.fixture
def placed(monkeypatch):
    """A registry with the built-ins, to which a test adds a plugin backend placed before REF_TORCH on CPUs."""
    from selector_fakes import install

    return install(monkeypatch, plugins.load_registry(autoload=False))


@pytest.mark.parametrize("how", sorted(CHECKS))
def test_a_broken_check_is_a_check_failed_reason_and_selection_goes_on(placed, how):
    method, shown = CHECKS[how]
    cls = _backend("BROKEN_CHECK", backend_reasons=method)
    placed.add(cls, source="my_plugin", before="REF_TORCH", archs=("cpu",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sel = select_backend(DIMS, device="cpu")
        verdict = next(v for v in sel.verdicts if v.name == "BROKEN_CHECK")
        gc.collect()
    assert sel.backend is RefTorchBackend
    assert [r.kind for r in verdict.reasons] == [ReasonKind.CHECK_FAILED], verdict.reasons
    assert shown in str(verdict.reasons[0]), verdict.reasons
    assert not [w for w in caught if "never awaited" in str(w.message)]
    with pytest.raises(BackendNotSupportedError, match="capability check: got"):
        select_backend(DIMS, device="cpu", backend="BROKEN_CHECK")
    with pytest.raises(ValueError, match="BROKEN_CHECK, which cannot run this layer: capability check: got"):
        MLAAttention(DIMS, backend=cls, dtype=torch.float32)


def test_an_overridden_missing_requirements_that_aborts_is_a_check_failed_reason(placed):
    cls = _backend("BROKEN_PROBE", missing_requirements=classmethod(lambda cls: _abort()))
    placed.add(cls, source="my_plugin", before="REF_TORCH", archs=("cpu",))
    sel = select_backend(DIMS, device="cpu")
    verdict = next(v for v in sel.verdicts if v.name == "BROKEN_PROBE")
    assert sel.backend is RefTorchBackend and "Abort: stop everything" in str(verdict.reasons[0])


# ---- (3) hooks that register nothing because of how they are written ----------------------------------------
def _plugin(name: str, hook) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.register_mla_backends = hookimpl(hook)
    return mod


async def async_hook(register):
    register(_backend("FROM_ASYNC"))


def generator_hook(register):
    register(_backend("FROM_GENERATOR"))
    yield


def returning_hook(register):
    return [_backend("RETURNED_ONE"), _backend("RETURNED_TWO")]


def returning_class_hook(register):
    return _backend("RETURNED_CLASS")


def aborting_hook(register):
    register(_backend("BEFORE_ABORT"))
    raise Abort("stop everything")


HOOKS = {
    "async def": (async_hook, "returned a coroutine (an async def hook), so its body never ran"),
    "generator": (generator_hook, "returned a generator (a hook with yield), so its body never ran"),
    "list of classes": (returning_hook, "returned list, which is ignored (returning backends does not register"),
    "a class": (returning_class_hook, "returned ReturnedClass, which is ignored"),
    "BaseException": (aborting_hook, "Abort: stop everything"),
}


@pytest.mark.parametrize("how", sorted(HOOKS))
def test_a_hook_that_registers_nothing_because_of_how_it_is_written_is_the_plugins_problem(how):
    hook, shown = HOOKS[how]
    reg = plugins.load_registry(autoload=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plugins.run_plugin(reg, "my_plugin", _plugin("my_plugin", hook)) is False
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    problems = [(p.plugin, p.stage, p.error) for p in reg.problems]
    assert len(problems) == 1 and problems[0][:2] == ("my_plugin", "hook"), problems
    assert shown in problems[0][2], problems
    if how != "BaseException":
        assert "supported a plain def that calls register(backend, ...)" in problems[0][2]
    assert [e.source for e in reg.entries()] == ["builtin"] * len(reg.entries())  # nothing registered


def test_a_hook_that_registers_and_returns_none_is_clean_and_ctrl_c_in_a_hook_stops_the_caller():
    reg = plugins.load_registry(autoload=False)
    assert plugins.run_plugin(reg, "fine", _plugin("fine", lambda register: register(_backend("FINE_MLA"))))
    assert reg.entry("FINE_MLA") is not None and not reg.problems
    with pytest.raises(KeyboardInterrupt):
        plugins.run_plugin(reg, "interrupted", _plugin("interrupted", lambda register: _interrupt()))


def test_a_plugin_whose_import_raises_a_bare_base_exception_is_recorded(monkeypatch):
    class EP:
        name = "aborts_on_load"

        def load(self):
            raise Abort("stop everything")

    monkeypatch.setattr(plugins, "_entry_points", lambda: [EP()])
    reg = plugins.load_registry(autoload=True)
    assert [(p.plugin, p.stage, p.error) for p in reg.problems] == [
        ("aborts_on_load", "import", "Abort: stop everything")]
