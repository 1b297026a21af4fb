"""The SGLang adapter (``MLABackendsAttnBackend``) on a model runner made here, without an engine: tiny dims, SGLang's
own ``RadixAttention`` and ``ForwardMode``, a pool buffer in SGLang's layout ``[slots + page, 1, R + P]``.

- decode: the new rows land at SGLang's slots with ``LatentKVCache.write``'s bytes (fp8: the layer's scale), and
  the output is the float64 reference's;
- the expanded path (SGLang's MHA prepare hook, then the ``attn_mha`` call): ``forward_mha`` over the cached
  prefix read from the pool and the new tokens, against a float64 expanded reference;
- NaN in every pool slot no request of the step owns changes nothing (issue 48 item 7);
- start-up refusals: a missing SGLang internal, per-channel or half-set fp8 scales, a softmax scale that differs,
  speculative decoding; the per-batch state belongs to the very ``ForwardBatch`` it was made for.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from engine_harness import nan_backends
from sglang_env import HAVE_SGLANG, SKIP_REASON

if not HAVE_SGLANG:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

from mla_backends import LatentKVCache  # noqa: E402
from mla_backends.integrations.sglang.backend import MLABackendsAttnBackend  # noqa: E402
from mla_backends.integrations.sglang.selection import SGLangSelectionError  # noqa: E402
from mla_backends.layer.dispatch import PerRequestPolicy  # noqa: E402
from mla_backends.ref_torch import RefTorchBackend  # noqa: E402

H, R, P, N, V = 2, 16, 8, 8, 8  # heads, latent, rope, nope, value widths
SCALE = (N + P) ** -0.5
HF = dict(num_attention_heads=H, hidden_size=32, kv_lora_rank=R, qk_nope_head_dim=N, qk_rope_head_dim=P,
          v_head_dim=V, q_lora_rank=None, num_hidden_layers=1)
SLOTS = 64
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class _KvB(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None


class _MLA(torch.nn.Module):
    """What the adapter reads of SGLang's DeepseekV2AttentionMLA."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.attn_mqa = RadixAttention(H, R + P, SCALE, num_kv_heads=1, layer_id=0, v_head_dim=R)
        self.attn_mha = RadixAttention(H, N + P, SCALE, num_kv_heads=H, layer_id=0, v_head_dim=V)
        self.kv_b_proj = _KvB(0.3 * torch.randn(H * (N + V), R, generator=g))
        self.rotary_emb = None
        self.qk_nope_head_dim, self.num_local_heads = N, H


class _Pool:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.buffer


@dataclass
class _Batch:
    """The ForwardBatch fields the adapter reads."""

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens_cpu: list | None = None
    extend_seq_lens_cpu: list | None = None


def _runner(page: int, kv: str = "auto", scale: float | None = None, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    mla = _MLA(g)
    if scale is not None:  # what SGLang's KV-cache quantisation method leaves on the layer
        mla.attn_mqa.k_scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)
        mla.attn_mqa.k_scale_float = scale
    values = torch.randn(SLOTS + page, 1, R + P, generator=g)
    buf = (values / (scale or 1.0)).to(FP8[kv]) if kv in FP8 else values
    model = torch.nn.Module()
    model.layer = mla
    return SimpleNamespace(
        device="cpu", dtype=torch.float32, page_size=page, model=model,
        model_config=SimpleNamespace(hf_text_config=PretrainedConfig(**HF), model_path="tiny", context_len=256),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 48, dtype=torch.int32)),
        token_to_kv_pool=_Pool(buf), kv_cache_dtype_str=kv, spec_algorithm=SpeculativeAlgorithm.from_string(None))


def _backend(runner: SimpleNamespace, backend=None) -> MLABackendsAttnBackend:  # type: ignore[no-untyped-def]
    b = MLABackendsAttnBackend(runner)
    if backend is not None:
        b.mla_backend = backend
    return b


