"""The backend contract, written once in ``MLABackend.forward_mqa``, and reasons as data
(:mod:`mla_backends.backends.reasons`).

* No built-in backend class defines ``forward_mqa``: each implements ``forward_mqa_kernel``.
* The base class refuses a kernel method that reshapes its output or returns a value, naming the backend.
* A third-party class that still overrides ``forward_mqa`` is registered, keeps working, and leaves a plugin
  problem (stage ``contract``) that ``mla-backends list`` shows.
* ``Reason`` reads as today's sentences, carries its fields, and callers filter on its kind.
"""

from __future__ import annotations

import types

import pytest
import torch
from selector_fakes import install

from mla_backends.backends.contract import (
    AttentionSpec,
    BackendContractError,
    Capabilities,
    MLABackend,
    QueryLenSupport,
    contract_problems,
)
from mla_backends.backends.inputs import check_declared_support
from mla_backends.backends.reasons import Reason, ReasonKind, all_of_kinds, as_reason, reason_texts, without_kinds
from mla_backends.cli import main
from mla_backends.core.device import CPU_DEVICE
from mla_backends.flashinfer_mla._common import FlashInferBackendBase
from mla_backends.plugins.hookspecs import hookimpl
from mla_backends.plugins.loading import get_registry, load_registry, registered_backends, run_plugin
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.testing.broken import PaddedHeadsBackend
from selector.select import select_backend

R, ROPE, H, BS = 64, 16, 4, 16


@pytest.fixture
def setup():
    """Two decode requests (contexts 20 and 5) on an 8-page fp32 cache holding random rows."""
    cache = LatentKVCache(8, BS, R, ROPE, model_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 1], [20, 5], torch.tensor([[3, 6], [1, -1]], dtype=torch.int32), BS,
                               num_blocks=8)
    return cache, meta, torch.randn(2, H, R, generator=g), torch.randn(2, H, ROPE, generator=g)


# ---- (a) no built-in backend defines forward_mqa ------------------------------------------------------
def _builtin_classes() -> list[type]:
    classes = set(registered_backends().values())
    seen: set[type] = set()
    for cls in classes:  # the registered classes and their bases below MLABackend (FlashInferBackendBase)
        seen |= {k for k in cls.__mro__ if issubclass(k, MLABackend) and k is not MLABackend}
    return sorted(seen, key=lambda k: k.__qualname__)


def test_no_builtin_backend_class_defines_forward_mqa():
    names = {c.name for c in registered_backends().values()}
    assert {"REF_TORCH", "CPU_FUSED", "TRITON_MLA", "FLASHINFER_MLA", "FLASHINFER_MLA_CUTLASS",
            "FLASHINFER_MLA_TRTLLM", "FLASHINFER_MLA_XQA"} <= names
    classes = _builtin_classes()
    assert FlashInferBackendBase in classes
    offenders = [c.__qualname__ for c in classes if "forward_mqa" in vars(c)]
    assert offenders == [], f"these backend classes define forward_mqa themselves: {offenders}"
    builtins = [e.cls for e in get_registry().entries() if e.source == "builtin"]
    assert len(builtins) == 7 and all("forward_mqa_kernel" in vars(c) for c in builtins)
    assert all(contract_problems(c) == [] for c in classes)
    assert "forward_mqa" in vars(MLABackend)


def test_no_builtin_backend_overrides_not_supported_reasons_or_device_reasons():
    for cls in _builtin_classes():
        assert "not_supported_reasons" not in vars(cls) and "device_reasons" not in vars(cls), cls.__qualname__


# ---- (b) the base class checks what the kernel method left ----------------------------------------------
def test_padded_heads_output_is_refused_naming_the_backend(setup):
    cache, meta, q_latent, q_rope = setup
    with pytest.raises(BackendContractError, match=r"BROKEN_PADDED_HEADS broke the forward_mqa contract: "
                                                   r"out: got \[2, 5, 64\] float32"):
        PaddedHeadsBackend().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)


def test_a_kernel_method_returning_a_value_is_refused(setup):
    class Returns(RefTorchBackend):
        name = "RETURNS_MLA"

        def forward_mqa_kernel(self, *args, **kw):
            super().forward_mqa_kernel(*args, **kw)
            return kw["out"], kw["lse_out"]

    cache, meta, q_latent, q_rope = setup
    with pytest.raises(BackendContractError, match="RETURNS_MLA .* returned tuple; supported None"):
        Returns().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)


