"""Issue 37, part 4: ``LatentKVCache.from_tensor`` layouts.

Every layout the wrapper accepts (contiguous, spaced blocks, padded rows, spaced slots, blocks permuted with
slots, vLLM's layer-interleaved ``as_strided`` pages) must work on every path: dense decode, sparse decode,
``read_slots``, ``gather``, ``write`` (raw slots and step metadata) and the expanded prefill's context gather.
Layouts under which two slots share memory (an ``expand``, a zero stride, overlapping ``as_strided`` windows)
are refused at wrap time with a ValueError naming the strides. Values are checked against a float64 reference
computed from the logical ``[num_blocks, block_size, row]`` contents, and writes must leave the memory outside
the view untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mla_backends import cache as cache_module
from mla_backends.layer.prefill import forward_mha
from mla_backends.ref_torch import RefTorchBackend
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.metadata import BatchMetadata

R, P, BS, NB, H = 8, 4, 4, 6, 3
W = R + P
LENS = [5, 1, 11]  # decode requests: context + the one new token
TABLE = torch.tensor([[4, 1, -1], [0, -1, -1], [2, 5, 3]], dtype=torch.int32)


def _contiguous(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buf = base.clone()
    return buf, buf


def _spaced_blocks(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x[::2]
    buf = torch.full((2 * NB, BS, W), -7.0, dtype=base.dtype)
    buf[::2] = base
    return buf[::2], buf


def _padded_rows(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x[..., :W] of wider rows
    buf = torch.full((NB, BS, W + 5), -7.0, dtype=base.dtype)
    buf[..., :W] = base
    return buf[..., :W], buf


def _spaced_slots(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x[:, ::2]
    buf = torch.full((NB, 2 * BS, W), -7.0, dtype=base.dtype)
    buf[:, ::2] = base
    return buf[:, ::2], buf


def _permuted(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x.transpose(0, 1)
    buf = base.transpose(0, 1).contiguous()
    return buf.transpose(0, 1), buf


def _layer_interleaved(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1 of 3 in one buffer whose pages alternate by layer (vLLM's block-major layouts)."""
    raw = torch.full((3 * NB * BS * W,), -7.0, dtype=base.dtype)
    view = torch.as_strided(raw, (NB, BS, W), (3 * BS * W, W, 1), BS * W)
    view.copy_(base)
    return view, raw


LAYOUTS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "contiguous": _contiguous, "spaced_blocks": _spaced_blocks, "padded_rows": _padded_rows,
    "spaced_slots": _spaced_slots, "permuted": _permuted, "layer_interleaved": _layer_interleaved,
}


