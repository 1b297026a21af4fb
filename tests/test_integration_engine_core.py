"""The engine adapters' shared core (``mla_backends.integrations.engine_core``) without an engine: the version gate,
the configured backend (one instance per class, spec and scale), the engine-internals check and the tables, the
scale checks, log-once, the per-layer cache wrappers, and the rule that the adapters' hot paths read no engine
attribute with a default."""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mla_backends.integrations import engine_core as core
from mla_backends.integrations.sglang.internals import INTERNALS as SGLANG_INTERNALS
from mla_backends.integrations.sglang.selection import ENGINE as SGLANG
from mla_backends.integrations.sglang.selection import SGLangSelectionError, request_from_runner
from mla_backends.integrations.vllm.internals import INTERNALS as VLLM_INTERNALS
from mla_backends.integrations.vllm.selection import ENGINE as VLLM
from mla_backends.integrations.vllm.selection import VLLMSelectionError
from mla_backends.integrations.vllm.versions import GATE as VLLM_GATE
from mla_backends.ref_torch import RefTorchBackend

ROOT = Path(__file__).resolve().parents[1] / "mla_backends" / "integrations"
HF = dict(num_attention_heads=4, hidden_size=64, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
          v_head_dim=16, q_lora_rank=None, num_hidden_layers=2)


def test_both_engine_errors_share_the_core_base() -> None:
    assert issubclass(VLLMSelectionError, core.EngineAdapterError)
    assert issubclass(SGLangSelectionError, core.EngineAdapterError)
    assert VLLM.error is VLLMSelectionError and SGLANG.error is SGLangSelectionError


@pytest.mark.parametrize("version,verdict", [("0.32.0", "tested"), ("0.32.1rc1", "tested"), ("0.33.2", "read")])
def test_version_gate(version: str, verdict: str) -> None:
    assert VLLM_GATE.check(version) == verdict
    gate = core.VersionGate(engine="E", package="e", supported_range="==1.2.3", tested=((1, 2, 3),), switch="S",
                            install="e==1.2.3", error=core.UnsupportedEngineVersionError, prereleases=False)
    assert gate.check("1.2.3.post2") == "tested"
    with pytest.raises(core.UnsupportedEngineVersionError, match=r"^E version: got 1\.2\.3rc1; supported e==1\.2\.3 "
                                                                 r"\(1\.2\.3 tested\)\. Unset S to run E"):
        gate.check("1.2.3rc1")
    with pytest.raises(TypeError, match="version: got int"):
        gate.check(123)


def test_one_configured_backend_per_class_spec_and_scale(monkeypatch: pytest.MonkeyPatch,
                                                         cpu_fused_not_built: None) -> None:
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    sel = request_from_runner(HF, tp_size=1, dtype=torch.float32, kv_cache_dtype="auto", page_size=1,
                              device="cpu").select()
    a = core.configured_backend(sel, 0.125)
    assert isinstance(a, RefTorchBackend) and a.layer_spec == sel.spec and a.layer_scale == 0.125
    assert core.configured_backend(sel, 0.125) is a  # vLLM's builder and every impl: one object
    assert core.configured_backend(sel, 0.25) is not a


@dataclass
class _Fields:
    required: int  # a dataclass field without a class default


def test_check_internals_module_and_role_rows() -> None:
    table = core.internals_table({"json:JSONDecoder": {"decode": "decodes"},
                                  f"{__name__}:_Fields": {"required": "reads it"},
                                  "layer": {"scale": "reads it", "inner.value": "reads it"}})
    assert core.internal_names(table) == ["JSONDecoder.decode", "_Fields.required", "layer.scale",
                                          "layer.inner.value"]
    core.check_internals(VLLM, table)  # the module rows
    core.check_internals(VLLM, table, role="layer", obj=SimpleNamespace(scale=1.0, inner=SimpleNamespace(value=2)))
    with pytest.raises(VLLMSelectionError, match=r"^mla-backends: vLLM internal layer\.inner\.value is missing on "
                                                 r"layer 3 \('value' not found\); the adapter reads it"):
        core.check_internals(VLLM, table, role="layer", obj=SimpleNamespace(scale=1.0, inner=object()),
                             where="layer 3")
    gone = core.internals_table({"json:JSONDecoder": {"no_such_method": "calls it"}})
    with pytest.raises(SGLangSelectionError, match=r"SGLang internal JSONDecoder\.no_such_method is missing"):
        core.check_internals(SGLANG, gone)
    with pytest.raises(SGLangSelectionError, match=r"SGLang internal Thing cannot be imported \(No module named "
                                                   r"'no_such_module_xyz'\)"):
        core.check_internals(SGLANG, core.internals_table({"no_such_module_xyz:Thing": {"": "uses it"}}))