def test_base_allocates_checks_and_skips_zero_tokens(setup):
    cache, meta, q_latent, q_rope = setup
    calls = []

    class Spy(RefTorchBackend):
        name = "SPY_MLA"

        def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, **kw):
            calls.append(kw)
            super().forward_mqa_kernel(q_latent, q_rope, cache, meta, **kw)

    out, lse = Spy().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)
    assert calls[0]["out"] is out and calls[0]["lse_out"] is lse and out.shape == (2, H, R)
    empty = BatchMetadata.build([0, 0], [20, 5], torch.tensor([[3, 6], [1, -1]], dtype=torch.int32), BS,
                                num_blocks=8)
    out0, lse0 = Spy().forward_mqa(q_latent[:0], q_rope[:0], cache, empty, scale=0.1)
    assert len(calls) == 1 and out0.shape == (0, H, R) and lse0.shape == (0, H)


def test_ref_torch_now_checks_its_declarations(setup):
    cache, meta, q_latent, q_rope = setup

    class Bf16Only(RefTorchBackend):
        name = "BF16_ONLY_MLA"
        capabilities = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"float32"}),
                                    cpu=True)

    with pytest.raises(TypeError, match="BF16_ONLY_MLA cannot run these inputs: dtype: got float32; "
                                        "supported bfloat16"):
        Bf16Only().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)


def test_no_lse_backends_get_none_back(setup):
    cache, meta, q_latent, q_rope = setup

    class NoLse(RefTorchBackend):
        name = "NO_LSE_MLA"
        capabilities = Capabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"float32"}),
                                    cpu=True, returns_lse=False)

        def forward_mqa_kernel(self, q_latent, q_rope, cache, meta, *, lse_out, **kw):
            assert lse_out is None
            kw["out"].zero_()

    out, lse = NoLse().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)
    assert lse is None and out.shape == (2, H, R)


# ---- (c) a third-party forward_mqa override: recorded, registered, working ------------------------------
class LegacyMLA(RefTorchBackend):
    """A plugin written before the contract moved into the base class."""

    name = "LEGACY_MLA"

    def forward_mqa(self, q_latent, q_rope, cache, meta, *, scale, topk_indices=None, out=None, lse_out=None):
        return super().forward_mqa(q_latent, q_rope, cache, meta, scale=scale, topk_indices=topk_indices,
                                   out=out, lse_out=lse_out)


def test_forward_mqa_override_is_a_recorded_problem_and_still_runs(monkeypatch, capsys, setup):
    assert contract_problems(LegacyMLA) and "LegacyMLA" in contract_problems(LegacyMLA)[0]
    reg = install(monkeypatch, load_registry(autoload=False))
    plugin = types.SimpleNamespace(register_mla_backends=hookimpl(lambda register: register(LegacyMLA)))
    assert run_plugin(reg, "legacy", plugin) is True  # registered: a problem, not a failure
    problems = [p for p in reg.problems if p.plugin == "legacy"]
    assert [p.stage for p in problems] == ["contract"]
    assert problems[0].error.startswith("LEGACY_MLA: forward_mqa: got an override in ")
    assert reg.entry("LEGACY_MLA") is not None
    cache, meta, q_latent, q_rope = setup
    cls = select_backend(_dims(), device="cpu", backend="legacy_mla", dtype="float32").backend
    out, lse = cls().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)
    ref_out, ref_lse = RefTorchBackend().forward_mqa(q_latent, q_rope, cache, meta, scale=0.1)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "plugin 'legacy' (contract): LEGACY_MLA: forward_mqa: got an override" in text


def _dims():
    from mla_backends.core.dims import MLADims

    return MLADims.deepseek_v3().tensor_parallel(8)


# ---- (d) reasons as data -------------------------------------------------------------------------------
def test_reason_text_fields_and_equality():
    r = Reason(ReasonKind.PAGE_SIZE, "page size", "48", "1, 2, 4")
    assert str(r) == "page size: got 48; supported 1, 2, 4"
    assert r == "page size: got 48; supported 1, 2, 4" and r in ["page size: got 48; supported 1, 2, 4"]
    assert r.to_dict() == {"text": str(r), "kind": "page_size", "what": "page size", "got": "48",
                           "supported": "1, 2, 4", "hint": None}
    hinted = Reason(ReasonKind.DEVICE, "device", "CPU", "a CUDA device (SM80+)", hint="set X=1")
    assert str(hinted) == "device: got CPU; supported a CUDA device (SM80+); set X=1"
    with pytest.raises(dataclasses_error()):
        r.got = "1"  # frozen
    with pytest.raises(ValueError, match="got/supported"):
        Reason(ReasonKind.OTHER, "x")
    with pytest.raises(TypeError, match="kind"):
        Reason("page size", "x", "1", "2")  # type: ignore[arg-type]


def dataclasses_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_plain_strings_become_other_reasons():
    r = as_reason("widget: got 3; supported 4")
    assert r.kind is ReasonKind.OTHER and r.what == "widget" and str(r) == "widget: got 3; supported 4"
    assert as_reason(r) is r
    with pytest.raises(TypeError, match="reason"):
        as_reason("")


