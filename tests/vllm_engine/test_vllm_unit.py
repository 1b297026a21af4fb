"""The plugin's vLLM-facing parts without an engine (run on the CPU, in .venv-vllm): CUSTOM and CPU_MLA
registration, the GPU path (what a CUDA platform gets), the declarations vLLM reads, the LSE, cache writes
with both vLLM signatures, the version refusal, and that importing mla-backends never imports vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from harness import HAVE_VLLM, SKIP_REASON  # noqa: E402

if not HAVE_VLLM:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from vllm.v1.attention.backend import AttentionCGSupport, MultipleOf  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm_cases import BS, R, decode_case, reference  # noqa: E402

from mla_backends import Capabilities  # noqa: E402
from mla_backends.integrations import vllm as plugin_pkg  # noqa: E402
from mla_backends.integrations.vllm import backend as vb  # noqa: E402
from mla_backends.integrations.vllm import plugin  # noqa: E402
from mla_backends.integrations.vllm.selection import VLLMSelectionError, declarations  # noqa: E402
from mla_backends.integrations.vllm.step import decode_batch_metadata  # noqa: E402
from mla_backends.integrations.vllm.versions import UnsupportedVLLMVersionError  # noqa: E402
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.plan import plan_step  # noqa: E402

GPU_CAPS = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
                        min_compute_capability=(9, 0), page_sizes=(32, 64), preferred_page_size=64,
                        dims=frozenset({(512, 64)}), returns_lse=False, host_sync_free=True, cuda_graphs=True)


@pytest.fixture
def clean_registry():  # type: ignore[no-untyped-def]
    yield
    for m in (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.CPU_MLA):
        m.clear_override()


def test_importing_mla_backends_never_imports_vllm() -> None:
    code = ("import sys, mla_backends, mla_backends.integrations.vllm as v, mla_backends.integrations.vllm.step, "
            "mla_backends.integrations.vllm.selection; from mla_backends import select_backend; "
            "select_backend('deepseek-v3', device='cpu'); v.register(); print('vllm' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "MLA_BACKENDS_VLLM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_switch_off_registers_nothing(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> None:
    monkeypatch.delenv("MLA_BACKENDS_VLLM", raising=False)
    plugin_pkg.register()
    assert not AttentionBackendEnum.CUSTOM.is_overridden() and not AttentionBackendEnum.CPU_MLA.is_overridden()


def test_switch_on_registers_custom_and_cpu_mla(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> None:
    monkeypatch.setenv("MLA_BACKENDS_VLLM", "1")
    plugin_pkg.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin_pkg.BACKEND_PATH
    assert AttentionBackendEnum.CPU_MLA.get_class() is vb.MLABackendsBackend
    assert plugin.registered_members() == ["CUSTOM", "CPU_MLA"]
    assert vb.MLABackendsBackend.get_impl_cls() is vb.MLABackendsCPUImpl
    assert vb.MLABackendsBackend.is_mla() and vb.MLABackendsBackend.get_name() == "CUSTOM"


def test_gpu_platform_registers_custom_only(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert plugin.register_backends() == ["CUSTOM"]
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()
    assert vb.MLABackendsBackend.get_impl_cls() is vb.MLABackendsImpl
    assert vb.MLABackendsBackend.get_builder_cls() is vb.MLABackendsMetadataBuilder


def test_other_vllm_version_refused(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(UnsupportedVLLMVersionError, match=r"got 0.31.0; supported vllm>=0.32,<0.34"):
        plugin.register_backends()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_declarations_reach_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's validation reads comes from the chosen backend's Capabilities (GPU-like and REF_TORCH)."""
    B = vb.MLABackendsBackend
    monkeypatch.setattr(vb, "_current_declarations", lambda: declarations(GPU_CAPS))
    assert B.get_supported_kernel_block_sizes() == [64, 32]
    assert B.get_supported_head_sizes() == [576]
    assert B.supports_dtype(torch.bfloat16) and not B.supports_dtype(torch.float16)
    assert B.supports_kv_cache_dtype("fp8") and not B.supports_kv_cache_dtype("fp8_e5m2")
    assert not B.supports_dcp()  # no LSE, no DCP
    monkeypatch.setattr(vb, "_current_declarations", lambda: declarations(RefTorchBackend.capabilities))
    sizes = B.get_supported_kernel_block_sizes()
    assert len(sizes) == 1 and isinstance(sizes[0], MultipleOf) and sizes[0].base == 1
    assert B.supports_dtype(torch.float32) and B.supports_kv_cache_dtype("fp8_e5m2") and B.supports_dcp()


