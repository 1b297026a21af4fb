"""No backend reads what no request owns (issue 48, class 1).

Engines' kernel tests poison every cache slot outside the requests' lengths (FlashMLA's out-of-bounds probe,
FlashInfer's ``test_batch_mla_oob_kv_nan``, vLLM's ``test_mla_decode_cpu``), and unwritten fp8 bytes can hold
NaN patterns in serving too. Here every slot no request owns, and every page outside the requests' tables,
holds NaN, infinities or random bytes (fp8: its NaN byte patterns), and each path must give the answer of a
float64 reference written plainly below, which reads only the owned rows:

- REF_TORCH: the dense padded path (uniform and mixed query lengths, one group or several), the streamed
  long-context path (alone and beside padded runs), the sparse path;
- TRITON_MLA under the interpreter (dense and sparse);
- through a layer: decode, mixed and prefill-over-context steps, the V3.2 indexer, and the cache's gathers,
  whose results must not change at all when the unowned slots change.

Before the fix REF_TORCH gave NaN for the whole batch: hidden positions' zero weights met NaN rows in the value
product (``0 x NaN = NaN``).
"""

from __future__ import annotations

import pytest
import torch

from mla_backends.ref_torch import RefTorchBackend
from mla_backends.ref_torch import backend as ref_backend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

pytestmark = pytest.mark.usefixtures("one_thread")

r, R, H = 32, 16, 4
SCALE = 0.3
#: NaN / infinity bytes of the fp8 formats (e4m3fn: S.1111.111 is NaN and there is no infinity; e5m2: IEEE)
FP8_NAN = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7E}
FP8_INF = {torch.float8_e4m3fn: 0xFF, torch.float8_e5m2: 0x7C}

CACHES = [  # (query dtype, cache dtype, tolerance against float64)
    (torch.float64, "float64", 1e-10),
    (torch.float32, "float32", 2e-5),
    (torch.float16, "float16", 4e-3),
    (torch.bfloat16, "bfloat16", 3e-2),
    (torch.bfloat16, "fp8_e4m3", 3e-2),
    (torch.float16, "fp8_e5m2", 4e-3),
]
POISONS = ["nan", "inf", "bytes"]


def poison(cache: LatentKVCache, kind: str, gen: torch.Generator) -> None:
    """Fill every slot of ``cache`` with ``kind`` (before the owned rows are written over it)."""
    data = cache.data
    if data.element_size() == 1:
        raw = data.view(torch.uint8)
        if kind == "bytes":
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        else:
            raw.fill_((FP8_NAN if kind == "nan" else FP8_INF)[data.dtype])
        return
    if kind == "bytes":
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[data.element_size()]
        info = torch.iinfo(ints)
        data.view(ints).copy_(torch.randint(info.min, info.max, data.shape, generator=gen, dtype=ints))
    else:
        data.fill_(float("nan") if kind == "nan" else float("inf"))


