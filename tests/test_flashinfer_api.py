"""The FlashInfer backends against the installed flashinfer-python, on the CPU.

* importing ``mla_backends.flashinfer_mla`` (and selecting) never imports flashinfer;
* every keyword the project passes to FlashInfer exists in the installed signatures (and every string value
  is one of the ``Literal`` choices the signature declares), so API drift fails here;
* the real wrapper, built with a CPU workspace, accepts our ``plan()`` arguments up to the point where it
  needs a GPU ("device must be a cuda device"); the cutlass contract facts we rely on (128 heads, fixed
  scale) are FlashInfer's own checks;
* plans made once per step in ``prepare`` on wrappers the step's state holds (a pool per configured backend),
  zero-copy cache views, CSR metadata, block-table alignment, head padding and scale folding,
  checked with a recording stand-in for the wrapper (the GPU numerics are in test_flashinfer_gpu.py);
* ``forward_mqa`` rejects bad inputs with errors naming the argument before touching FlashInfer.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys
import traceback
import typing

import pytest
import torch
from flashinfer_fakes import use_wrapper

from mla_backends.backends import inputs as device_module  # where check_declared_support looks devices up
from mla_backends.backends.contract import AttentionSpec, configure_backend, release_configured_backends
from mla_backends.core.device import device_info_for, simulated_device
from mla_backends.flashinfer_mla import (
    FlashInferCutlassMLABackend,
    FlashInferMLABackend,
    FlashInferTrtllmMLABackend,
    FlashInferXqaMLABackend,
    _common,
    api,
    paged,
)
from mla_backends.plugins.loading import get_backend
from mla_backends.plugins.registry import BackendName
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata
from mla_backends.step.plan import StepPlanError, plan_step

pytest.importorskip("flashinfer",
                    reason="flashinfer-python is not installed (pip install 'mla-backends[flashinfer]')")

ALL = (FlashInferMLABackend, FlashInferCutlassMLABackend, FlashInferTrtllmMLABackend, FlashInferXqaMLABackend)


def make_batch(*, block_size=16, num_blocks=12, heads=4, dtype=torch.bfloat16, kv="auto", q_lens=(1, 1, 1),
               ctx=(20, 3, 40)):
    """A small cache with random rows and a batch whose block tables are scattered and -1 padded."""
    gen = torch.Generator().manual_seed(0)
    cache = LatentKVCache(num_blocks, block_size, kv_cache_dtype=kv, model_dtype=dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(cache.data.dtype))
    width = max(4, max(-(-(q + c) // block_size) for q, c in zip(q_lens, ctx, strict=True)))
    rows, next_block = [], num_blocks - 1
    for q, c in zip(q_lens, ctx, strict=True):
        need = -(-(q + c) // block_size)
        row = list(range(next_block, next_block - need, -1)) + [-1] * (width - need)
        next_block -= need
        rows.append(row)
    meta = BatchMetadata.build(list(q_lens), list(ctx), rows, block_size, num_blocks=num_blocks)
    T = meta.num_tokens
    q_latent = torch.randn(T, heads, 512, generator=gen).to(dtype)
    q_rope = torch.randn(T, heads, 64, generator=gen).to(dtype)
    return cache, meta, q_latent, q_rope


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test gets its own workspaces (freed afterwards), small CPU ones."""
    monkeypatch.setattr(_common, "_WORKSPACES", {})
    monkeypatch.setattr(_common, "WORKSPACE_BYTES", 1 << 20)
    release_configured_backends()  # (their wrapper pools would hold another test's stand-ins)


