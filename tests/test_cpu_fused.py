"""``CPU_FUSED``: the compiled CPU kernel against the float64 naive *expanded* MLA of tests/test_ref_backend.py
(``expanded_mla``: per-head keys and values up-projected from every cached row, never absorbed), its work
list, its build cache and its place in selection.

The kernel is built once per machine (the default cache, as a user's first ``mla-backends build``); where no
compiler exists the kernel tests skip with that reason, and the selection tests still run.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import threading

import pytest
import torch
from test_ref_backend import R_LAT, R_ROPE, SCALE, Scenario

from mla_backends.backends.reasons import ReasonKind
from mla_backends.cpu_fused import CpuFusedBackend
from mla_backends.cpu_fused import build as fused_build
from mla_backends.cpu_fused import plan as fused_plan
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.plan import plan_step


@pytest.fixture(scope="module")
def fused():
    """A configured-per-call CPU_FUSED instance whose kernel is built and loaded (skips without a compiler)."""
    try:
        fused_build.load()
    except fused_build.BuildError as exc:
        pytest.skip(f"CPU_FUSED cannot be built on this machine: {exc}")
    return CpuFusedBackend()


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test and restores it."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# ---- numerics against the float64 expanded reference -------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("query_len", [1, 4])
def test_page_boundaries_fp32(fused, block_size, heads, query_len):
    """Contexts 1, page-1, page and page+1 in one scattered batch; fp32 to fp32-accumulation accuracy."""
    contexts = [1, max(block_size - 1, 0), block_size, block_size + 1]
    sc = Scenario([query_len] * 4, contexts, heads=heads, block_size=block_size, seed=block_size * heads + query_len)
    sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)


@pytest.mark.parametrize("query_len", [1, 4])
def test_128_heads_in_lane_groups(fused, query_len):
    """128 heads (several lane groups per request, 4 tokens x 128 heads = 8 groups) at the page boundaries."""
    sc = Scenario([query_len] * 4, [1, 15, 16, 17], heads=128, block_size=16, seed=128 + query_len)
    sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)


@pytest.mark.parametrize("model_dtype,kv,tol", [
    (torch.float16, "auto", 4e-3), (torch.bfloat16, "auto", 3e-2),
    (torch.float32, "bfloat16", 2e-6), (torch.float32, "float16", 2e-6), (torch.bfloat16, "float32", 3e-2)])
@pytest.mark.parametrize("query_len", [1, 3])
def test_query_and_cache_dtypes(fused, model_dtype, kv, tol, query_len):
    """Every query dtype and 16/32-bit cache dtype, crossed: 16-bit rows are widened in the kernel, and the
    output is rounded once to the query dtype (the tolerance is that dtype's rounding)."""
    sc = Scenario([query_len] * 3, [5, 40, 97], heads=16, block_size=16, model_dtype=model_dtype,
                  kv_cache_dtype=kv, seed=7)
    sc.check(tol_v=tol, tol_latent=tol, tol_lse=max(tol, 2e-6) * 2, backend=fused)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_scale", [0.37, 3.1])
@pytest.mark.parametrize("model_dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_fp8_cache_with_scale(fused, fmt, kv_scale, model_dtype, tol):
    """fp8 rows are decoded in the kernel and multiplied by the scale as ``LatentKVCache.dequantize`` does; the
    reference reads ``stored * scale`` (the quantisation is an input, not an error), so fp32 queries match to
    fp32 accuracy."""
    sc = Scenario([1, 4, 1], [30, 17, 64], heads=16, block_size=16, model_dtype=model_dtype, kv_cache_dtype=fmt,
                  scale=kv_scale, seed=11)
    sc.check(tol_v=tol, tol_latent=tol, tol_lse=max(tol, 2e-6) * 2, backend=fused)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_bytes_decode_exactly_like_dequantize(fused, dtype):
    """Every finite fp8 byte (subnormals and the largest values included) through the kernel: one cached row
    holding them all, attended alone (weight exactly 1), so the output is the decoded row times the scale, bit
    for bit ``LatentKVCache.dequantize``'s. A NaN byte (e4m3's 0x7F, e5m2's 0x7D) in an owned row makes the
    output NaN, as in the reference."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(dtype).float())]
    row = torch.zeros(1, 1, R_LAT + R_ROPE, dtype=torch.uint8)
    row[0, 0, : finite.numel()] = finite
    cache = LatentKVCache.from_tensor(row.view(dtype), model_dtype=torch.float32, scale=0.37)
    meta = _meta([1], [0], [[0]], 1)
    q, qr = torch.zeros(1, 1, R_LAT), torch.zeros(1, 1, R_ROPE)
    out, _ = fused.forward_mqa(q, qr, cache, meta, scale=SCALE)
    want = cache.dequantize(row.view(dtype)[0, 0, :R_LAT], torch.float32)
    assert torch.equal(out[0, 0], want)
    row[0, 0, 7] = 0x7F if dtype == torch.float8_e4m3fn else 0x7D
    out, _ = fused.forward_mqa(q, qr, cache, meta, scale=SCALE)
    assert bool(torch.isnan(out).all())


def test_bf16_output_rounds_like_torch_bit_for_bit(fused):
    """The kernel's own bf16 rounding of its output (to nearest, ties to even; past the largest value,
    infinity; NaN stays NaN): two cached rows with equal scores (zero queries), so each output element is
    ``(a + b) / 2`` in fp32, rounded once. The pairs include exact ties rounded down and up, means that overflow
    to both infinities, a zero, fp32-subnormal values and random values: the result equals torch's
    ``.to(torch.bfloat16)`` of the same fp32 mean, bit for bit. Then a NaN in one row (every score NaN) gives
    a NaN in every output element, not an infinity."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(R_LAT, generator=g).to(torch.bfloat16)
    b = torch.randn(R_LAT, generator=g).to(torch.bfloat16)
    ulp = 2.0**-7  # the bf16 spacing in [1, 2)
    big = torch.finfo(torch.bfloat16).max
    special = [(1.0, 1.0 + ulp),  # mean 1 + ulp/2: a tie, to the even 1.0
               (1.0 + ulp, 1.0 + 2 * ulp),  # mean 1 + 1.5 ulp: a tie, to the even 1 + 2 ulp
               (-1.0, -1.0 - ulp), (big, big), (-big, -big), (big, -big), (0.0, -0.0),
               (2.0**-133, 2.0**-133), (2.0**-126, -(2.0**-127))]
    for k, (x, y) in enumerate(special):
        a[k], b[k] = x, y
    rows = torch.zeros(1, 2, R_LAT + R_ROPE, dtype=torch.bfloat16)
    rows[0, 0, :R_LAT], rows[0, 1, :R_LAT] = a, b
    cache = LatentKVCache.from_tensor(rows, model_dtype=torch.bfloat16)
    meta = _meta([1], [1], [[0]], 2)
    q = torch.zeros(1, 1, R_LAT, dtype=torch.bfloat16)
    qr = torch.zeros(1, 1, R_ROPE, dtype=torch.bfloat16)
    out, _ = fused.forward_mqa(q, qr, cache, meta, scale=SCALE)
    want = ((a.float() + b.float()) * 0.5).to(torch.bfloat16)
    assert want[0] == 1.0 and want[1] == 1.0 + 2 * ulp and torch.isinf(want[3:5]).all()  # the cases are what they say
    assert torch.equal(out[0, 0].view(torch.int16), want.view(torch.int16))
    rows[0, 1, 3] = float("nan")
    out, _ = fused.forward_mqa(q, qr, LatentKVCache.from_tensor(rows, model_dtype=torch.bfloat16), meta,
                               scale=SCALE)
    assert bool(torch.isnan(out).all())


def _gemm_min_rows() -> int:
    """The kernel's GEMM_MIN_ROWS, read from its source: an item of at least this many rows takes the
    transposed-query (GEMM-form) scores, a shorter one the dot form."""
    found = re.search(r"GEMM_MIN_ROWS = (\d+);", fused_build.SOURCE.read_text())
    assert found, "GEMM_MIN_ROWS is no longer in the kernel's source"
    return int(found.group(1))


@pytest.mark.parametrize("heads", [1, 16, 40])
@pytest.mark.parametrize("model_dtype,kv,tol", [
    (torch.float32, "auto", 2e-6), (torch.float32, "bfloat16", 2e-6), (torch.bfloat16, "fp8_e4m3", 3e-2)])
def test_both_score_forms_around_the_gemm_threshold(fused, threads, heads, model_dtype, kv, tol):
    """Items just below, at and above GEMM_MIN_ROWS rows, one thread (one item per request), so each request
    runs in the form its length picks: 1 head (one lane in a padded vector), 16 (two lane vectors per block),
    40 (two blocks of two and one vector alone); 32-bit rows read in place, 16-bit and fp8 rows (scale 0.37)
    widened a block at a time; 3 tokens at the causal edge."""
    threads(1)
    n = _gemm_min_rows()
    contexts, query_lens = [n - 2, n - 1, n + 1, 2 * n + 37], [1, 1, 3, 2]
    step = fused_plan.plan_work(query_lens, contexts, heads, 1)
    spans = (step.items[:, 4] - step.items[:, 3]).tolist()
    assert min(spans) < n <= max(spans)  # both forms run
    sc = Scenario(query_lens, contexts, heads=heads, block_size=16, model_dtype=model_dtype, kv_cache_dtype=kv,
                  scale=0.37 if kv.startswith("fp8") else 1.0, seed=41 + heads)
    sc.check(tol_v=tol, tol_latent=tol, tol_lse=max(tol, 2e-6) * 2, backend=fused)


def test_long_context_many_splits_and_threads(fused, threads, monkeypatch):
    """Thousands of rows cut into many KV splits on more threads than cores, merged by their LSE: a split
    that dropped or repeated rows would change the softmax weights and fail the comparison."""
    monkeypatch.setattr(fused_plan, "MIN_SPLIT_ROWS", 7)
    monkeypatch.setattr(fused_plan, "SPLITS_PER_THREAD", 16)
    threads(3)
    sc = Scenario([1, 2, 1], [3001, 700, 64], heads=16, block_size=16, seed=3)
    step = fused_plan.plan_work(sc.meta.query_lens_list, sc.meta.context_lens_list, 16, 3)
    assert step.num_slots > 20 and step.merges.shape[0] >= 2  # the run really splits
    sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)