def _base(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(NB, BS, W, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _wrap(layout: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    base = _base(seed, dtype)
    view, buf = LAYOUTS[layout](base)
    assert torch.equal(view, base)
    cache = LatentKVCache.from_tensor(view, kv_lora_rank=R, model_dtype=torch.float32,
                                      scale=0.5 if dtype.itemsize == 1 else 1.0)
    assert cache.data.data_ptr() == view.data_ptr()  # no copy
    return cache, base, buf


def _queries(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LENS), H, R, generator=g), torch.randn(len(LENS), H, P, generator=g)


def _rows(base: torch.Tensor, b: int, positions: list[int]) -> torch.Tensor:
    return torch.stack([base[int(TABLE[b, p // BS]), p % BS] for p in positions]).double()


def _attend(q_latent, q_rope, base, positions_of, scale=0.3):
    """float64 (out [T, H, R], lse [T, H]): token t attends the rows ``positions_of(t)`` of its request."""
    outs, lses = [], []
    for t in range(len(LENS)):
        rows = _rows(base, t, positions_of(t))
        q = torch.cat([q_latent[t], q_rope[t]], dim=-1).double()
        s = q @ rows.T * scale
        outs.append(torch.softmax(s, dim=-1) @ rows[:, :R])
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.stack(outs), torch.stack(lses)


def _meta() -> BatchMetadata:
    return BatchMetadata.build([1] * len(LENS), [s - 1 for s in LENS], TABLE, BS, num_blocks=NB)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_decode_on_every_layout(layout: str) -> None:
    cache, base, _ = _wrap(layout)
    ql, qr = _queries()
    out, lse = RefTorchBackend().forward_mqa(ql, qr, cache, _meta(), scale=0.3)
    want, want_lse = _attend(ql, qr, base, lambda t: list(range(LENS[t])))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sparse_decode_on_every_layout(layout: str) -> None:
    cache, base, _ = _wrap(layout)
    ql, qr = _queries(2)
    topk = torch.tensor([[4, 0, 2, -1], [0, -1, -1, -1], [10, 3, 7, 5]])
    out, lse = RefTorchBackend().forward_mqa(ql, qr, cache, _meta(), scale=0.3, topk_indices=topk)
    want, want_lse = _attend(ql, qr, base, lambda t: [int(p) for p in topk[t] if p >= 0])
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_slots_and_gather_on_every_layout(layout: str, dtype: torch.dtype) -> None:
    cache, base, _ = _wrap(layout, dtype)
    scale = cache.scale_value
    slots = torch.tensor([[0, 23], [9, 14]])
    want = torch.stack([base.view(-1, W)[int(s)].double() * scale for s in slots.view(-1)]).view(2, 2, W)
    assert torch.equal(cache.read_slots(slots, torch.float64), want)
    got = cache.gather(TABLE[2], 11, torch.float64)
    assert torch.equal(got, _rows(base, 2, list(range(11))).double() * scale)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _outside(buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The elements of the contiguous buffer ``buf`` that ``view`` (a view into it) does not cover."""
    covered = torch.zeros(buf.numel(), dtype=torch.bool)
    covered.as_strided(view.shape, view.stride(), view.storage_offset() - buf.storage_offset()).fill_(True)
    return _bits(buf).reshape(-1)[~covered]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_on_every_layout_touches_only_its_slots(layout: str, dtype: torch.dtype) -> None:
    cache, base, buf = _wrap(layout, dtype)
    around = _outside(buf, cache.data).clone()
    new = torch.randn(5, W, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([3, -1, 17, 22, 4])
    cache.write(new[:, :R], new[:, R:], slots)  # raw slots: range-checked, -1 skipped
    meta = BatchMetadata.build([1, 1], [4, 2], torch.tensor([[1, 2], [5, -1]], dtype=torch.int32), BS,
                               num_blocks=NB)  # new tokens at positions 4 and 2: slots 2 * 4 + 0, 5 * 4 + 2
    step = torch.randn(2, W, generator=torch.Generator().manual_seed(4))
    cache.write(step[:, :R], step[:, R:], meta)  # the trusted metadata path
    want = base.clone()
    for row, s in [*zip(new, slots.tolist(), strict=True), (step[0], 8), (step[1], 22)]:
        if s >= 0:
            want.view(-1, W)[s] = (row / cache.scale_value).to(dtype)
    assert torch.equal(_bits(cache.data), _bits(want))
    assert torch.equal(_outside(buf, cache.data), around)  # other layers' pages, padding: as they were
    back = cache.read_slots(torch.tensor([3, 17, 8, 22]), torch.float64)
    assert torch.equal(back, want.view(-1, W)[[3, 17, 8, 22]].double() * cache.scale_value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_context_gather_on_every_layout(layout: str) -> None:
    """forward_mha reads the cached context in chunks: the same result on every layout as on a plain cache."""
    cache, base, _ = _wrap(layout)
    plain = LatentKVCache.from_tensor(base.clone(), kv_lora_rank=R, model_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    N, V = 6, 5
    meta = BatchMetadata.build([2, 3], [3, 6], TABLE[[0, 2]], BS, num_blocks=NB)
    q = torch.randn(5, H, N + P, generator=g)
    kv_c, k_pe = torch.randn(5, R, generator=g), torch.randn(5, P, generator=g)
    kv_b = torch.randn(H * (N + V), R, generator=g)
    got = forward_mha(q, kv_c, k_pe, cache, meta, kv_b, scale=0.2, workspace_rows=4)
    want = forward_mha(q, kv_c, k_pe, plain, meta, kv_b, scale=0.2, workspace_rows=4)
    assert torch.equal(got, want)
    # and against float64: token 0 of request 0 sees its 3 cached rows and itself
    rows = torch.cat([_rows(base, 0, [0, 1, 2]), torch.cat([kv_c[0], k_pe[0]]).double()[None]])
    w = kv_b.double().view(H, N + V, R)
    k = torch.einsum("hdr,sr->shd", w[:, :N], rows[:, :R])
    v = torch.einsum("hdr,sr->shd", w[:, N:], rows[:, :R])
    s = (torch.einsum("hd,shd->hs", q[0, :, :N].double(), k)
         + q[0, :, N:].double() @ rows[:, R:].T) * 0.2
    ref = torch.einsum("hs,shd->hd", torch.softmax(s, dim=-1), v)
    torch.testing.assert_close(got[0].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make,what", [
    (lambda b: b[:1].expand(NB, BS, W), "every block on one"),
    (lambda b: b[:, :1].expand(NB, BS, W), "every slot of a block on one"),
    (lambda b: torch.as_strided(b.reshape(-1), (NB, BS, W), (W, W, 1)), "block b slot o on row b + o"),
    (lambda b: torch.as_strided(b.reshape(-1), (NB, BS, W), (BS * W, W // 2, 1)), "slots half a row apart"),
    (lambda b: torch.as_strided(b.reshape(-1), (NB, 2, W), (W, 3 * W, 1)), "blocks inside a block's span"),
])
def test_overlapping_layouts_refused_up_front(make, what: str) -> None:
    view = make(_base())
    before = view.clone()
    with pytest.raises(ValueError) as info:
        LatentKVCache.from_tensor(view, kv_lora_rank=R, model_dtype=torch.float32)
    msg = str(info.value)
    assert f"strides {list(view.stride())}" in msg and "share memory" in msg, (what, msg)
    assert "supported rows contiguous" in msg and "no two slots overlap" in msg, msg
    assert torch.equal(view, before)


def test_rows_must_still_be_contiguous() -> None:
    view = torch.zeros(NB, W, BS).transpose(1, 2)
    with pytest.raises(ValueError, match=r"data: got strides \[.*\] for shape \[6, 4, 12\]; supported rows "
                                         r"contiguous"):
        LatentKVCache.from_tensor(view, kv_lora_rank=R)


@pytest.mark.parametrize("shape,strides,overlaps", [
    ((4, 3, 2), (6, 2, 1), False), ((4, 3, 2), (2, 8, 1), False), ((4, 3, 2), (100, 2, 1), False),
    ((4, 1, 2), (2, 0, 1), False), ((1, 3, 2), (0, 2, 1), False),  # a size-1 dimension's stride is free
    ((4, 3, 2), (0, 2, 1), True), ((4, 3, 2), (6, 1, 1), True), ((4, 3, 2), (4, 2, 1), True),
    ((4, 3, 2), (2, 2, 1), True), ((2, 2), (1, 1), True),
])
def test_overlap_rule(shape, strides, overlaps: bool) -> None:
    assert cache_module.overlapping_layout(shape, strides) is overlaps
    # agree with counting the distinct offsets
    import itertools

    offsets = [sum(i * s for i, s in zip(ix, strides, strict=True))
               for ix in itertools.product(*(range(n) for n in shape))]
    assert (len(set(offsets)) != len(offsets)) is overlaps


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("layout", ["spaced_blocks", "permuted", "layer_interleaved"])
def test_triton_reads_every_layout(layout: str, sparse: bool) -> None:
    """TRITON_MLA takes the cache's block and slot strides (the interpreter on a CPU)."""
    from mla_backends.triton_mla import TritonMLABackend

    cache, base, _ = _wrap(layout)
    ql, qr = _queries(6)
    topk = torch.tensor([[4, 0, 2, -1], [0, -1, -1, -1], [10, 3, 7, 5]]) if sparse else None
    out, lse = TritonMLABackend().forward_mqa(ql, qr, cache, _meta(), scale=0.3, topk_indices=topk)
    want, want_lse = _attend(ql, qr, base, (lambda t: [int(p) for p in topk[t] if p >= 0]) if sparse
                             else (lambda t: list(range(LENS[t]))))
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=2e-4)


def test_the_vllm_wrapper_is_rebuilt_for_a_new_layout_of_the_same_memory() -> None:
    """``wrap_cache`` reuses the previous wrapper only for the very same view: same address and shape but
    other strides (a buffer viewed another way) get a wrapper of their own, reading the right rows."""
    from mla_backends.integrations.vllm.step import wrap_cache

    buf = torch.randn(NB * BS * W)
    square = buf.view(NB, BS, W)
    first = wrap_cache(square, kv_lora_rank=R, model_dtype=torch.float32, scale=1.0)
    other = buf.view(BS, NB, W).transpose(0, 1)  # same address and shape, blocks permuted with slots
    again = wrap_cache(other, kv_lora_rank=R, model_dtype=torch.float32, scale=1.0, previous=first)
    assert again is not first and again.data.stride() == other.stride()
    assert torch.equal(again.read_slots(torch.tensor([BS + 1])), other[1, 1][None])
    assert wrap_cache(other, kv_lora_rank=R, model_dtype=torch.float32, scale=1.0, previous=again) is again