# ---- lazy import ------------------------------------------------------------------------------------------
def test_package_import_and_selection_do_not_import_flashinfer():
    code = (
        "import sys\n"
        "import mla_backends.flashinfer_mla as m\n"
        "from mla_backends.backends.contract import AttentionSpec\n"
        "from mla_backends.core.device import DeviceInfo\n"
        "for cls in (m.FlashInferMLABackend, m.FlashInferCutlassMLABackend, m.FlashInferTrtllmMLABackend,\n"
        "            m.FlashInferXqaMLABackend):\n"
        "    for cc in [(8, 0), (9, 0), (10, 0), (12, 0)]:\n"
        "        d = DeviceInfo(kind='cuda', name='x', compute_capability=cc, simulated=True)\n"
        "        cls.not_supported_reasons(AttentionSpec(num_heads=16, device=d))\n"
        "try:\n"
        "    from selector.select import select_backend\n"
        "    for dev in ('sm90', 'sm100', 'sm120'):\n"
        "        select_backend('deepseek_v3', device=dev)\n"
        "except ImportError:\n"
        "    pass\n"
        "bad = sorted(k for k in sys.modules if k == 'flashinfer' or k.startswith('flashinfer.'))\n"
        "print('LOADED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "LOADED []" in res.stdout


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_every_backend_imports_and_is_registered(cls):
    assert cls.name in {b.value for b in BackendName}
    assert get_backend(cls.name) is cls
    assert cls().__class__ is cls  # constructible without arguments, no kernel loaded


# ---- keywords against the installed signatures -----------------------------------------------------------
def _sample_calls() -> dict[str, dict]:
    t = torch.zeros(1, dtype=torch.int32)
    x = torch.zeros(1, 1, 1)
    return {
        "csr_metadata_kwargs": dict(qo_indptr=t, kv_indptr=t, kv_indices=t, kv_len_arr=t),
        "dense_metadata_kwargs": dict(cum_seq_lens_q=t, block_tables=t, seq_lens=t, max_q_len=1),
        "wrapper_init_kwargs": dict(workspace=t, fi_backend="fa2"),
        "fa_plan_kwargs": dict(metadata=None, num_heads=16, kv_lora_rank=512, rope_dim=64, page_size=16,
                               sm_scale=0.1, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
        "fa_run_kwargs": dict(q_latent=x, q_rope=x, ckv=x, kpe=x, out=x, lse=x, fp8_scale=0.5),
        "cutlass_plan_kwargs": dict(metadata=None, kv_lora_rank=512, rope_dim=64, page_size=64, sm_scale=0.1,
                                    dtype=torch.bfloat16),
        "cutlass_run_kwargs": dict(query=x, ckv=x, kpe=x, out=x),
        "trtllm_kwargs": dict(query=x, kv_cache=x, workspace=t, kv_lora_rank=512, rope_dim=64, block_tables=t,
                              seq_lens=t, max_seq_len=8, out=x, lse=x, bmm1_scale=0.1, bmm2_scale=1.0),
        "xqa_kwargs": dict(query=x, kv_cache=x, workspace=t, kv_lora_rank=512, rope_dim=64, block_tables=t,
                           seq_lens=t, max_seq_len=8, out=x, bmm1_scale=0.1, bmm2_scale=1.0),
    }


def test_every_keyword_builder_is_checked():
    builders = {n for n in api.__all__ if n.endswith("_kwargs")}
    assert builders == set(api.KWARG_TARGETS) == set(_sample_calls())


def _literal_choices(annotation) -> set | None:
    """The allowed values of a ``Literal[...]`` (possibly inside ``Optional``), else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _literal_choices(arg)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("builder", sorted(api.KWARG_TARGETS))
def test_keywords_exist_in_installed_signatures(builder):
    loader, attr = api.KWARG_TARGETS[builder]
    target = loader()
    fn = getattr(target, attr) if attr else target
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = sig.parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), \
        f"{fn.__qualname__} takes **kwargs: keyword names could not be checked"
    kwargs = getattr(api, builder)(**_sample_calls()[builder])
    for key, value in kwargs.items():
        assert key in params, f"{builder}: {fn.__qualname__} has no parameter {key!r} in flashinfer " \
                              f"{_common._install.installed_version()}"
        assert params[key].kind is not inspect.Parameter.POSITIONAL_ONLY
        choices = _literal_choices(hints.get(key))
        if choices is not None and isinstance(value, str):
            assert value in choices, f"{builder}: {key}={value!r} not in {sorted(choices)}"


def test_lse_is_requested_in_natural_log_everywhere():
    x = torch.zeros(1)
    assert api.fa_plan_kwargs(None, num_heads=1, kv_lora_rank=512, rope_dim=64, page_size=1, sm_scale=1.0,
                              q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)["lse_mode"] == "basee"
    assert api.fa_run_kwargs(x, x, x, x, out=x, lse=x, fp8_scale=None)["return_lse_base_on_e"] is True
    trt = api.trtllm_kwargs(x, x, x, kv_lora_rank=512, rope_dim=64, block_tables=x, seq_lens=x, max_seq_len=1,
                            out=x, lse=x, bmm1_scale=1.0, bmm2_scale=1.0)
    assert trt["return_lse_base"] == "basee" and trt["backend"] == "trtllm-gen"


# ---- the real wrapper up to the GPU ----------------------------------------------------------------------
def _cpu_wrapper(fi_backend: str):
    wrapper_cls = api.load_wrapper_class()
    return wrapper_cls(**api.wrapper_init_kwargs(torch.zeros(1024, dtype=torch.uint8), fi_backend))


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("fi_backend", ["fa2", "fa3"])
def test_fa_plan_reaches_the_device_check(fi_backend):
    cache, meta, q, _ = make_batch(q_lens=(1, 3, 2))
    # (positional and flat-metadata plan() forms emit DeprecationWarning: the marker turns it into a failure)
    with pytest.raises(ValueError, match="^device must be a cuda device$"):
        paged.plan_fa(_cpu_wrapper(fi_backend), meta, num_heads=q.shape[1], kv_lora_rank=512, rope_dim=64,
                      page_size=cache.block_size, scale=0.1, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("page", [1, 16, 64, 128])
def test_cutlass_plan_reaches_the_device_check(page):
    cache, meta, _, _ = make_batch(block_size=page, num_blocks=80 if page < 16 else 12)
    with pytest.raises(ValueError, match="^device must be a cuda device$"):
        paged.plan_cutlass(_cpu_wrapper("cutlass"), meta, kv_lora_rank=512, rope_dim=64, page_size=page,
                           dtype=torch.bfloat16)


def test_flashinfer_itself_enforces_the_cutlass_contract_we_declare():
    """128 heads and the fixed 1/sqrt(192) scale are FlashInfer's rules (checked before the device)."""
    cache, meta, _, _ = make_batch(block_size=64)
    md = api.load_plan_metadata_class().dense(**api.dense_metadata_kwargs(
        meta.query_start_loc, _common.dense_block_table(meta, align=2), meta.seq_lens, 1))
    wrapper = _cpu_wrapper("cutlass")
    good = api.cutlass_plan_kwargs(md, kv_lora_rank=512, rope_dim=64, page_size=64,
                                   sm_scale=paged.cutlass_fixed_scale(64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fixed MLA softmax scale"):
        wrapper.plan(**{**good, "sm_scale": 0.1})
    with pytest.raises(ValueError, match="Expected 128 heads"):
        wrapper.plan(**{**good, "num_heads": 64})
    with pytest.raises(ValueError, match="device must be a cuda device"):
        wrapper.plan(**good)
    assert math.isclose(paged.cutlass_fixed_scale(64), 192 ** -0.5)


@pytest.mark.parametrize("cls", [FlashInferMLABackend, FlashInferCutlassMLABackend, FlashInferXqaMLABackend],
                         ids=lambda c: c.name)
def test_backend_launch_reaches_the_device_check(cls):
    cache, meta, q, qr = make_batch(block_size=32, heads=16)
    kwargs = {"lse_out": None} if cls is FlashInferMLABackend else {}
    with pytest.raises(ValueError, match="^device must be a cuda device$"):
        cls()._launch(q, qr, cache, meta, scale=0.1, out=None, **kwargs)


def test_trtllm_launch_reaches_the_device_query():
    cache, meta, q, qr = make_batch(block_size=32, heads=16)
    with pytest.raises((AssertionError, RuntimeError, ValueError)) as info:
        FlashInferTrtllmMLABackend()._launch(q, qr, cache, meta, scale=0.1, out=None, lse_out=None)
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert any("flashinfer" in f and "mla" in f for f in frames), frames  # inside FlashInfer's MLA code
    assert "No module named" not in str(info.value)


# ---- plan caching, views and metadata (recording stand-in for the wrapper) ---------------------------------
@pytest.fixture
def recording(monkeypatch):
    return use_wrapper(monkeypatch)


def fa_configured(cache, q, scale=0.1, cls=FlashInferMLABackend):
    """The configured backend a layer of these shapes holds (configure_backend)."""
    spec = AttentionSpec(num_heads=q.shape[1], dtype=q.dtype, kv_cache_dtype=cache.kv_cache_dtype,
                         block_size=cache.block_size, device=device_info_for(cache.device))
    return configure_backend(cls, spec, scale)


def test_each_live_step_holds_its_own_planned_wrapper_and_none_is_replanned(recording):
    """A step's state takes a wrapper from the configured backend's pool and plans it once, in prepare; a step
    planned while the first is still alive takes another, so running the first again re-plans nothing; a
    dropped step's wrapper goes back to the pool and the next step plans it again."""
    import gc

    cache, meta, q, qr = make_batch(q_lens=(1, 4, 2), ctx=(20, 3, 40), heads=8)
    backend = fa_configured(cache, q)
    plan1 = plan_step(meta, [backend])
    (w1,) = recording.instances
    assert len(w1.plans) == 1 and not w1.runs  # planned when the step was planned

    def layer(q, qr, cache, meta, plan):  # (what forward_mqa runs after its checks, which want a GPU here)
        return backend._launch(q, qr, cache, meta, scale=0.1, out=None, lse_out=None, state=plan.state(backend, meta))

    for _ in range(3):  # three layers
        layer(q, qr, cache, meta, plan1)
    assert len(w1.plans) == 1 and len(w1.runs) == 3
    cache2, meta2, q2, qr2 = make_batch(q_lens=(1, 1, 1), heads=8)
    plan2 = plan_step(meta2, [backend])  # step 1's plan still alive: another wrapper
    w2 = recording.instances[1]
    layer(q2, qr2, cache2, meta2, plan2)
    out, lse = layer(q, qr, cache, meta, plan1)  # step 1 again: no re-plan
    assert [len(w.plans) for w in (w1, w2)] == [1, 1] and len(w1.runs) == 4
    assert torch.equal(lse, torch.full_like(lse, 1.5)) and out.dtype == q.dtype
    del plan1
    gc.collect()
    plan_step(meta, [backend])  # the dropped step's wrapper is planned again
    assert len(recording.instances) == 2 and len(w1.plans) == 2 and backend.resources.made == 2


def test_configured_fa_backend_plans_in_prepare_and_forward_only_runs(recording):
    # the layer's configured backend (heads, dtypes, page size, scale): the engine's one per-step call
    # plan_step(meta, [backend]) runs plan() outside any capture, and forward_mqa only runs the wrapper
    cache, meta, q, qr = make_batch(q_lens=(1, 4, 2), ctx=(20, 3, 40), heads=8)
    backend = fa_configured(cache, q)
    plan = plan_step(meta, [backend])
    (wrapper,) = recording.instances
    assert len(wrapper.plans) == 1 and not wrapper.runs
    for _ in range(3):  # three layers
        backend._launch(q, qr, cache, meta, scale=0.1, out=None, lse_out=None, fi_backend=wrapper.backend,
                        state=plan.state(backend, meta))
    assert len(wrapper.plans) == 1 and len(wrapper.runs) == 3
    assert backend.prepare_key() != FlashInferMLABackend
    with pytest.raises(StepPlanError, match="supported the call its step state planned"):
        backend._launch(q, qr, cache, meta, scale=0.2, out=None, lse_out=None, fi_backend=wrapper.backend,
                        state=plan.state(backend, meta))  # another scale: refused, not re-planned
    assert len(wrapper.plans) == 1


def test_fa_passes_zero_copy_cache_views_and_csr_metadata(recording):
    cache, meta, q, qr = make_batch(q_lens=(1, 4, 2), ctx=(20, 3, 40), heads=8)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    got_out, got_lse = FlashInferMLABackend()._launch(q, qr, cache, meta, scale=0.25, out=out, lse_out=lse,
                                                      fi_backend="fa2")
    assert got_out is out and got_lse is lse
    (wrapper,) = recording.instances
    plan, run = wrapper.plans[0], wrapper.runs[0]
    ckv, kpe = run["kv_cache"]
    assert ckv.data_ptr() == cache.data.data_ptr() and ckv.shape == (12, 16, 512) and ckv.stride() == (
        16 * 576, 576, 1)
    assert kpe.data_ptr() == cache.data.data_ptr() + 512 * cache.data.element_size() and kpe.shape[-1] == 64
    assert run["out"] is out and run["lse"] is lse and run["return_lse_base_on_e"] is True
    assert "ckv_scale" not in run  # bf16 cache: no fp8 scales
    assert plan["num_heads"] == 8 and plan["sm_scale"] == 0.25 and plan["causal"] is True
    md = plan["metadata"]
    pages = [-(-s // 16) for s in meta.seq_lens_list]
    assert md.kv_indptr.tolist() == [0, pages[0], pages[0] + pages[1], sum(pages)]
    assert md.kv_len_arr.tolist() == list(meta.seq_lens_list)
    assert md.qo_indptr.tolist() == meta.query_start_loc.tolist()
    expected = [int(meta.block_table[b, i]) for b in range(3) for i in range(pages[b])]
    assert md.kv_indices.tolist() == expected and -1 not in expected


def test_cutlass_pads_heads_folds_scale_aligns_table_and_slices_back(recording):
    cache, meta, q, qr = make_batch(block_size=32, heads=16, ctx=(20, 3, 40))
    scale = 0.07
    out, lse = FlashInferCutlassMLABackend()._launch(q, qr, cache, meta, scale=scale, out=None)
    assert lse is None and out.shape == q.shape and out.is_contiguous()
    # the recorder writes head index h into head h's output: the slice kept heads 0..15
    assert torch.equal(out[:, :, 0], torch.arange(16, dtype=out.dtype).expand(3, 16))
    (wrapper,) = recording.instances
    plan, run = wrapper.plans[0], wrapper.runs[0]
    query = run["query"]
    assert query.shape == (3, 128, 576) and query.is_contiguous() and query.dtype == torch.bfloat16
    assert torch.count_nonzero(query[:, 16:]) == 0
    factor = scale / paged.cutlass_fixed_scale(64)
    ref = (torch.cat([q, qr], -1).float() * factor).to(torch.bfloat16)
    assert torch.equal(query[:, :16], ref)
    assert plan["num_heads"] == 128 and plan["lse_mode"] == "none"
    assert math.isclose(plan["sm_scale"], 192 ** -0.5)
    table = plan["metadata"].block_tables
    assert table.shape[1] % (128 // 32) == 0 and table.dtype == torch.int32
    assert int(table.min()) >= 0  # -1 padding replaced by a valid page id
    ckv, kpe = run["kv_cache"]
    assert ckv.data_ptr() == cache.data.data_ptr() and kpe.data_ptr() == ckv.data_ptr() + 1024


def test_pack_query_and_block_table_helpers():
    q = torch.randn(2, 3, 512)
    qr = torch.randn(2, 3, 64)
    packed = _common.pack_query(q, qr, num_heads=3, dtype=torch.float32)
    assert torch.equal(packed, torch.cat([q, qr], -1))
    with pytest.raises(ValueError, match="num_heads: got 2"):
        _common.pack_query(q, qr, num_heads=2, dtype=torch.float32)
    meta = BatchMetadata.build([1, 1], [0, 40], [[5, -1, -1], [1, 2, 3]], 16)
    table = _common.dense_block_table(meta, align=4)
    assert table.tolist() == [[5, 0, 0, 0], [1, 2, 3, 0]]
    state = FlashInferXqaMLABackend().step_state(meta)  # prepared: XQA's alignment, 128 / page size 16
    assert state.block_table(meta, align=8) is state.block_table(meta, align=8)
    assert torch.equal(state.block_table(meta, align=8), _common.dense_block_table(meta, align=8))
    assert torch.equal(table[:, :4], state.block_table(meta, align=8)[:, :4])
    with pytest.raises(StepPlanError, match="aligned to 4"):
        state.block_table(meta, align=4)  # never built in a layer call
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.call = ()  # type: ignore[misc]


def test_flashinfer_step_state_is_prepared_once_per_step_and_shared_by_instances(recording):
    """The prepare hook: every layer's configured backend (one object for one configuration) gets the step's
    one FlashInferStep; a new step (or a dataclasses.replace copy) gets a fresh one; another class prepares its
    own."""
    cache, meta, q, qr = make_batch(q_lens=(1, 4, 2), ctx=(20, 3, 40), heads=8)
    layers = [fa_configured(cache, q) for _ in range(4)]
    xqa = FlashInferXqaMLABackend()
    plan = plan_step(meta, [*layers, xqa])  # what an engine calls before the first layer
    state = plan.state(layers[0], meta)
    assert isinstance(state, _common.FlashInferStep)
    assert all(plan.state(b, meta) is state for b in layers) and len(plan.states) == 2
    assert plan.state(xqa, meta) is not state  # another class prepares its own
    copy = dataclasses.replace(meta)
    assert plan_step(copy, layers[:1]).state(layers[0], copy) is not state
    with pytest.raises(StepPlanError, match="made for other metadata"):
        plan.state(layers[0], copy)


def test_one_zeroed_workspace_per_device_and_path(monkeypatch):
    assert api.WORKSPACE_BYTES == 128 * 1024 * 1024  # FlashInfer's recommendation; XQA's minimum
    cpu = torch.device("cpu")
    ws = _common.workspace_for(cpu, "xqa")
    assert ws is _common.workspace_for(cpu, "xqa")
    assert ws.numel() == _common.WORKSPACE_BYTES and ws.dtype == torch.uint8 and not bool(ws.any())
    assert _common.workspace_for(cpu, "fa") is not ws  # XQA's semaphores never share a buffer


# ---- input validation before FlashInfer -------------------------------------------------------------------
@pytest.fixture
def on_declared_device(monkeypatch):
    """Make :func:`check_declared_support` see a device the backend declares (the tensors stay on the CPU), so
    that the reason a test provokes is the only one."""
    def use(cls):
        cc = min(cls.capabilities.compute_capabilities)
        monkeypatch.setattr(device_module, "device_info_for", lambda device: simulated_device(*cc))
    return use


def test_forward_rejects_cpu_tensors_naming_the_device():
    cache, meta, q, qr = make_batch(block_size=64, heads=16)
    for cls in ALL:
        with pytest.raises(ValueError) as info:
            cls().forward_mqa(q, qr, cache, meta, scale=0.1)
        want = f"device: got CPU; supported a CUDA device ({cls.capabilities.compute_capability_text()})"
        assert str(info.value) == f"{cls.name} cannot run these inputs: {want}"


@pytest.mark.parametrize("cls,change,exc,message", [
    (FlashInferMLABackend, dict(dtype=torch.float32), TypeError, "dtype: got float32; supported bfloat16, "
                                                                 "float16"),
    (FlashInferMLABackend, dict(kv="fp8_e5m2"), TypeError, "kv cache dtype: got fp8_e5m2"),
    (FlashInferMLABackend, dict(kv="float16"), TypeError, "kv cache dtype: got float16 with bfloat16"),
    (FlashInferCutlassMLABackend, dict(heads=129), ValueError, "num_heads: got 129; supported <= 128"),
    (FlashInferCutlassMLABackend, dict(q_lens=(1, 2, 1)), ValueError, "query length: got 2; supported 1"),
    (FlashInferCutlassMLABackend, dict(q_lens=(1, 0, 1)), ValueError,
     "meta.query_lens: got [0, 1]; supported >= 1 token in every request"),
    (FlashInferCutlassMLABackend, dict(block_size=48), ValueError, "page size: got 48"),
    (FlashInferTrtllmMLABackend, dict(heads=96), ValueError, "num_heads: got 96; supported <= 64 or "
                                                             "exactly 128"),
    (FlashInferTrtllmMLABackend, dict(heads=129), ValueError, "num_heads: got 129; supported <= 128"),
    (FlashInferTrtllmMLABackend, dict(q_lens=(1, 2, 1)), ValueError,
     "query length: got varying lengths per request; supported uniform lengths"),
    (FlashInferTrtllmMLABackend, dict(block_size=16), ValueError, "page size: got 16; supported 32, 64"),
    (FlashInferTrtllmMLABackend, dict(dtype=torch.float16), TypeError, "dtype: got float16"),
    (FlashInferXqaMLABackend, dict(heads=129), ValueError, "num_heads: got 129; supported <= 128"),
    (FlashInferXqaMLABackend, dict(q_lens=(2, 2, 2)), ValueError, "query length: got 2; supported 1"),
    (FlashInferXqaMLABackend, dict(kv="float16", dtype=torch.bfloat16), TypeError,
     "kv cache dtype: got float16"),
])
def test_forward_rejects_what_the_kernel_cannot_run(cls, change, exc, message, on_declared_device):
    on_declared_device(cls)
    kw = dict(block_size=64, heads=16)
    kw.update(change)
    cache, meta, q, qr = make_batch(**kw)
    with pytest.raises(exc) as info:
        cls().forward_mqa(q, qr, cache, meta, scale=0.1)
    assert str(info.value).startswith(f"{cls.name} cannot run these inputs: {message}"), str(info.value)


def test_trtllm_reports_over_128_heads_once(on_declared_device):
    on_declared_device(FlashInferTrtllmMLABackend)
    cache, meta, q, qr = make_batch(block_size=64, heads=129)
    with pytest.raises(ValueError) as info:
        FlashInferTrtllmMLABackend().forward_mqa(q, qr, cache, meta, scale=0.1)
    assert str(info.value).count("num_heads") == 1, str(info.value)


@pytest.mark.parametrize("cls", [FlashInferCutlassMLABackend, FlashInferXqaMLABackend], ids=lambda c: c.name)
def test_no_lse_backends_refuse_an_lse_buffer(cls, on_declared_device):
    on_declared_device(cls)
    cache, meta, q, qr = make_batch(block_size=64, heads=16)
    with pytest.raises(ValueError) as info:
        cls().forward_mqa(q, qr, cache, meta, scale=0.1, lse_out=torch.empty(q.shape[:2]))
    assert str(info.value) == f"{cls.name} cannot run these inputs: LSE: got a request for it; supported " \
                              "output only (no LSE)"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_dense_only_backends_refuse_topk_indices(cls, on_declared_device):
    on_declared_device(cls)
    cache, meta, q, qr = make_batch(block_size=64, heads=16)
    with pytest.raises(ValueError) as info:
        cls().forward_mqa(q, qr, cache, meta, scale=0.1, topk_indices=torch.zeros(3, 1, dtype=torch.int32))
    assert str(info.value) == f"{cls.name} cannot run these inputs: attention: got sparse (top-k indices); " \
                              "supported dense only"


def test_cutlass_refuses_a_non_contiguous_cache(on_declared_device, recording):
    on_declared_device(FlashInferCutlassMLABackend)  # (the stand-in wrapper plans the call's step on the CPU)
    cache, meta, q, qr = make_batch(block_size=64, heads=16)
    cache.data = torch.zeros(cache.num_blocks, 2 * cache.block_size, 576, dtype=cache.data.dtype)[:, ::2]
    with pytest.raises(ValueError, match=r"^cache.data: got a non-contiguous tensor; supported a contiguous"):
        FlashInferCutlassMLABackend().forward_mqa(q, qr, cache, meta, scale=0.1)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_shared_input_checks_run_first(cls):
    cache, meta, q, qr = make_batch(block_size=64, heads=16)
    with pytest.raises(ValueError, match="^scale: got -1.0"):
        cls().forward_mqa(q, qr, cache, meta, scale=-1.0)
    with pytest.raises(ValueError, match="^q_rope: got shape"):
        cls().forward_mqa(q, qr[:, :8], cache, meta, scale=0.1)


def test_xqa_scales_are_floats_or_device_tensors():
    x = torch.zeros(1)
    common = dict(kv_lora_rank=512, rope_dim=64, block_tables=x, seq_lens=x, max_seq_len=1, out=x)
    kw = api.xqa_kwargs(x, x, x, **common, bmm1_scale=0.25, bmm2_scale=2)
    assert type(kw["bmm1_scale"]) is float and kw["bmm1_scale"] == 0.25 and type(kw["bmm2_scale"]) is float
    kw = api.xqa_kwargs(x, x, x, **common, bmm1_scale=torch.tensor(0.25), bmm2_scale=torch.tensor([2.0]))
    for name, value in (("bmm1_scale", 0.25), ("bmm2_scale", 2.0)):  # the fp8 path: no host read
        t = kw[name]
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (1,) and t[0] == value
    with pytest.raises(TypeError, match="bmm1_scale/bmm2_scale"):
        api.xqa_kwargs(x, x, x, **common, bmm1_scale=torch.tensor(0.25), bmm2_scale=2.0)