def test_ragged_mixed_batch_in_scrambled_order(fused):
    """Decodes and multi-token requests interleaved in the caller's order, one request with no new token."""
    sc = Scenario([3, 1, 0, 7, 1, 2, 1], [20, 65, 9, 0, 1, 33, 130], heads=16, block_size=16, seed=5, pad_with=0)
    sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)


def _meta(query_lens, context_lens, table, block_size):
    from mla_backends.step.metadata import BatchMetadata

    return BatchMetadata.build(query_lens, context_lens, table, block_size)


def _owned_slots(sc):
    """Flat slots every request of ``sc`` owns (its visible positions)."""
    owned = set()
    for b, (q, c) in enumerate(zip(sc.query_lens, sc.context_lens, strict=True)):
        for p in range(q + c):
            owned.add(int(sc.block_table[b, p // sc.block_size]) * sc.block_size + p % sc.block_size)
    return owned


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_nan_in_every_slot_no_request_owns(fused, kv):
    """Slots past a request's length in its last page, spare pages, and the page a spare block-table entry
    names all hold NaN: the kernel never loads them (a NaN reaching any sum would poison the output)."""
    sc = Scenario([1, 3, 1], [14, 30, 47], heads=16, block_size=16, seed=17, spare_blocks=3, pad_with=-1,
                  kv_cache_dtype=kv, scale=0.5 if kv != "auto" else 1.0)
    spare = sorted(set(range(sc.cache.num_blocks)) - set(sc.block_table[sc.block_table >= 0].tolist()))
    sc.block_table[:, -1] = spare[0]  # the spare column: a real page, full of NaN
    sc.meta = _meta(sc.query_lens, sc.context_lens, sc.block_table, sc.block_size)
    flat = sc.cache.data.view(-1, sc.cache.row_width)
    owned = torch.zeros(flat.shape[0], dtype=torch.bool)
    owned[sorted(_owned_slots(sc))] = True
    nan = torch.full((int((~owned).sum()), sc.cache.row_width), float("nan")).to(flat.dtype)
    if flat.element_size() == 1:  # fp8: move the bytes (no fp8 index_put on the CPU)
        flat, nan = flat.view(torch.uint8), nan.view(torch.uint8)
    flat[~owned] = nan
    assert int(torch.isnan(sc.cache.data.float()).any(dim=-1).sum()) == int((~owned).sum())
    out, lse = sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("layout", ["spaced_blocks", "padded_rows", "permuted"])
def test_strided_cache_layouts(fused, layout):
    """Caches wrapped by ``LatentKVCache.from_tensor`` with block and slot strides other than the packed ones
    (vLLM's spaced layer-interleaved blocks, padded rows, a [slot, block] buffer viewed back): the kernel
    takes the strides, no copy."""
    sc = Scenario([1, 2], [37, 16], heads=16, block_size=16, seed=23)
    data = sc.cache.data
    nb, bs, w = data.shape
    if layout == "spaced_blocks":
        view = torch.full((nb, bs + 5, w), float("nan"))[:, :bs]
    elif layout == "padded_rows":
        view = torch.full((nb, bs, w + 48), float("nan"))[..., :w]
    else:
        view = torch.full((bs, nb, w), float("nan")).transpose(0, 1)
    view.copy_(data)
    assert not view.is_contiguous()
    sc.cache = LatentKVCache.from_tensor(view, model_dtype=torch.float32)
    sc.check(tol_v=2e-6, tol_latent=2e-6, tol_lse=2e-6, backend=fused)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_strided_queries_and_outputs(fused, model_dtype):
    """Queries as views of one fused buffer and out / lse_out as strided views (the last one with a
    non-unit element stride): written in place, equal to a contiguous call."""
    sc = Scenario([1, 2, 1], [9, 40, 3], heads=16, block_size=16, model_dtype=model_dtype, seed=29)
    meta = sc.meta
    q = torch.randn(meta.num_tokens, 16, R_LAT + R_ROPE).to(model_dtype)
    ql, qr = q[..., :R_LAT], q[..., R_LAT:]
    want, want_lse = fused.forward_mqa(ql.contiguous(), qr.contiguous(), sc.cache, meta, scale=SCALE)
    for out in (torch.empty(meta.num_tokens, 16, R_LAT + 40, dtype=model_dtype)[..., :R_LAT],
                torch.empty(16, meta.num_tokens, R_LAT, dtype=model_dtype).transpose(0, 1),
                torch.empty(meta.num_tokens, 16, R_LAT, 2, dtype=model_dtype)[..., 1]):
        lse = torch.empty(16, meta.num_tokens).t()
        o, lo = fused.forward_mqa(ql, qr, sc.cache, meta, scale=SCALE, out=out, lse_out=lse)
        assert o is out and lo is lse
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_prepared_state_serves_the_layer_and_a_thread_change_stays_correct(fused, threads):
    """A configured instance plans once per step (prepare: an immutable FusedStep for its heads and threads);
    the call uses it, and stays correct when the thread count changed after planning."""
    from mla_backends.backends.capabilities import AttentionSpec

    sc = Scenario([1, 1], [500, 300], heads=16, block_size=16, seed=31)
    from mla_backends import configure_backend

    backend = configure_backend(CpuFusedBackend, AttentionSpec(num_heads=16, dtype=torch.float32, block_size=16),
                                SCALE)
    threads(2)
    plan = plan_step(sc.meta, [backend])
    state = plan.state(backend, sc.meta)
    assert isinstance(state, fused_plan.FusedStep) and state.heads == 16
    with pytest.raises(AttributeError):
        state.items = None  # frozen
    threads(1)
    q = torch.randn(2, 16, R_LAT)
    qr = torch.randn(2, 16, R_ROPE)
    out, lse = backend.forward_mqa(q, qr, sc.cache, sc.meta, scale=SCALE, plan=plan)
    ref_out, ref_lse = CpuFusedBackend().forward_mqa(q, qr, sc.cache, sc.meta, scale=SCALE)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)


# ---- the work list --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads_n", [1, 2, 8])
def test_plan_covers_every_lane_and_row_once(threads_n, monkeypatch):
    monkeypatch.setattr(fused_plan, "MIN_SPLIT_ROWS", 16)
    qlens, ctxs, heads = [1, 3, 0, 1, 5], [4000, 70, 9, 0, 1200], 40
    step = fused_plan.plan_work(qlens, ctxs, heads, threads_n)
    seen = {}
    for req, lane0, lanes, row0, row1, _slot in step.items.tolist():
        tok0, n, ctx, b = step.requests[req].tolist()
        assert qlens[b] == n and ctxs[b] == ctx
        for lane in range(lane0, lane0 + lanes):
            seen.setdefault((b, lane), []).append((row0, row1))
    for b, (n, ctx) in enumerate(zip(qlens, ctxs, strict=True)):
        for lane in range(n * heads):
            spans = sorted(seen.pop((b, lane)))
            # consecutive, from row 0 to the group's last token's position (at least this lane's own)
            assert spans[0][0] == 0 and all(a[1] == c[0] for a, c in zip(spans, spans[1:], strict=False))
            assert ctx + lane // heads + 1 <= spans[-1][1] <= ctx + n
    assert not seen
    slots = sorted(s for *_, s in step.items.tolist() if s >= 0)
    assert slots == list(range(step.num_slots))
    assert (int(step.merges[:, 4].sum()) if step.merges.numel() else 0) == step.num_slots
    if threads_n == 1:
        assert step.num_slots == 0 and step.threads == 1


def test_a_small_step_runs_on_one_thread_and_a_long_request_is_split():
    small = fused_plan.plan_work([1] * 8, [15] * 8, 16, 2)
    assert small.threads == 1 and small.num_slots == 0
    long = fused_plan.plan_work([1], [32767], 16, 2)
    assert long.threads == 2 and long.num_slots == fused_plan.SPLITS_PER_THREAD * 2
    assert fused_plan.plan_work([1], [32767], 128, 2).items.shape[0] > 2


# ---- the build cache ---------------------------------------------------------------------------------------
def _fake_compiler(tmp_path, *, fail=False):
    """A stand-in for ``c++``: logs each run, waits a little, writes the output file (or fails)."""
    log = tmp_path / "calls.log"
    script = tmp_path / "fake-cxx"
    script.write_text(
        f"#!{sys.executable}\nimport sys, time\n"
        f"open({str(log)!r}, 'a').write('run\\n')\n"
        "time.sleep(0.3)\n"
        + ("sys.stderr.write('error: no such intrinsic\\n'); sys.exit(1)\n" if fail else
           "out = sys.argv[sys.argv.index('-o') + 1]\nopen(out, 'wb').write(b'x' * 4096)\n"))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def test_concurrent_builds_compile_once_into_one_complete_file(tmp_path, monkeypatch):
    script, log = _fake_compiler(tmp_path)
    monkeypatch.setenv(fused_build.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(fused_build.CXX_ENV, str(script))
    paths, errors = [], []

    def one():
        try:
            paths.append(fused_build.build())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=one) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert log.read_text().count("run") == 1  # the others waited on the lock and found the file
    lib = paths[0]
    assert lib.read_bytes() == b"x" * 4096
    assert [p.name for p in lib.parent.iterdir() if p.name.startswith(".building")] == []
    record = json.loads(lib.with_name("build.json").read_text())
    assert record["key"] == fused_build.build_key() and record["compiler"] == str(script)


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    script, _ = _fake_compiler(tmp_path, fail=True)
    monkeypatch.setenv(fused_build.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(fused_build.CXX_ENV, str(script))
    with pytest.raises(fused_build.BuildError, match="no such intrinsic"):
        fused_build.build()
    assert not fused_build.is_built()
    assert list(fused_build.library_path().parent.iterdir()) == [fused_build.library_path().parent / "build.lock"]


def test_the_cache_key_follows_cpu_torch_and_source(monkeypatch):
    key = fused_build.build_key()
    for name, value in (("cpu_flags", lambda: ("sse2",)), ("_torch_facts", lambda: ("9.9.9", True)),
                        ("_source_digest", lambda: "0" * 64)):
        monkeypatch.setattr(fused_build, name, value)
        fused_build._build_key.cache_clear()
        assert fused_build.build_key() != key, name
        monkeypatch.undo()
        fused_build._build_key.cache_clear()
    assert fused_build.build_key() == key
    monkeypatch.setenv(fused_build.ARCH_ENV, "another-cpu")  # another instruction set: another library
    assert fused_build.build_key() != key


# ---- selection ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_selection():
    from selector.select import clear_cache

    clear_cache()
    yield
    clear_cache()


def test_not_built_is_a_package_reason_and_the_reference_serves(tmp_path, monkeypatch, fresh_selection):
    from selector import select_backend

    monkeypatch.setenv(fused_build.CACHE_DIR_ENV, str(tmp_path / "empty"))
    sel = select_backend("deepseek-v3", dtype=torch.bfloat16, device="cpu")
    assert sel.backend.name == "REF_TORCH"
    fused_verdict = next(v for v in sel.verdicts if v.name == "CPU_FUSED")
    (reason,) = fused_verdict.reasons
    assert reason.kind == ReasonKind.PACKAGE and "mla-backends build" in str(reason)
    assert not (tmp_path / "empty").exists()  # selection never builds


def test_without_a_compiler_the_reason_names_one(tmp_path, monkeypatch, fresh_selection):
    from selector import select_backend

    monkeypatch.setenv(fused_build.CACHE_DIR_ENV, str(tmp_path / "empty"))
    monkeypatch.setenv(fused_build.CXX_ENV, str(tmp_path / "no-such-compiler"))
    sel = select_backend("deepseek-v3", dtype=torch.float32, device="cpu")
    assert sel.backend.name == "REF_TORCH"
    text = str(next(v for v in sel.verdicts if v.name == "CPU_FUSED").reasons[0])
    assert "C++ compiler" in text and "mla-backends build" in text


def test_built_it_leads_the_cpu_ladder_and_cpu_mla_names_it(fused, fresh_selection):
    from selector import select_backend

    sel = select_backend("deepseek-v3", dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3", device="cpu")
    assert sel.backend.name == "CPU_FUSED"
    forced = select_backend("deepseek-v3", dtype=torch.float32, device="cpu", backend="CPU_MLA")
    assert forced.backend is CpuFusedBackend and any("vLLM's name for CPU_FUSED" in n for n in forced.notes)
    # what it refuses goes to the reference: float64, sparse
    assert select_backend("deepseek-v3", dtype=torch.float64, device="cpu").backend.name == "REF_TORCH"
    assert select_backend("deepseek-v3", dtype=torch.float32, device="cpu", sparse=True).backend.name == "REF_TORCH"


def test_cuda_and_odd_dims_are_refused_by_declaration():
    from mla_backends.backends.capabilities import AttentionSpec
    from mla_backends.core.device import simulated_device

    on_gpu = CpuFusedBackend.not_supported_reasons(AttentionSpec(num_heads=16, device=simulated_device(9, 0)))
    assert [r.kind for r in on_gpu] == [ReasonKind.DEVICE]
    odd = CpuFusedBackend.not_supported_reasons(AttentionSpec(num_heads=16, kv_lora_rank=520, qk_rope_head_dim=64))
    assert ReasonKind.DIMS in [r.kind for r in odd]


def test_env_and_build_check_report_the_state(tmp_path, monkeypatch, capsys):
    from mla_backends.cli import main

    monkeypatch.setenv(fused_build.CACHE_DIR_ENV, str(tmp_path / "empty"))
    assert main(["build", "--check", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["built"] is False and rep["path"].startswith(str(tmp_path))
    assert main(["env", "--json"]) == 0
    cf = json.loads(capsys.readouterr().out)["cpu_fused"]
    assert cf["cpu_decode"] == "REF_TORCH" and "mla-backends build" in cf["reason"]
    assert os.environ[fused_build.CACHE_DIR_ENV] in cf["path"]


# ---- through the integrations ------------------------------------------------------------------------------
def test_patch_model_generates_the_same_tokens_on_cpu_fused(fused, fresh_selection):
    """transformers' ``generate()`` of a tiny DeepSeek-V3 whose latent dims the kernel takes (32 / 16), patched
    with the selector's choice (CPU_FUSED, built here): every step's logits within fp32 noise of the unpatched
    model's and the same greedy tokens."""
    transformers = pytest.importorskip("transformers")
    from hf_models import COMMON, YARN, compare_generations, generate_greedy, left_padded, randomise_parameters

    from mla_backends.integrations.transformers import patch_model

    cfg = transformers.DeepseekV3Config(**{**COMMON, "kv_lora_rank": 32, "qk_rope_head_dim": 16},
                                        num_hidden_layers=2, q_lora_rank=24, rope_interleave=True,
                                        rope_parameters=dict(YARN), n_routed_experts=4, num_experts_per_tok=2,
                                        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)
    cfg._attn_implementation = "eager"
    model = randomise_parameters(transformers.DeepseekV3ForCausalLM(cfg).float(), seed=4, std=0.3)
    ids, mask = left_padded([5, 11, 3])
    ref = generate_greedy(model, ids, mask, 12)
    patch_model(model, block_size=4)
    assert {layer.self_attn.mla.backend.name for layer in model.model.layers} == {"CPU_FUSED"}
    assert compare_generations(ref, generate_greedy(model, ids, mask, 12)) == 12