def build(ctx, new, page, dtype, kv, kind, seed=0, num_blocks_extra=3):
    """A poisoned cache whose owned slots hold random rows, a scattered block table (-1 or ids of pages the
    request does not own past its last page), metadata and queries."""
    g = torch.Generator().manual_seed(seed)
    seqs = [c + n for c, n in zip(ctx, new, strict=True)]
    pages = [-(-s // page) for s in seqs]
    nb = sum(pages) + num_blocks_extra
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    width = max(pages) + 2
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used: used + n]
        used += n
        if b % 2:
            table[b, n:] = perm[-1]  # a page nobody owns
    cache = LatentKVCache(nb, page, r, R, kv_cache_dtype=kv, model_dtype=dtype,
                          scale=0.37 if kv.startswith("fp8") else 1.0)
    poison(cache, kind, g)
    for b, s in enumerate(seqs):
        pos = torch.arange(s)
        rows = torch.randn(s, r + R, generator=g, dtype=torch.float64).to(dtype)
        cache.write(rows[:, :r], rows[:, r:], table[b].long()[pos // page] * page + pos % page)
    meta = BatchMetadata.build(list(new), list(ctx), table, page, num_blocks=nb)
    T = meta.num_tokens
    q = torch.randn(T, H, r + R, generator=g, dtype=torch.float64).to(dtype)
    return cache, meta, q[..., :r].contiguous(), q[..., r:].contiguous()


def reference(cache, meta, q_latent, q_rope, topk=None):
    """float64 attention of every token over the rows it sees, read slot by slot from the owned positions only."""
    flat = cache.data.view(-1, r + R).to(torch.float64) * cache.scale_value
    q = torch.cat([q_latent, q_rope], -1).to(torch.float64)
    bt, P = meta.block_table.long(), meta.block_size
    outs, lses = [], []
    for t in range(meta.num_tokens):
        b, p = int(meta.token_request[t]), int(meta.token_positions[t])
        positions = torch.arange(p + 1) if topk is None else topk[t][topk[t] >= 0].long()
        rows = flat[bt[b, positions // P] * P + positions % P]
        s = SCALE * (q[t] @ rows.T)  # [H, visible]
        outs.append(torch.softmax(s, -1) @ rows[:, :r])
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


def check(backend, cache, meta, ql, qr, tol, topk=None):
    out, lse = backend.forward_mqa(ql, qr, cache, meta, scale=SCALE, topk_indices=topk)
    ref_out, ref_lse = reference(cache, meta, ql, qr, topk)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.to(torch.float64) - ref_out).abs().max().item()
    assert err <= tol * (1 + ref_out.abs().max().item()), err
    assert (lse.to(torch.float64) - ref_lse).abs().max().item() <= 1e-4, (lse.double() - ref_lse).abs().max()


# ---- REF_TORCH ---------------------------------------------------------------------------------------------
#: (label, context lengths, new tokens): ragged decodes whose lengths straddle pages, and mixed query lengths
DENSE = [
    ("decode", [0, 6, 7, 8, 20], [1, 1, 1, 1, 1]),
    ("mixed", [9, 0, 3, 17], [1, 4, 2, 3]),
]


@pytest.mark.parametrize("dtype, kv, tol", CACHES, ids=[f"{d}-{k}".replace("torch.", "") for d, k, _ in CACHES])
@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("label, ctx, new", DENSE, ids=[d[0] for d in DENSE])
def test_ref_torch_padded_groups_ignore_unowned_slots(dtype, kv, tol, kind, label, ctx, new):
    cache, meta, ql, qr = build(ctx, new, 8, dtype, kv, kind)
    check(RefTorchBackend(), cache, meta, ql, qr, tol)


@pytest.mark.parametrize("kind", POISONS)
def test_ref_torch_several_padded_groups_ignore_unowned_slots(kind, monkeypatch):
    monkeypatch.setattr(ref_backend, "GROUP_ELEMENT_BUDGET", 1)  # one request a group
    cache, meta, ql, qr = build([3, 12, 0, 30], [1, 2, 1, 1], 8, torch.float32, "float32", kind)
    check(RefTorchBackend(), cache, meta, ql, qr, 2e-5)


@pytest.mark.parametrize("dtype, kv, tol", CACHES, ids=[f"{d}-{k}".replace("torch.", "") for d, k, _ in CACHES])
@pytest.mark.parametrize("kind", POISONS)
def test_ref_torch_streamed_path_ignores_unowned_slots(dtype, kv, tol, kind, monkeypatch):
    """Long requests streamed in page chunks (two folds), beside a short padded one; requests with fewer pages
    re-read their last page, whose tail is poisoned."""
    monkeypatch.setattr(ref_backend, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(ref_backend, "STREAM_MIN_ROWS", 24)
    monkeypatch.setattr(ref_backend, "STREAM_CHUNK_BYTES", 3 * 8 * (r + R) * 8)  # 3 pages of 8 rows a request
    monkeypatch.setattr(ref_backend, "STREAM_FOLD_CHUNKS", 2)
    backend = RefTorchBackend()
    cache, meta, ql, qr = build([60, 3, 41, 37], [1, 1, 1, 1], 8, dtype, kv, kind)
    assert any(streamed for streamed, _, _ in backend.dense_parts(meta, (r + R) * 4))
    check(backend, cache, meta, ql, qr, tol)


@pytest.mark.parametrize("dtype, kv, tol", CACHES[1:5],
                         ids=[f"{d}-{k}".replace("torch.", "") for d, k, _ in CACHES[1:5]])
def test_ref_torch_sparse_path_ignores_unowned_slots(dtype, kv, tol):
    cache, meta, ql, qr = build([5, 20, 13], [1, 2, 1], 8, dtype, kv, "nan")
    g = torch.Generator().manual_seed(1)
    rows = []
    for t in range(meta.num_tokens):
        window = int(meta.token_positions[t]) + 1
        chosen = torch.randperm(window, generator=g)[: min(6, window)]
        rows.append(torch.cat([chosen, torch.full((8 - chosen.numel(),), -1)]).to(torch.int32))
    topk = torch.stack(rows)
    check(RefTorchBackend(), cache, meta, ql, qr, tol, topk)


def test_the_fix_costs_no_host_sync_and_keeps_the_plan_once_per_step():
    """The rows past each sequence come from the step's plan (host lengths), so a planned call still makes no
    device read."""
    from mla_backends.core.host_sync import no_host_sync
    from mla_backends.step.plan import plan_step

    cache, meta, ql, qr = build([0, 6, 7, 8, 20], [1, 1, 1, 1, 1], 8, torch.float32, "float32", "nan")
    backend = RefTorchBackend()
    plan = plan_step(meta, [backend])
    with no_host_sync():
        out, _ = backend.forward_mqa(ql, qr, cache, meta, scale=SCALE, plan=plan)
    assert torch.isfinite(out).all()


# ---- TRITON_MLA under the interpreter ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype, kv, tol", [(torch.float32, "float32", 2e-5), (torch.float16, "fp8_e4m3", 4e-3)])
def test_triton_mla_ignores_unowned_slots(dtype, kv, tol):
    pytest.importorskip("triton")
    from mla_backends.triton_mla import TritonMLABackend

    cache, meta, ql, qr = build([0, 7, 19], [1, 2, 1], 8, dtype, kv, "nan")
    check(TritonMLABackend(), cache, meta, ql, qr, tol)


# ---- through a layer: decode, mixed and prefill steps, V3.2's indexer, the cache's gathers ------------------
def _layer_outputs(fill: str, sparse: bool) -> list[torch.Tensor]:
    """A small float32 layer (REF_TORCH) run over prefill, decode and mixed steps (``layer_cases.SCHEDULE``) on
    a cache whose every slot first holds ``fill`` (``"nan"``: NaN, fp8 and byte stores 0xFF; ``"zero"``); every
    step's output."""
    from layer_cases import SCHEDULE, scattered_block_tables, tiny_config

    from mla_backends import MLAAttention
    from mla_backends.step.plan import plan_step
    from mla_backends.testing import randomise_parameters

    if sparse:
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "DeepseekV32Config"):
            pytest.skip("this transformers has no DeepseekV32Config")
        cfg = transformers.DeepseekV32Config(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=4, index_head_dim=128,
            index_topk=6, num_hidden_layers=1, max_position_embeddings=256, vocab_size=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        cfg = tiny_config()
    layer = MLAAttention.from_hf_config(cfg, dtype=torch.float32)
    layer.load_hf_state_dict(randomise_parameters(layer, std=0.2).state_dict())
    lengths = [sum(s[b] for s in SCHEDULE) for b in range(3)]
    table, nb = scattered_block_tables(3, max(lengths), 4)
    cache = layer.allocate_cache(nb, 4)
    stores = [cache.data] + ([cache.indexer_cache.data] if sparse else [])
    for data in stores:
        if data.element_size() == 1:
            data.view(torch.uint8).fill_(0xFF if fill == "nan" else 0)
        else:
            data.fill_(float("nan") if fill == "nan" else 0.0)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, cfg.hidden_size, generator=g) for n in lengths]
    done, outs = [0, 0, 0], []
    for qlens in SCHEDULE:
        meta = BatchMetadata.build(qlens, list(done), table, 4, num_blocks=nb)
        hidden = torch.cat([xs[b][done[b]: done[b] + q] for b, q in enumerate(qlens)])
        positions = torch.cat([torch.arange(done[b], done[b] + q) for b, q in enumerate(qlens)])
        outs.append(layer(hidden, positions, cache, plan_step(meta, [layer])))
        done = [d + q for d, q in zip(done, qlens, strict=True)]
    return outs


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "v3.2-sparse"])
def test_layer_steps_do_not_depend_on_unowned_slots(sparse):
    """Prefill (cached context included), decode and mixed steps, and V3.2's indexer and sparse attention, give
    bitwise the same outputs whether the slots no request owns hold NaN or zeros."""
    poisoned, clean = _layer_outputs("nan", sparse), _layer_outputs("zero", sparse)
    for step, (a, b) in enumerate(zip(poisoned, clean, strict=True)):
        assert torch.isfinite(a).all(), f"step {step}: NaN from unowned slots"
        assert torch.equal(a, b), f"step {step}: the output depends on unowned slots"


def test_cache_gathers_read_only_owned_positions():
    cache, meta, _, _ = build([5, 11], [1, 1], 8, torch.float32, "float32", "nan")
    for b, s in enumerate(meta.seq_lens_list):
        rows = cache.gather(meta.block_table[b], s)
        assert rows.shape == (s, r + R) and torch.isfinite(rows).all()
    assert bool(cache.data.isnan().any())  # the poison is really there
