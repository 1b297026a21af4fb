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
from engine_harness import cpu_choice, nan_backends
from vllm_env import HAVE_VLLM, SKIP_REASON  # noqa: E402

if not HAVE_VLLM:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from vllm.v1.attention.backend import AttentionCGSupport, MultipleOf  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm_cases import BS, R, decode_case, reference  # noqa: E402

from mla_backends import Capabilities  # noqa: E402
from mla_backends.integrations import vllm as plugin_pkg  # noqa: E402
from mla_backends.integrations.engine_core import LayerCaches, check_internals  # noqa: E402
from mla_backends.integrations.vllm import backend as vb  # noqa: E402
from mla_backends.integrations.vllm import plugin  # noqa: E402
from mla_backends.integrations.vllm.internals import INTERNALS  # noqa: E402
from mla_backends.integrations.vllm.selection import ENGINE, VLLMSelectionError, declarations  # noqa: E402
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
            return SimpleNamespace(backend=SimpleNamespace(capabilities=caps), name="FAKE")
        # a 576-wide bfloat16 request vLLM's own path takes on every platform
        return SimpleNamespace(select=select, dims=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64),
                               dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                               describe=lambda: "a fake request")
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


def _decode_md(impl, table, lens):  # type: ignore[no-untyped-def]
    """What MLABackendsMetadataBuilder.build hands the impl: vLLM's decode fields, the BatchMetadata, its plan."""
    from mla_backends.step.plan import plan_step

    meta = decode_batch_metadata(table, torch.tensor(lens), lens, BS)
    return SimpleNamespace(decode=vb.MLABackendsDecodeMetadata(
        block_table=table, seq_lens=torch.tensor(lens), dcp_tot_seq_lens=None, batch=meta,
        plan=plan_step(meta, [impl.mla_backend])))


def _impl(need_lse: bool = False, kv_cache_dtype: str = "auto", backend=None):  # type: ignore[no-untyped-def]
    """An impl as its start-up leaves it (without vLLM's configuration): tiny dims, REF_TORCH by default."""
    impl = object.__new__(vb.MLABackendsCPUImpl)
    impl.kv_lora_rank, impl.scale, impl.need_to_return_lse_for_decode = R, 0.3, need_lse
    impl.kv_cache_dtype = kv_cache_dtype
    impl.mla_backend = backend if backend is not None else RefTorchBackend()
    impl.mla_scale = impl.scale
    impl.mla_fp8 = vb.fp8_cache_view_dtype(kv_cache_dtype)
    impl.mla_caches = LayerCaches(R, torch.float32)
    return impl