@pytest.mark.parametrize("table", [VLLM_INTERNALS, SGLANG_INTERNALS], ids=["vllm", "sglang"])
def test_the_engine_tables_are_well_formed(table: tuple) -> None:
    package = "vllm" if table is VLLM_INTERNALS else "sglang"
    assert len({(r.owner, r.attr) for r in table}) == len(table)  # no row twice
    for row in table:
        assert row.use and row.use[0].islower(), row
        if ":" in row.owner:
            assert row.owner.split(".")[0] == package, row  # engine modules only
        else:
            assert row.owner.isidentifier() and row.attr, row  # a role and the attribute it must carry


def test_scale_checks() -> None:
    assert core.check_softmax_scale(SGLANG, 0.1, 0.1 * (1 + 1e-7)) == pytest.approx(0.1)
    with pytest.raises(SGLangSelectionError, match="SGLang's softmax scale 0.2 differs from the model config's 0.1"):
        core.check_softmax_scale(SGLANG, 0.2, 0.1)
    with pytest.raises(SGLangSelectionError, match="softmax scale is None; supported a float"):
        core.check_softmax_scale(SGLANG, None, 0.1)
    assert core.fp8_scale(VLLM, 3, attr="a", where="layer x") == 3.0
    for bad in (None, True, 0.0, -1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(VLLMSelectionError, match=r"layer x has a = .*; supported a positive finite float"):
            core.fp8_scale(VLLM, bad, attr="a", where="layer x")


def test_log_once(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.engine_core.log_once")
    with caplog.at_level(logging.INFO, logger=log.name):
        assert core.log_once(log, "a line nobody logged before 7f3a")
        assert not core.log_once(log, "a line nobody logged before 7f3a")
    assert [r.getMessage() for r in caplog.records].count("a line nobody logged before 7f3a") == 1


def test_layer_caches_wrap_once_per_layer_tensor_and_scale() -> None:
    caches = core.LayerCaches(8, torch.float32)
    data = torch.zeros(3, 4, 12)
    a = caches.get("l0", data, 0.5)
    assert a.data.data_ptr() == data.data_ptr() and a.scale_value == 1.0  # not fp8: no scale
    assert caches.get("l0", data, 0.5) is a
    assert caches.get("l1", data, 0.5) is not a
    fp8 = torch.zeros(3, 4, 12, dtype=torch.float8_e5m2)
    b = caches.get("l0", fp8, 0.5)
    assert b.is_fp8 and b.scale_value == 0.5 and caches.get("l0", fp8, 0.5) is b
    assert caches.get("l0", fp8, 0.25).scale_value == 0.25  # another scale: another wrapper
    with pytest.raises(ValueError, match="supported rows contiguous"):
        caches.get("l2", torch.zeros(3, 12, 4).transpose(1, 2), 1.0)


#: the adapters' functions that run per step or per layer call
HOT = {"vllm/backend.py": {"build", "forward_mqa", "do_kv_cache_update"},
       "sglang/backend.py": {"init_forward_metadata", "_current", "batch_absorbed", "_cache", "_absorbed",
                             "forward_decode", "forward_extend", "prepare_prefill_qkv"},
       "sglang/plugin.py": {"handle_attention"}}


@pytest.mark.parametrize("path", sorted(HOT))
def test_hot_paths_read_no_attribute_with_a_default(path: str) -> None:
    """Engine internals are checked at start-up (the tables), so the hot path reads them plainly: no
    ``getattr(obj, name, default)`` and no ``hasattr`` in any function that runs per step or per layer."""
    tree = ast.parse((ROOT / path).read_text())
    found = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in HOT[path]}
    assert set(found) == HOT[path], f"{path}: the hot functions moved: {HOT[path] - set(found)}"
    for name, fn in found.items():
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert not (node.func.id == "getattr" and len(node.args) == 3), f"{path}:{name}: getattr default"
                assert node.func.id != "hasattr", f"{path}:{name}: hasattr"