def test_every_declared_reason_has_a_kind_and_the_old_texts():
    spec = AttentionSpec(num_heads=16, dtype=torch.float64, kv_cache_dtype="fp8_e4m3", block_size=48,
                         max_query_len=2, sparse=True, need_lse=True, device=CPU_DEVICE)

    class Narrow(RefTorchBackend):
        name = "NARROW_MLA"
        capabilities = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16"}),
                                    page_sizes=(64,), preferred_page_size=64, dims=frozenset({(512, 64)}),
                                    max_num_heads=8, query_len=QueryLenSupport.SINGLE,
                                    dense=True, sparse=False, returns_lse=False, min_compute_capability=(8, 0),
                                    requires=("no_such_module_xyz",), extra="xyz")

    reasons = Narrow.not_supported_reasons(spec)
    assert reason_texts(reasons) == [
        "package: got no_such_module_xyz not installed; supported with it installed: pip install "
        "'mla-backends[xyz]'",
        "device: got CPU; supported a CUDA device (SM80+)",
        "dtype: got float64; supported bfloat16",
        "kv cache dtype: got fp8_e4m3; supported bfloat16",
        "page size: got 48; supported 64",
        "num_heads: got 16; supported <= 8",
        "query length: got 2; supported 1 (single-token decode)",
        "attention: got sparse (top-k indices); supported dense only",
        "LSE: got a request for it; supported output only (no LSE)",
    ]
    assert [r.kind for r in reasons] == [
        ReasonKind.PACKAGE, ReasonKind.DEVICE, ReasonKind.DTYPE, ReasonKind.KV_CACHE_DTYPE, ReasonKind.PAGE_SIZE,
        ReasonKind.NUM_HEADS, ReasonKind.QUERY_LEN, ReasonKind.ATTENTION, ReasonKind.LSE]
    assert without_kinds(reasons, ReasonKind.PACKAGE) == reasons[1:]
    assert all_of_kinds(reasons[2:4], ReasonKind.DTYPE, ReasonKind.KV_CACHE_DTYPE)
    assert not all_of_kinds([], ReasonKind.DTYPE)


def test_kind_filters_not_wording(setup):
    """A backend rule worded like a package reason is still a rule: forward_mqa refuses it (only PACKAGE
    reasons are left out), and ``dtype``-worded OTHER reasons do not make the error a TypeError."""
    cache, meta, q_latent, q_rope = setup

    class Odd(RefTorchBackend):
        name = "ODD_MLA"

        @classmethod
        def backend_reasons(cls, spec):
            return ["package: got a rule worded like a package; supported nothing", "dtype: got odd; supported x"]

    with pytest.raises(ValueError, match="ODD_MLA cannot run these inputs: package: got a rule") as info:
        check_declared_support(Odd, q_latent, cache, meta)
    assert type(info.value) is ValueError
    reasons = Odd.not_supported_reasons(AttentionSpec(num_heads=H, device=CPU_DEVICE))
    assert [r.kind for r in reasons] == [ReasonKind.OTHER, ReasonKind.OTHER]


def test_select_json_gives_each_reason_as_text_and_fields(monkeypatch, capsys):
    from selector_fakes import fake_registry

    install(monkeypatch, fake_registry())
    assert main(["select", "--device", "sm61", "--json"]) == 2
    import json

    doc = json.loads(capsys.readouterr().out)
    cand = doc["candidates"][0]
    assert cand["reasons"] == [d["text"] for d in cand["reason_details"]]
    assert cand["reason_details"][0]["kind"] == "device" and cand["reason_details"][0]["got"] == "SM61"


def test_a_kernel_method_under_its_0_3_name_still_runs_with_a_deprecation_warning():
    """A plugin written against 0.3 (``_forward_mqa_impl``, no ``state``, calling the built-in's method) keeps
    working for one release: same output as the built-in, and a DeprecationWarning naming the new hook."""
    import warnings

    from mla_backends.ref_torch import RefTorchBackend
    from mla_backends.step.cache import LatentKVCache
    from mla_backends.step.metadata import BatchMetadata

    class OldStyle(RefTorchBackend):
        name = "OLD_STYLE"

        def _forward_mqa_impl(self, q_latent, q_rope, cache, meta, **kw):
            super()._forward_mqa_impl(q_latent, q_rope, cache, meta, **kw)

    g = torch.Generator().manual_seed(3)
    cache = LatentKVCache(4, 4, 16, 8, kv_cache_dtype="float32", model_dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    meta = BatchMetadata.build([1, 1], [5, 2], [[0, 1], [2, -1]], 4, num_blocks=4)
    ql, qr = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 8, generator=g)
    want, want_lse = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=0.3)
    with pytest.warns(DeprecationWarning, match="implement forward_mqa_kernel") as record:
        got, lse = OldStyle().forward_mqa(ql, qr, cache, meta, scale=0.3)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert [w.filename for w in record if "forward_mqa_kernel" in str(w.message)] == [__file__]  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per class
        OldStyle().forward_mqa(ql, qr, cache, meta, scale=0.3)