def _place(runner: SimpleNamespace, lens: list[int], page: int, seed: int = 1) -> list[list[int]]:
    """Give request ``b`` the slots of ``lens[b]`` positions in ``req_to_token`` row ``b`` (whole pages, in a
    shuffled page order, slot 0's page never used: SGLang pads with it), and return them."""
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(SLOTS // page - 1, generator=g) + 1).tolist()
    out = []
    for b, n in enumerate(lens):
        mine = [pages.pop() for _ in range(-(-n // page))]
        slots = [mine[j // page] * page + j % page for j in range(n)]
        runner.req_to_token_pool.req_to_token[b, :n] = torch.tensor(slots)
        out.append(slots)
    return out


def _rows(runner: SimpleNamespace, scale: float) -> torch.Tensor:
    """Every pool slot's row as values, float64 ``[slots, R + P]``."""
    buf = runner.token_to_kv_pool.buffer
    return buf.double()[:, 0] * (scale if buf.dtype in FP8.values() else 1.0)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of ``q [H, D]`` over ``keys [n, D]`` (shared by the heads) -> ``[H, Dv]``."""
    return torch.softmax(q.double() @ keys.double().t() * SCALE, dim=-1) @ values.double()


def _decode(runner: SimpleNamespace, lens: list[int], page: int, backend=None, poison: bool = False):  # type: ignore[no-untyped-def]
    """One decode step of ``len(lens)`` requests (``lens``: tokens including the new one) through the adapter:
    ``(out [B, H, R], the slots of each request, the new rows [B, R + P])``."""
    b_ = _backend(runner, backend)
    slots = _place(runner, lens, page)
    g = torch.Generator().manual_seed(2)
    B = len(lens)
    q = torch.randn(B, H, R + P, generator=g)
    k = torch.randn(B, 1, R + P, generator=g)
    if poison:  # NaN in every slot no request owns (the new tokens' slots are written by the step)
        owned = torch.tensor([s for ss in slots for s in ss])
        buf = runner.token_to_kv_pool.buffer
        keep = buf[owned].clone()
        if buf.element_size() == 1:
            buf.view(torch.uint8).fill_(0xFF)  # a NaN pattern of both fp8 formats
        else:
            buf.fill_(float("nan"))
        buf[owned] = keep
    fb = _Batch(ForwardMode.DECODE, torch.arange(B), torch.tensor(lens), torch.tensor(lens),
                torch.tensor([s[-1] for s in slots]))
    b_.init_forward_metadata(fb)
    out = b_.forward_decode(q, k, k[..., :R], runner.model.layer.attn_mqa, fb)
    return out.view(B, H, R), q, slots, k[:, 0]


@pytest.mark.parametrize("page", [1, 4])
def test_decode_writes_sglang_slots_and_matches_the_reference(page: int) -> None:
    runner = _runner(page)
    lens = [6, 13, 1]
    out, q, slots, new = _decode(runner, lens, page)
    rows = _rows(runner, 1.0)
    for b, s in enumerate(slots):
        assert torch.equal(rows[s[-1]].float(), new[b])  # the new row, at SGLang's slot
        ref = _attend(q[b], rows[s], rows[s][:, :R])
        torch.testing.assert_close(out[b].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv", sorted(FP8))
def test_fp8_rows_are_written_and_read_with_the_layers_scale(kv: str) -> None:
    """An fp8 pool with the layer's ``k_scale`` 0.37: the new rows are exactly ``LatentKVCache.write``'s bytes at
    that scale, and decode reads every row as ``stored * 0.37``."""
    page, scale = 4, 0.37
    runner = _runner(page, kv, scale)
    lens = [6, 9]
    out, q, slots, new = _decode(runner, lens, page)
    want = LatentKVCache(SLOTS // page + 1, page, R, P, kv_cache_dtype=kv, model_dtype=torch.float32, scale=scale)
    want.write(new[:, :R], new[:, R:], torch.tensor([s[-1] for s in slots]))
    buf = runner.token_to_kv_pool.buffer
    for s in slots:
        assert torch.equal(buf[s[-1], 0].view(torch.uint8), want.data.view(-1, R + P)[s[-1]].view(torch.uint8))
    rows = _rows(runner, scale)
    for b, s in enumerate(slots):
        torch.testing.assert_close(out[b].double(), _attend(q[b], rows[s], rows[s][:, :R]), atol=2e-5, rtol=2e-5)


def test_fp8_scales_the_library_cannot_honour_refuse_start_up() -> None:
    runner = _runner(1, "fp8_e4m3", 0.5)
    radix = runner.model.layer.attn_mqa
    radix.k_scale = torch.nn.Parameter(torch.tensor([0.5, 0.25]), requires_grad=False)
    with pytest.raises(SGLangSelectionError, match=r"MLA layer 0 has k_scale of shape \[2\]; supported one per-tensor"):
        _backend(runner)
    radix.k_scale, radix.k_scale_float = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False), None
    with pytest.raises(SGLangSelectionError, match="k_scale_float None; supported a loaded scale with its host copy"):
        _backend(runner)
    radix.k_scale_float = 0.0
    with pytest.raises(SGLangSelectionError, match="MLA layer 0 has k_scale_float = 0.0; supported a positive"):
        _backend(runner)
    radix.k_scale = radix.k_scale_float = None  # no quantisation method: SGLang's plain cast, scale 1.0
    assert _backend(runner).mla_layers[0].scale == 1.0


def test_start_up_refusals_name_what_they_refuse() -> None:
    runner = _runner(1)
    del runner.model.layer.attn_mqa.k_scale_float
    with pytest.raises(SGLangSelectionError, match=r"SGLang internal radix\.k_scale_float is missing on MLA layer "
                                                   r"_MLA 0 \(attn_mqa\)"):
        _backend(runner)
    runner = _runner(1)
    runner.model.layer.attn_mha.scaling = SCALE * 1.1
    with pytest.raises(SGLangSelectionError, match="SGLang's softmax scale .* differs from the model config's"):
        _backend(runner)
    runner = _runner(1)
    runner.spec_algorithm = SpeculativeAlgorithm.from_string("NEXTN")
    with pytest.raises(SGLangSelectionError, match="speculative_algorithm: got EAGLE; supported none"):
        _backend(runner)
    runner = _runner(1)
    del runner.kv_cache_dtype_str
    with pytest.raises(SGLangSelectionError, match=r"internal runner\.kv_cache_dtype_str is missing"):
        _backend(runner)


def test_per_batch_state_belongs_to_its_forward_batch() -> None:
    runner = _runner(1)
    b_ = _backend(runner)
    slots = _place(runner, [3], 1)
    fb = _Batch(ForwardMode.DECODE, torch.arange(1), torch.tensor([3]), torch.tensor([3]), torch.tensor([slots[0][-1]]))
    b_.init_forward_metadata(fb)
    assert b_.batch_absorbed(fb)
    other = _Batch(**vars(fb))
    with pytest.raises(RuntimeError, match="ran before init_forward_metadata for its batch"):
        b_.batch_absorbed(other)
    del fb
    gc.collect()
    again = _Batch(**vars(other))  # may reuse the dead batch's address: the state is still not its
    with pytest.raises(RuntimeError, match="ran before init_forward_metadata for its batch"):
        b_.batch_absorbed(again)


def _expanded(runner: SimpleNamespace, prefix: list[int], ext: list[int], page: int, poison: bool = False):  # type: ignore[no-untyped-def]
    """An extend batch the adapter runs expanded: SGLang's MHA prepare hook, then the ``attn_mha`` call."""
    b_ = _backend(runner)
    b_.mla_policy = PerRequestPolicy(threshold=1)  # absorb single tokens only
    slots = _place(runner, [p + e for p, e in zip(prefix, ext, strict=True)], page)
    if poison:
        owned = torch.tensor([s for ss in slots for s in ss])
        keep = runner.token_to_kv_pool.buffer[owned].clone()
        runner.token_to_kv_pool.buffer.fill_(float("nan"))
        runner.token_to_kv_pool.buffer[owned] = keep
    T = sum(ext)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, N + P, generator=g)
    kv_a, k_pe = torch.randn(T, R, generator=g), torch.randn(T, 1, P, generator=g)
    new_slots = torch.tensor([s for ss, p in zip(slots, prefix, strict=True) for s in ss[p:]])
    fb = _Batch(ForwardMode.EXTEND, torch.arange(len(ext)), torch.tensor([p + e for p, e in zip(prefix, ext,
                                                                                                 strict=True)]),
                torch.tensor([p + e for p, e in zip(prefix, ext, strict=True)]), new_slots, prefix, ext)
    b_.init_forward_metadata(fb)
    assert not b_.batch_absorbed(fb)
    mla = runner.model.layer
    q_in, k_in, v_in = b_.prepare_prefill_qkv(q=q.clone(), q_pe=q[..., N:], kv_a=kv_a, k_pe=k_pe,
                                               positions=torch.zeros(T, dtype=torch.long), layer=mla,
                                               forward_batch=fb)
    assert k_in is None and v_in is None
    out = b_.forward_extend(q_in, None, None, mla.attn_mha, fb).view(T, H, V)
    rows = _rows(runner, 1.0)
    w = mla.kv_b_proj.weight.double().view(H, N + V, R)
    refs, t = [], 0
    for b, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        lat = rows[slots[b]]  # prefix rows from the pool, new rows as the hook wrote them
        assert torch.equal(lat[p:].float(), torch.cat([kv_a[t:t + e], k_pe[t:t + e, 0]], -1))
        kv = torch.einsum("hdr,nr->nhd", w, lat[:, :R])  # [n, H, N + V]
        for i in range(e):
            qi = q[t + i].double()
            keys = torch.cat([kv[: p + i + 1, :, :N], lat[: p + i + 1, None, R:].expand(-1, H, -1)], -1)
            s = torch.einsum("hd,nhd->hn", qi, keys) * SCALE
            refs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), kv[: p + i + 1, :, N:]))
        t += e
    return out, torch.stack(refs)


@pytest.mark.parametrize("page", [1, 4])
def test_the_expanded_path_runs_forward_mha_over_the_cached_prefix(page: int) -> None:
    out, ref = _expanded(_runner(page), [5, 0, 9], [3, 4, 1], page)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


NAN_BACKENDS = nan_backends()  # every CPU backend


@pytest.mark.parametrize("name", NAN_BACKENDS)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_nan_outside_the_steps_slots_changes_no_decode(name: str, kv: str) -> None:
    from mla_backends.triton_mla import TritonMLABackend

    page = 4
    lens = [6, 13, 1]
    scale = 0.5 if kv != "auto" else None
    backend = RefTorchBackend() if name == "REF_TORCH" else TritonMLABackend()
    clean = _decode(_runner(page, kv, scale), lens, page, backend)[0]
    poisoned = _decode(_runner(page, kv, scale), lens, page, backend, poison=True)[0]
    assert not poisoned.isnan().any()
    torch.testing.assert_close(poisoned, clean, atol=1e-5, rtol=1e-5)


def test_nan_outside_the_steps_slots_changes_no_expanded_prefill() -> None:
    out, ref = _expanded(_runner(4), [5, 0, 9], [3, 4, 1], 4, poison=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