@pytest.mark.parametrize("need_lse", [False, True])
def test_forward_mqa_runs_the_selected_backend(need_lse: bool) -> None:
    lens = [6, 13]
    cache, table, ql, qr = decode_case(lens)
    impl = _impl(need_lse)
    md = _decode_md(impl, table, lens)
    out, lse = impl.forward_mqa((ql, qr), cache, md, SimpleNamespace(_k_scale_float=1.0))
    ref_out, ref_lse = reference(cache, table, lens, ql, qr, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    if need_lse:
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    else:
        assert lse is None
    one, _ = impl.forward_mqa(torch.cat([ql, qr], dim=-1), cache, md, SimpleNamespace(_k_scale_float=1.0))
    torch.testing.assert_close(one, out)
    with pytest.raises(RuntimeError, match="carries no BatchMetadata"):
        impl.forward_mqa((ql, qr), cache, SimpleNamespace(decode=SimpleNamespace()), None)
    other = SimpleNamespace(decode=vb.MLABackendsDecodeMetadata(
        block_table=table, seq_lens=torch.tensor(lens), dcp_tot_seq_lens=None, batch=md.decode.batch,
        plan=plan_step(decode_batch_metadata(table, torch.tensor(lens), lens, BS), [impl.mla_backend])))
    with pytest.raises(ValueError, match="made for other metadata"):  # a plan must be the batch's own
        impl.forward_mqa((ql, qr), cache, other, SimpleNamespace(_k_scale_float=1.0))


def _poison_outside(cache: torch.Tensor, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """A copy of ``cache`` with NaN in every slot the requests do not own: the slots past each request's
    length in its last page, and every page outside the tables."""
    out = torch.full_like(cache, float("nan"))
    for b, s in enumerate(lens):
        for p in range(s):
            blk, off = int(table[b, p // BS]), p % BS
            out[blk, off] = cache[blk, off]
    return out


NAN_BACKENDS = nan_backends()  # every CPU backend


@pytest.mark.parametrize("name", NAN_BACKENDS)
def test_nan_outside_the_steps_slots_does_not_change_the_output(name: str) -> None:
    """vLLM's layer cache with NaN in every slot no request of the step owns: the adapter's decode gives the
    float64 reference's answer (nothing outside the requests' rows is read)."""
    from mla_backends.triton_mla import TritonMLABackend

    lens = [6, 13, 1]  # a partly used last page, a page and a bit, a one-token request
    cache, table, ql, qr = decode_case(lens, num_blocks=9)
    backend = RefTorchBackend() if name == "REF_TORCH" else TritonMLABackend()
    impl = _impl(backend=backend)
    out, _ = impl.forward_mqa((ql, qr), _poison_outside(cache, table, lens), _decode_md(impl, table, lens),
                              SimpleNamespace(_k_scale_float=1.0))
    ref_out, _ = reference(cache, table, lens, ql, qr, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=2e-4)


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


# ---- fp8 caches (issue 37, part 1) ----------------------------------------------------------------------------
from mla_backends import LatentKVCache  # noqa: E402

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _cpu_impl(kv_cache_dtype: str):  # type: ignore[no-untyped-def]
    return _impl(kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("name", sorted(FP8))
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_cpu_fp8_write_is_latent_cache_write(name: str, scale: float) -> None:
    """vLLM's CPU cache (raw uint8) gets exactly the bytes LatentKVCache.write stores, with the layer scale."""
    g = torch.Generator().manual_seed(7)
    T, blocks = 9, 5
    kv_c, k_pe = 2 * torch.randn(T, R, generator=g), 2 * torch.randn(T, 1, 4, generator=g)
    slots = torch.tensor([3, 0, 17, -1, 8, 19, 4, -1, 11])
    raw = torch.zeros(blocks, BS, R + 4, dtype=torch.uint8)
    _cpu_impl(name).do_kv_cache_update(kv_c, k_pe, raw, slots, name, torch.tensor([scale]))
    ref = LatentKVCache(blocks, BS, kv_lora_rank=R, qk_rope_head_dim=4, kv_cache_dtype=FP8[name],
                        model_dtype=torch.float32, scale=scale)
    ref.write(kv_c, k_pe, slots)
    assert torch.equal(raw, ref.data.view(torch.uint8))
    assert int(raw.view(-1, R + 4)[[1, 2, 5, 6, 7, 9, 10, 12, 13, 14, 15, 16, 18]].count_nonzero()) == 0
    back = raw.view(FP8[name]).view(-1, R + 4)[slots[slots >= 0]].float() * scale  # values, within fp8 rounding
    want = torch.cat([kv_c, k_pe.squeeze(1)], -1)[slots >= 0]
    tol = 0.07 if name != "fp8_e5m2" else 0.13
    assert torch.all((back - want).abs() <= tol * want.abs() + 1e-2 * scale)


def test_cpu_fp8_write_and_read_share_one_scale() -> None:
    lens = [5]
    _, table, ql, qr = decode_case(lens)
    impl = _cpu_impl("fp8")
    md = _decode_md(impl, table, lens)
    raw = torch.zeros(9, BS, R + 4, dtype=torch.uint8)
    impl.do_kv_cache_update(torch.randn(1, R), torch.randn(1, 1, 4), raw, torch.tensor([2]), "fp8",
                            torch.tensor([0.5]))
    impl.forward_mqa((ql, qr), raw.view(torch.float8_e4m3fn), md, SimpleNamespace(_k_scale_float=0.5))
    impl.do_kv_cache_update(torch.randn(1, R), torch.randn(1, 1, 4), raw, torch.tensor([2]), "fp8",
                            torch.tensor([0.1]))  # a float32 tensor: 0.1 rounded; the host copy is the float 0.1
    impl.forward_mqa((ql, qr), raw.view(torch.float8_e4m3fn), md, SimpleNamespace(_k_scale_float=0.1))
    impl.do_kv_cache_update(torch.randn(1, R), torch.randn(1, 1, 4), raw, torch.tensor([2]), "fp8",
                            torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="written with k_scale 0.5 and would be read with _k_scale_float 2.0"):
        impl.forward_mqa((ql, qr), raw.view(torch.float8_e4m3fn), md, SimpleNamespace(_k_scale_float=2.0))
    with pytest.raises(TypeError, match="skip_scale: got True"):
        impl.do_kv_cache_update(torch.randn(1, R), torch.randn(1, 1, 4), raw, torch.tensor([2]), "fp8",
                                torch.tensor([0.5]), skip_scale=True)


def test_cpu_non_fp8_write_stays_vllms() -> None:
    kv_c, k_pe = torch.randn(2, R), torch.randn(2, 1, 4)
    raw = torch.zeros(2, BS, R + 4)
    _cpu_impl("auto").do_kv_cache_update(kv_c, k_pe, raw, torch.tensor([1, 6]), "auto", torch.tensor([1.0]))
    assert torch.equal(raw.view(-1, R + 4)[[1, 6]], torch.cat([kv_c, k_pe.squeeze(1)], -1))


@pytest.mark.parametrize("name", ["fp8_e5m2", "fp8", "fp8_e4m3"])
def test_fp8_cache_read_as_written_whatever_view_vllm_hands_over(name: str) -> None:
    """vLLM 0.32 views every fp8 cache as e4m3 before decode; an e5m2 cache must still be read as e5m2."""
    lens = [6, 13]
    cache32, table, ql, qr = decode_case(lens)
    scale = 0.5
    stored = (cache32 / scale).to(FP8[name])
    handed = stored.view(torch.uint8).view(torch.float8_e4m3fn)  # forward_impl's view
    impl = _cpu_impl(name)
    out, _ = impl.forward_mqa((ql, qr), handed, _decode_md(impl, table, lens), SimpleNamespace(_k_scale_float=scale))
    ref_out, _ = reference(stored.double() * scale, table, lens, ql, qr, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)


def _config(cache_dtype: str, layers: dict) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           compilation_config=SimpleNamespace(static_forward_context=layers),
                           model_config=SimpleNamespace(model="m"),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))


def test_layers_are_checked_at_start_up() -> None:
    """The metadata builder checks every MLA layer once: its internals (a layer without ``_k_scale_float`` is
    refused naming it, never read with a default), its host scale under an fp8 cache, and that its impl runs the
    builder's configured backend (the plan the builder makes is the one the impls run)."""
    backend = RefTorchBackend()
    impl = _impl(backend=backend)
    good = SimpleNamespace(_k_scale_float=0.5, impl=impl)
    vb._check_layers(_config("fp8_e5m2", {"l0": good}), ["l0"], backend)
    with pytest.raises(VLLMSelectionError, match=r"vLLM internal layer\._k_scale_float is missing on layer 'l1'"):
        vb._check_layers(_config("auto", {"l0": good, "l1": SimpleNamespace(impl=impl)}), ["l0", "l1"], backend)
    for bad in (None, "1", 0.0, float("nan"), True):
        with pytest.raises(VLLMSelectionError, match="layer 'l1' has _k_scale_float = .*; supported a positive"):
            vb._check_layers(_config("fp8", {"l1": SimpleNamespace(_k_scale_float=bad, impl=impl)}), ["l1"],
                             backend)
    vb._check_layers(_config("auto", {"l1": SimpleNamespace(_k_scale_float=None, impl=impl)}), ["l1"], backend)
    with pytest.raises(VLLMSelectionError, match="layer 'l9' is not in vLLM's static_forward_context"):
        vb._check_layers(_config("auto", {"l0": good}), ["l0", "l9"], backend)
    with pytest.raises(VLLMSelectionError, match="layer 'l0' runs .*configured apart from the metadata builder's"):
        vb._check_layers(_config("auto", {"l0": good}), ["l0"], RefTorchBackend())
    with pytest.raises(VLLMSelectionError, match=r"internal config\.model_config\.model is missing"):
        cfg = _config("auto", {"l0": good})
        del cfg.model_config.model
        vb._check_layers(cfg, ["l0"], backend)


def test_a_missing_vllm_internal_refuses_start_up(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> None:
    """Every row of the table resolves on the installed vLLM; one renamed away refuses registration naming it."""
    from vllm.v1.attention import backend as vllm_backend

    check_internals(ENGINE, INTERNALS)
    monkeypatch.delattr(vllm_backend.CommonAttentionMetadata, "seq_lens_cpu_upper_bound")
    monkeypatch.setattr(vllm_backend.CommonAttentionMetadata, "__dataclass_fields__", {})
    with pytest.raises(VLLMSelectionError, match="vLLM internal CommonAttentionMetadata.seq_lens_cpu_upper_bound is "
                                                 "missing"):
        plugin.register_backends()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    with pytest.raises(VLLMSelectionError, match=r"internal impl\.dcp_world_size is missing on X"):
        check_internals(ENGINE, INTERNALS, role="impl", obj=SimpleNamespace(
            num_heads=4, scale=0.1, kv_lora_rank=R, kv_cache_dtype="auto", need_to_return_lse_for_decode=False,
            can_return_lse_for_decode=False, supports_quant_query_input=False), where="X")


def test_vllm_layers_carry_the_host_scale() -> None:
    """The attribute read is the one vLLM 0.32 sets on its attention layers (set_default_quant_scales)."""
    from vllm.model_executor.layers.attention import attention as vllm_attention

    layer = torch.nn.Module()
    vllm_attention.set_default_quant_scales(layer, register_buffer=True)
    assert isinstance(getattr(layer, vb.SCALE_ATTR), float)


# ---- declarations: the backend's and vLLM's path together (issue 37, part 2) --------------------------------
def test_declarations_reach_vllm_as_the_intersection(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    B = vb.MLABackendsBackend
    cfg = SimpleNamespace(model_config=object())
    monkeypatch.setattr(vb, "get_current_vllm_config_or_none", lambda: cfg)
    monkeypatch.setattr(vb, "request_from_vllm", _fake_request(RefTorchBackend.capabilities))
    assert B.get_supported_head_sizes() == sorted(MLACommonBackend.get_supported_head_sizes())  # REF_TORCH: any
    assert B.get_supported_kernel_block_sizes() == [16]  # vLLM's CPU platform: 16 only
    assert B.supports_dtype(torch.float32) and B.supports_kv_cache_dtype("fp8_e5m2")


def test_supports_combination_refuses_what_vllm_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = {"num_attention_heads": 4, "kv_lora_rank": 256, "qk_nope_head_dim": 16, "qk_rope_head_dim": 32,
          "v_head_dim": 16, "hidden_size": 64, "q_lora_rank": None, "num_hidden_layers": 2}
    cfg = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.float32),
                          cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1))
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.setattr(vb, "get_current_vllm_config_or_none", lambda: cfg)
    msg = vb.MLABackendsBackend.supports_combination(288, torch.float32, "auto", 16, True, False, False, False,
                                                     None)
    chosen = cpu_choice()  # the selector's CPU choice on this machine
    assert msg is not None and "head size: got 288" in msg and f"any by {chosen}" in msg
    hf.update(kv_lora_rank=512, qk_rope_head_dim=64)
    assert vb.MLABackendsBackend.supports_combination(576, torch.float32, "auto", 16, True, False, False, False,
                                                      None) is None


# ---- the CLI shim (issue 37, part 7) ------------------------------------------------------------------------
def _shim(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLA_BACKENDS_VLLM"}
    return subprocess.run([sys.executable, "-m", "mla_backends.integrations.vllm", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_cli_shim_runs_vllms_cli() -> None:
    # one start of vLLM's CLI (each costs ~14 s of imports): a subcommand's own help proves the arguments reach
    # vLLM's parser
    out = _shim("serve", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: vllm serve"), out.stderr[-3000:]
