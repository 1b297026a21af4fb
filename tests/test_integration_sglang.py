"""The SGLang plugin's parts that need no SGLang: version range, the switch, cache-dtype mapping, the request built
from SGLang's runner fields, the page table / per-batch ``BatchMetadata`` / cache wrapper over SGLang's pool
layout, the per-batch dispatch decision, and ``mla-backends env``'s SGLang line. (The engine runs are in
tests/sglang_engine, in .venv-sglang.)"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from mla_backends import BatchMetadata, LatentKVCache, configure_backend
from mla_backends.integrations import sglang as plugin_pkg
from mla_backends.integrations.engine_core import LayerCaches
from mla_backends.integrations.sglang.selection import (
    SGLangSelectionError,
    request_from_runner,
    sglang_kv_cache_dtype,
    startup_line,
)
from mla_backends.integrations.sglang.step import (
    decode_metadata,
    dense_up_projection,
    extend_metadata,
    page_table,
    pool_pages,
    sglang_policy,
)
from mla_backends.integrations.sglang.versions import UnsupportedSGLangVersionError, check_sglang_version
from mla_backends.layer.dispatch import PerBatchPolicy, PerRequestPolicy
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.plan import plan_step

HF = dict(num_attention_heads=4, hidden_size=64, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
          v_head_dim=16, q_lora_rank=None, num_hidden_layers=2)
R, ROPE = 512, 64


def test_entry_point_is_declared_and_inert_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["sglang.srt.plugins"] == {
        "mla_backends": "mla_backends.integrations.sglang:register"}
    monkeypatch.delenv("MLA_BACKENDS_SGLANG", raising=False)
    before = set(sys.modules)
    plugin_pkg.register()
    new = set(sys.modules) - before
    assert "sglang" not in new and "mla_backends.integrations.sglang.plugin" not in new


def test_importing_the_package_and_selecting_never_imports_sglang() -> None:
    code = ("import sys, mla_backends, mla_backends.integrations.sglang as s, mla_backends.integrations.sglang.step, "
            "mla_backends.integrations.sglang.selection\n"
            "mla_backends.select_backend('deepseek-v2-lite', device='cpu')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("off", False), ("1", True), ("yes", True)])
def test_switch(value: str | None, on: bool) -> None:
    env = {} if value is None else {"MLA_BACKENDS_SGLANG": value}
    assert plugin_pkg.plugin_enabled(env) is on


def test_switch_refuses_unknown_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.core.env_switches import EnvSwitchError

    monkeypatch.setenv("MLA_BACKENDS_SGLANG", "2")
    with pytest.raises(EnvSwitchError, match="MLA_BACKENDS_SGLANG: got '2'"):
        plugin_pkg.register()


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23+cpu"])
def test_supported_versions(version: str) -> None:
    assert check_sglang_version(version) == "tested"


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "0.5.230", "0.5.23rc1", "0.5", "unknown"])
def test_other_versions_name_the_range(version: str) -> None:
    with pytest.raises(UnsupportedSGLangVersionError,
                       match=r"supported sglang>=0\.5\.23,<0\.5\.24 \(0\.5\.23 tested\)"):
        check_sglang_version(version)


def test_version_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="version: got int"):
        check_sglang_version(523)


@pytest.mark.parametrize("name,canon", [("auto", "auto"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"),
                                        ("fp8_e4m3", "fp8_e4m3"), ("FP8_E5M2", "fp8_e5m2")])
def test_kv_cache_dtype_names(name: str, canon: str) -> None:
    assert sglang_kv_cache_dtype(name) == canon


def test_kv_cache_dtype_refusals() -> None:
    with pytest.raises(SGLangSelectionError, match="kv cache dtype: got SGLang's 'fp4_e2m1'; supported auto"):
        sglang_kv_cache_dtype("fp4_e2m1")
    with pytest.raises(TypeError, match="kv_cache_dtype: got NoneType"):
        sglang_kv_cache_dtype(None)


def test_request_per_rank_heads_and_selection(monkeypatch: pytest.MonkeyPatch, cpu_fused_not_built: None) -> None:
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    req = request_from_runner(HF, tp_size=2, dtype=torch.float32, kv_cache_dtype="auto", page_size=16, device="cpu")
    assert req.dims.num_heads == 2 and req.dims.tp_size == 2 and req.block_size == 16
    sel = req.select()
    assert sel.name == "REF_TORCH"
    line = startup_line(sel, model="m", num_heads=2)
    assert line.startswith("mla-backends: SGLang attention backend mla_backends runs absorbed MLA on mla-backends "
                           "(model m, 2 heads on this rank). Chosen: REF_TORCH")


def test_request_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="tp_size: got 3; supported a divisor of num_heads=4"):
        request_from_runner(HF, tp_size=3, dtype=torch.float32, kv_cache_dtype="auto", page_size=1, device="cpu")
    with pytest.raises(ValueError, match="page_size: got 0"):
        request_from_runner(HF, tp_size=1, dtype=torch.float32, kv_cache_dtype="auto", page_size=0, device="cpu")
    with pytest.raises(TypeError, match="dtype: got str"):
        request_from_runner(HF, tp_size=1, dtype="float32", kv_cache_dtype="auto", page_size=1,  # type: ignore[arg-type]
                            device="cpu")
    monkeypatch.setenv("MLA_BACKEND", "TRITON_MLA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from selector.select import clear_cache

    clear_cache()
    req = request_from_runner(HF, tp_size=1, dtype=torch.float32, kv_cache_dtype="auto", page_size=1, device="cpu")
    with pytest.raises(SGLangSelectionError, match=r"cannot run this SGLang MLA model \(4 heads on this rank.*"
                                                   r"TRITON_MLA"):
        req.select()
    clear_cache()


def _pool(num_slots: int, page: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots + page, 1, R + ROPE, generator=g)


def test_page_table_page_size_1_and_16() -> None:
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    req_to_token[2, :40] = torch.arange(100, 140)  # slots of a request at page size 1
    assert page_table(req_to_token, torch.tensor([2]), 5, 1).tolist() == [[100, 101, 102, 103, 104]]
    req_to_token[1, :40] = torch.cat([torch.arange(48, 64), torch.arange(16, 32), torch.arange(80, 88)])
    assert page_table(req_to_token, torch.tensor([1]), 40, 16).tolist() == [[3, 1, 5]]
    with pytest.raises(ValueError, match="max_len: got 65; supported <= req_to_token's 64 columns"):
        page_table(req_to_token, torch.tensor([1]), 65, 16)


def test_pool_pages_share_memory_once_per_layer_and_refuse_bad_layouts() -> None:
    buf = _pool(64, 16)
    caches = LayerCaches(R, torch.float32)
    cache = caches.get(3, pool_pages(buf, 16), 1.0)
    assert cache.data.data_ptr() == buf.data_ptr() and tuple(cache.data.shape) == (5, 16, R + ROPE)
    assert caches.get(3, pool_pages(buf, 16), 1.0) is cache  # the layer's wrapper, made once
    with pytest.raises(ValueError, match="buffer: got 80 slots; supported a multiple of page_size 32"):
        pool_pages(buf, 32)
    with pytest.raises(ValueError, match=r"supported \[slots, 1, row\]"):
        pool_pages(torch.zeros(16, 2, R + ROPE), 1)


def _decode(pool: torch.Tensor, req_to_token: torch.Tensor, lens: list[int], page: int) -> torch.Tensor:
    sel = request_from_runner(HF, tp_size=1, dtype=torch.float32, kv_cache_dtype="auto", page_size=page,
                              device="cpu")
    from mla_backends.core.dims import MLADims

    dims = MLADims.from_hf_config(HF)
    from mla_backends import select_backend

    spec = select_backend(sel.dims, dtype=torch.float32, block_size=page, device="cpu", backend="REF_TORCH").spec
    backend = configure_backend(RefTorchBackend, spec, dims.softmax_scale)
    meta = decode_metadata(req_to_token, torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int32), lens, page)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), 4, R + ROPE, generator=g)
    cache = LatentKVCache.from_tensor(pool_pages(pool, page), kv_lora_rank=R, model_dtype=torch.float32)
    out, _ = backend.forward_mqa(q[..., :R], q[..., R:], cache, meta, scale=dims.softmax_scale,
                                 plan=plan_step(meta, [backend]))
    return out


def test_decode_reads_the_same_rows_at_page_size_1_and_16() -> None:
    """The same tokens held in slots of a page-1 pool and of a page-16 pool (pages out of order): one answer."""
    lens = [20, 7]
    page_slots = [[2 * 16 + j for j in range(16)] + [0 * 16 + j for j in range(4)], [3 * 16 + j for j in range(7)]]
    flat_slots = [[40 + j for j in range(20)], [5 + j for j in range(7)]]
    big = _pool(64, 16, seed=3)
    small = torch.zeros(80 + 1, 1, R + ROPE)
    rt16 = torch.zeros(2, 32, dtype=torch.int32)
    rt1 = torch.zeros(2, 32, dtype=torch.int32)
    for b in range(2):
        rt16[b, : lens[b]] = torch.tensor(page_slots[b])
        rt1[b, : lens[b]] = torch.tensor(flat_slots[b])
        small[torch.tensor(flat_slots[b])] = big[torch.tensor(page_slots[b])]
    out16 = _decode(big, rt16, lens, 16)
    out1 = _decode(small, rt1, lens, 1)
    torch.testing.assert_close(out16, out1)
    # and a different row in request 1's range changes only request 1
    small[5] += 1.0
    out1b = _decode(small, rt1, lens, 1)
    torch.testing.assert_close(out1b[0], out1[0])
    assert not torch.allclose(out1b[1], out1[1])


def test_decode_metadata_reads_nothing_from_the_device_lists() -> None:
    rt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    meta = decode_metadata(rt, torch.tensor([1, 0]), torch.tensor([3, 5], dtype=torch.int32), [3, 5], 1)
    assert isinstance(meta, BatchMetadata) and meta.seq_lens_list == (3, 5) and meta.query_lens_list == (1, 1)
    assert meta.block_table[0, :3].tolist() == [8, 9, 10]  # pool row 1 first: SGLang's order kept


def test_extend_metadata_keeps_sglang_order_and_checks_pages() -> None:
    rt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    meta = extend_metadata(rt, torch.tensor([0, 1]), [3, 0], [2, 4], 1, num_pages=16)
    assert meta.query_lens_list == (2, 4) and meta.context_lens_list == (3, 0)
    with pytest.raises(ValueError, match="block_table: request 1 uses block id 12"):
        extend_metadata(rt, torch.tensor([0, 1]), [3, 0], [2, 5], 1, num_pages=12)
    with pytest.raises(ValueError, match="prefix_lens: got 1 entries; supported one per request"):
        extend_metadata(rt, torch.tensor([0, 1]), [3], [2, 5], 1, num_pages=12)


def _batch_absorbed(policy, ext: list[int], prefix: list[int]) -> bool:  # type: ignore[no-untyped-def]
    """The adapter's decision for an extend batch: planned with the handler's policy, absorbed when every run is."""
    from mla_backends.backends.capabilities import AttentionSpec

    page = 16
    pages = -(-max(e + p for e, p in zip(ext, prefix, strict=True)) // page)
    table = torch.arange(len(ext) * pages, dtype=torch.int32).reshape(len(ext), pages)
    meta = BatchMetadata.build(ext, prefix, table, page, reorder=False)
    backend = configure_backend(RefTorchBackend, AttentionSpec(num_heads=4, dtype=torch.float32, block_size=page),
                                0.125)
    plan = plan_step(meta, [backend], dispatch=policy)
    return all(rb.run.absorbed for rb in plan.runs_of(backend))


def test_batch_absorbed_follows_the_policy_and_the_backend() -> None:
    per_batch = PerBatchPolicy()
    assert _batch_absorbed(per_batch, [7, 3], [0, 0]) is False  # a cold prefill: SGLang's MHA
    assert _batch_absorbed(per_batch, [1, 5], [6, 32]) is True  # a cached prefix below the crossover
    assert _batch_absorbed(per_batch, [1, 5], [6, 9000]) is False  # past SGLang's 8192 crossover
    assert _batch_absorbed(PerRequestPolicy(threshold=2), [1, 5], [6, 32]) is False  # one request expanded
    assert _batch_absorbed(PerRequestPolicy(threshold=8), [1, 5], [0, 0]) is True  # measured: absorb short


def test_policy_defaults_to_sglang_rule_and_reads_a_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLA_BACKENDS_THRESHOLD_TABLE", raising=False)
    assert isinstance(sglang_policy("REF_TORCH"), PerBatchPolicy)
    monkeypatch.setenv("MLA_BACKENDS_THRESHOLD_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="MLA_BACKENDS_THRESHOLD_TABLE"):
        sglang_policy("REF_TORCH")


def test_env_reports_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backends.cli.env_cmd import sglang_status

    monkeypatch.delenv("MLA_BACKENDS_SGLANG", raising=False)
    st = sglang_status()
    assert st["plugin_would_activate"] is False
    if st["installed_version"] is None:
        assert st["reason"] == "SGLang is not installed" and st["version"] is None


def test_dense_up_projection_is_the_weight_or_the_projection_of_the_identity() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4 * (16 + 16), R, generator=g)
    assert dense_up_projection(w, lambda x: x @ w.t(), rows=128, kv_lora_rank=R, dtype=torch.float32) is w
    # a projection whose weight is stored otherwise (here: bfloat16 with a scale, as a quantised kv_b_proj is)
    stored, scale = (w / 3).to(torch.bfloat16), 3.0
    dense = dense_up_projection(stored, lambda x: (x @ stored.float().t()) * scale, rows=128, kv_lora_rank=R,
                                dtype=torch.float32)
    torch.testing.assert_close(dense, stored.float() * scale)
    with pytest.raises(ValueError, match=r"kv_b_proj\(identity\): got shape \[512, 64\]; supported \[512, 128\]"):
        dense_up_projection(stored, lambda x: x[:, :64], rows=128, kv_lora_rank=R, dtype=torch.float32)