def _fake_request(caps: Capabilities | None):  # type: ignore[no-untyped-def]
    def make(cfg, device, num_heads=None):  # type: ignore[no-untyped-def]
        def select():  # type: ignore[no-untyped-def]
            if caps is None:
                raise VLLMSelectionError("mla-backends cannot run this vLLM MLA model: page size: got 16; supported 64")
            return SimpleNamespace(backend=SimpleNamespace(capabilities=caps))
        return SimpleNamespace(select=select)
    return make


def test_cuda_graphs_declared_only_when_the_backend_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    get = vb.MLABackendsMetadataBuilder.get_cudagraph_support
    monkeypatch.setattr(vb, "request_from_vllm", _fake_request(GPU_CAPS))
    assert get(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setattr(vb, "request_from_vllm", _fake_request(RefTorchBackend.capabilities))
    assert get(None, None) == AttentionCGSupport.NEVER


def test_refusal_reaches_vllm_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vb, "get_current_vllm_config_or_none", lambda: SimpleNamespace(model_config=object()))
    monkeypatch.setattr(vb, "request_from_vllm", _fake_request(None))
    msg = vb.MLABackendsBackend.supports_combination(576, torch.bfloat16, "auto", 16, True, False, False, False,
                                                     None)
    assert msg is not None and "page size: got 16; supported 64" in msg
    monkeypatch.setattr(vb, "request_from_vllm", _fake_request(GPU_CAPS))
    assert vb.MLABackendsBackend.supports_combination(576, torch.bfloat16, "auto", 64, True, False, False, False,
                                                      None) is None


def _impl(need_lse: bool):  # type: ignore[no-untyped-def]
    impl = object.__new__(vb.MLABackendsCPUImpl)
    impl.kv_lora_rank, impl.scale, impl.need_to_return_lse_for_decode = R, 0.3, need_lse
    impl.mla_backend, impl.mla_scale = RefTorchBackend(), 0.3
    return impl


@pytest.mark.parametrize("need_lse", [False, True])
def test_forward_mqa_runs_the_selected_backend(need_lse: bool) -> None:
    lens = [6, 13]
    cache, table, ql, qr = decode_case(lens)
    meta = decode_batch_metadata(table, torch.tensor(lens), lens, BS)
    impl = _impl(need_lse)
    plan = plan_step(meta, [impl.mla_backend])  # what the metadata builder does once per step
    md = SimpleNamespace(decode=vb.MLABackendsDecodeMetadata(block_table=table, seq_lens=torch.tensor(lens),
                                                             dcp_tot_seq_lens=None, batch=meta, plan=plan))
    out, lse = impl.forward_mqa((ql, qr), cache, md, SimpleNamespace(_k_scale_float=1.0))
    ref_out, ref_lse = reference(cache, table, lens, ql, qr, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    if need_lse:
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    else:
        assert lse is None
    one, _ = impl.forward_mqa(torch.cat([ql, qr], dim=-1), cache, md, SimpleNamespace())  # one fused tensor
    torch.testing.assert_close(one, out)
    with pytest.raises(RuntimeError, match="carries no BatchMetadata"):
        impl.forward_mqa((ql, qr), cache, SimpleNamespace(decode=SimpleNamespace()), None)
    other = SimpleNamespace(decode=vb.MLABackendsDecodeMetadata(
        block_table=table, seq_lens=torch.tensor(lens), dcp_tot_seq_lens=None, batch=meta,
        plan=plan_step(decode_batch_metadata(table, torch.tensor(lens), lens, BS), [impl.mla_backend])))
    with pytest.raises(ValueError, match="made for other metadata"):  # a plan must be the batch's own
        impl.forward_mqa((ql, qr), cache, other, SimpleNamespace(_k_scale_float=1.0))


class _Base032:
    def do_kv_cache_update(self, kv_c, k_pe, cache, slots, dtype, k_scale):  # type: ignore[no-untyped-def]
        self.called = ("0.32", slots)


class _Base033:
    def do_kv_cache_update(self, kv_c, k_pe, cache, slots, dtype, k_scale, skip_scale=False):  # type: ignore[no-untyped-def]
        self.called = ("0.33", skip_scale)


def test_cache_writes_accept_both_vllm_signatures() -> None:
    class Old(vb._DecodeOnMLABackends, _Base032):
        pass

    class New(vb._DecodeOnMLABackends, _Base033):
        pass

    old, new = object.__new__(Old), object.__new__(New)
    args = (None, None, None, "slots", "auto", None)
    old.do_kv_cache_update(*args)
    assert old.called == ("0.32", "slots")
    new.do_kv_cache_update(*args, skip_scale=True)
    assert new.called == ("0.33", True)
    with pytest.raises(TypeError, match="skip_scale: got True"):
        old.do_kv_cache_update(*args, skip_scale=True)
