"""The shared expanded (MHA) prefill path of MLA: :func:`forward_mha`.

Every backend shares it; backends only supply the absorbed ``forward_mqa``. For each prefill request:

1. the new tokens' latents are up-projected with ``kv_b_proj`` to per-head ``k_nope`` (``qk_nope_head_dim``)
   and ``v`` (``v_head_dim``); the shared roped ``k_pe`` completes the 192-wide key of every head;
2. the new tokens attend to each other causally;
3. the cached context (positions ``0 .. context_len - 1``) is read from the paged cache (fp8 dequantised) in
   chunks of at most ``workspace_rows`` rows, across requests (a request's context may span chunks), each
   chunk up-projected into a reused workspace and attended without a mask;
4. the partial results are merged by their log-sum-exp; an empty part has LSE ``-inf`` and weight 0.

Scores are ``q_nope . k_nope + q_pe . k_pe``, the 192-wide dot product. Softmax and accumulation run in float32
(float64 for float64 inputs). The attention itself is :func:`prefill_attention`: on the CPU in
float32/bf16/fp16 it runs torch's blocked flash-attention kernel, which also returns the LSE (queries in blocks,
keys in chunks, the rope key broadcast and the value padded to one head size); on CUDA torch's flash or
memory-efficient SDPA kernel (:mod:`mla_backends.layer.prefill_kernels` chooses, by device, capability, dtype and head
widths, and says why); everywhere else, and in float64, plain matmuls with bounded memory that never
materialise the broadcast rope key, so the path runs on any device torch supports.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.attention_math import merge_attention_states, softmax_with_lse
from ..core.dtypes import accumulate_dtype
from ..core.validation import require_int, require_no_alias, require_on_device, require_scale, require_tensor
from ..step.cache import LatentKVCache, position_slots
from ..step.checks import require_step_lengths
from ..step.metadata import BatchMetadata
from .prefill_kernels import (
    KernelChoice,
    PrefillKernel,
    blocked_attention,
    choose_prefill_kernel,
    cuda_fused_attention,
    fused_prefill_kernel,
)
from .workspace import MAX_WORKSPACE_ROWS, PrefillWorkspace, workspace_widths

#: ``(chunk [(request, start, stop), ...], dtype) -> rows [n, R + P]``: a chunk's cached context rows
ContextRows = Callable[[list[tuple[int, int, int]], torch.dtype], torch.Tensor]

__all__ = [
    "ContextRows",
    "forward_mha",
    "prefill_attention",
    "merge_attention_states",
    "context_chunks",
    "fused_prefill_kernel",
    "fused_applies",
    "prefill_kernel_for",
    "softmax_with_lse",
]

#: most score elements one :func:`prefill_attention` call materialises at once (64 MiB in float32)
SCORE_BUDGET = 1 << 24
#: most bytes the fused CPU kernel spends on one materialised float32 pair: the ``[keys, heads, 192]`` key and
#: padded value of a key chunk, or a query block and its output; longer ranges are split and merged by LSE
FUSED_KV_BYTES = 256 << 20


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    causal: bool,
    budget: int = SCORE_BUDGET,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded attention of ``n`` queries over ``m`` keys of the same heads (the prefill kernel).

    Args:
        q_nope ``[n, H, N]``, q_pe ``[n, H, P]``: queries (may be strided views).
        k_nope ``[m, H, N]``, v ``[m, H, V]``: per-head keys/values; k_pe ``[m, P]``: the rope key all heads
            share.
        causal: query ``i`` sees keys ``0 .. i + (m - n)`` (new tokens of one request attending each other).
        budget: most score elements the plain path holds at once; queries are processed in slices.
        fused: None (default) runs the fused kernel :func:`prefill_kernel_for` picks (torch's flash kernel
            on the CPU; flash or memory-efficient SDPA on CUDA), the plain path where none applies; True
            insists on a fused kernel (ValueError saying why none can run); False forces the plain path.

    Returns:
        ``(o [n, H, V], lse [n, H])`` in float32 (float64 for float64 inputs).
    """
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: got {type(fused).__name__}; supported None, True or False")
    require_scale("scale", scale)
    if fused is False:
        return _plain_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal, budget)
    choice = prefill_kernel_for(q_nope, q_pe, v, k_nope.shape[0], causal)
    if fused and not choice.fused:
        raise ValueError(f"fused: got True; the fused prefill kernel cannot run here: {choice.reason}")
    if not choice.fused:
        return _plain_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal, budget)
    if choice.kernel == PrefillKernel.CPU_FLASH:
        return _fused_attention(q_nope, q_pe, k_nope, k_pe, v, scale, causal)
    return cuda_fused_attention(choice.kernel, q_nope, q_pe, k_nope, k_pe, v, scale, causal)


def prefill_kernel_for(q_nope: torch.Tensor, q_pe: torch.Tensor, v: torch.Tensor, m: int,
                       causal: bool) -> KernelChoice:
    """The kernel :func:`prefill_attention` runs for queries ``q_nope [n, H, N]`` / ``q_pe [n, H, P]`` over
    ``m`` keys with values ``v [m, H, V]``, and why
    (:func:`~mla_backends.layer.prefill_kernels.choose_prefill_kernel` on their device and dtype)."""
    return choose_prefill_kernel(q_nope.device, q_nope.dtype, head_dim_qk=q_nope.shape[-1] + q_pe.shape[-1],
                                 head_dim_v=v.shape[-1], n=q_nope.shape[0], m=m, causal=causal)


def _fused_block_rows(heads: int, width: int) -> int:
    """Queries per block and keys per chunk of the fused kernel: ``FUSED_KV_BYTES`` over a float32
    ``[rows, heads, width]`` pair (keys and values; padded queries and their output)."""
    return max(1, FUSED_KV_BYTES // (2 * heads * width * 4))


def fused_applies(q: torch.Tensor, n: int, m: int, causal: bool, *, head_dim_qk: int = 192,
                  head_dim_v: int = 128) -> str:
    """Why no fused kernel can run ``n`` queries ``q`` (its device and dtype) over ``m`` keys (empty string:
    one can; :func:`prefill_kernel_for` says which)."""
    choice = choose_prefill_kernel(q.device, q.dtype, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, n=n, m=m,
                                   causal=causal)
    return "" if choice.fused else choice.reason


def _fused_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                     v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU flash attention, float32, on ``[1, H, rows, D]`` views: the 64-wide rope key
    broadcast over the heads and the value zero-padded to the key width (the kernel wants one head size).

    Memory stays within ``FUSED_KV_BYTES`` per materialised pair: queries go in blocks, keys in chunks, and
    the parts are merged by LSE. Causal (queries are the keys, ``n == m``): a query block attends the keys
    before it without a mask and its own diagonal block with the kernel's (top-left) causal mask.
    """
    kernel = fused_prefill_kernel()
    assert kernel is not None
    n = q_nope.shape[0]
    m, H, N = k_nope.shape
    P, V = k_pe.shape[1], v.shape[2]
    D = max(N + P, V)
    f32 = torch.float32
    pad = torch.nn.functional.pad
    block = _fused_block_rows(H, D)

    def keys(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([k_nope[k0:k1].to(f32), k_pe[k0:k1, None, :].to(f32).expand(k1 - k0, H, P)], dim=-1)
        vv = pad(v[k0:k1].to(f32), (0, D - V))
        return pad(k, (0, D - N - P)).transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)

    def queries(i0: int, i1: int) -> torch.Tensor:
        q = pad(torch.cat([q_nope[i0:i1].to(f32), q_pe[i0:i1].to(f32)], dim=-1), (0, D - N - P))
        return q.transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]

    def attend(q: torch.Tensor, k0: int, k1: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = kernel(q, *keys(k0, k1), 0.0, masked, scale=scale)
        return o[0, :, :, :V].transpose(0, 1), lse[0].transpose(0, 1)  # [rows, H, V], [rows, H]

    return blocked_attention(n, m, block, causal, heads=H, v_dim=V, device=q_nope.device, queries=queries,
                             attend=attend)


def _plain_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                     v: torch.Tensor, scale: float, causal: bool, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Matmuls, mask, softmax, matmul, in slices of queries that hold at most ``budget`` scores."""
    n, H, _ = q_nope.shape
    m = k_nope.shape[0]
    acc = accumulate_dtype(q_nope.dtype)
    kn = k_nope.to(acc).permute(1, 2, 0)  # [H, N, m]
    kp = k_pe.to(acc).t()  # [P, m]
    vv = v.to(acc).transpose(0, 1)  # [H, m, V]
    o = torch.empty(n, H, v.shape[-1], dtype=acc, device=q_nope.device)
    lse = torch.empty(n, H, dtype=acc, device=q_nope.device)
    step = max(1, budget // max(1, H * m))
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        qn = q_nope[i0:i1].to(acc).transpose(0, 1)  # [H, c, N]
        s = torch.bmm(qn, kn)  # [H, c, m]
        s += torch.matmul(q_pe[i0:i1].to(acc), kp).transpose(0, 1)  # [H, c, m]
        s *= scale
        if causal:
            rows = torch.arange(i0, i1, device=s.device)[:, None] + (m - n)
            hidden = torch.arange(m, device=s.device)[None, :] > rows  # [c, m]
            s.masked_fill_(hidden[None], float("-inf"))
        o_c, part_lse = softmax_with_lse(s, vv)  # [H, c, V], [H, c]
        o[i0:i1] = o_c.transpose(0, 1)
        lse[i0:i1] = part_lse.t()
    return o, lse


def context_chunks(context_lens: tuple[int, ...] | list[int],
                   workspace_rows: int) -> list[list[tuple[int, int, int]]]:
    """Pack every request's cached positions into chunks of at most ``workspace_rows`` rows.

    Returns a list of chunks, each a list of ``(request, start, stop)`` position ranges; requests are taken in
    order and split across chunks when they do not fit.
    """
    require_int("workspace_rows", workspace_rows, minimum=1)
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = workspace_rows
    for b, ctx in enumerate(context_lens):
        start = 0
        while start < ctx:
            take = min(room, ctx - start)
            cur.append((b, start, start + take))
            start += take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur, room = [], workspace_rows
    if cur:
        chunks.append(cur)
    return chunks


def forward_mha(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: LatentKVCache,
    meta: BatchMetadata,
    kv_b_weight: torch.Tensor,
    *,
    scale: float,
    workspace_rows: int | None = None,
    workspace: PrefillWorkspace | None = None,
    out: torch.Tensor | None = None,
    fused: bool | None = None,
    context_rows: ContextRows | None = None,
) -> torch.Tensor:
    """Expanded attention for the requests of ``meta`` (new tokens causal + chunked cached context).

    Args:
        q: ``[T, H, qk_nope + qk_rope]`` queries (rope slice already rotated), processing order.
        kv_c: ``[T, kv_lora_rank]`` the new tokens' normalised latents.
        k_pe: ``[T, qk_rope]`` their roped keys.
        cache: holds every request's cached context (positions ``0 .. context_len - 1``).
        meta: the batch these tokens form (its requests are all run expanded here).
        kv_b_weight: ``[H * (qk_nope + v_head_dim), kv_lora_rank]``, head-major rows (``kv_b_proj.weight``).
        scale: the unabsorbed softmax scale.
        workspace_rows: chunk size; defaults to ``workspace.rows``, else 65536.
        workspace: reused buffers (a fresh one is made when absent).
        out: optional ``[T, H, v_head_dim]`` output in ``q``'s dtype.
        fused: passed to :func:`prefill_attention` (None: torch's fused CPU kernel wherever it applies).
        context_rows: where a chunk's cached rows come from: called with the chunk (a list of ``(request,
            start, stop)`` position ranges, as :func:`context_chunks` makes them) and the dtype, it returns
            ``[rows, R + P]`` in that order. None reads them from ``cache`` through ``meta.block_table``; decode
            context parallelism (``meta.dcp_size > 1``) needs one (:func:`mla_backends.layer.dcp.context_rows`).

    Returns:
        ``[T, H, v_head_dim]`` in ``q``'s dtype.
    """
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache: got {type(cache).__name__}; supported LatentKVCache")
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"meta: got {type(meta).__name__}; supported BatchMetadata")
    require_scale("scale", scale, what="a positive finite float (the unabsorbed softmax scale)")
    R, P = cache.kv_lora_rank, cache.qk_rope_head_dim
    T = meta.num_tokens
    require_tensor("q", q, shape=(T, None, None), dtypes=(torch.bfloat16, torch.float16, torch.float32,
                                                         torch.float64))
    T, H, D = q.shape
    N = D - P
    if N <= 0:
        raise ValueError(f"q: got width {D}; supported qk_nope_head_dim + {P} (the cache's rope width)")
    require_tensor("kv_c", kv_c, shape=(T, R), dtypes=(q.dtype,))
    require_tensor("k_pe", k_pe, shape=(T, P), dtypes=(q.dtype,))
    require_tensor("kv_b_weight", kv_b_weight, shape=(None, R), dtypes=(q.dtype,))
    if kv_b_weight.shape[0] % H or kv_b_weight.shape[0] // H <= N:
        raise ValueError(f"kv_b_weight: got {kv_b_weight.shape[0]} rows; supported heads ({H}) * "
                         f"(qk_nope {N} + v_head_dim)")
    V = kv_b_weight.shape[0] // H - N
    if meta.block_size != cache.block_size:
        raise ValueError(f"meta.block_size: got {meta.block_size}; supported the cache's {cache.block_size}")
    require_on_device(cache.device, q=q, kv_c=kv_c, k_pe=k_pe, kv_b_weight=kv_b_weight)
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: got {type(fused).__name__}; supported None, True or False")
    require_step_lengths(meta, "forward_mha")
    if context_rows is None and meta.dcp_size > 1:
        raise ValueError(f"context_rows: got None for metadata of DCP rank {meta.dcp_rank} of {meta.dcp_size}; "
                         "supported the group's reader (mla_backends.layer.dcp.context_rows), as the cache holds only "
                         "this rank's rows")
    if workspace is None:
        workspace = PrefillWorkspace(workspace_rows if workspace_rows is not None else MAX_WORKSPACE_ROWS)
    elif workspace_rows is not None and workspace_rows != workspace.rows:
        raise ValueError(f"workspace_rows: got {workspace_rows}; supported the workspace's {workspace.rows}")
    if out is None:
        out = torch.empty(T, H, V, dtype=q.dtype, device=q.device)
    else:
        require_tensor("out", out, shape=(T, H, V), dtypes=(q.dtype,))
        require_no_alias("out", out, cache=cache.data, q=q, kv_c=kv_c, k_pe=k_pe, kv_b_weight=kv_b_weight)
    if T == 0:
        return out

    q_nope, q_pe = q[..., :N], q[..., N:]
    w_t = kv_b_weight.t()  # [R, H * (N + V)]
    new_kv = torch.matmul(kv_c, w_t).view(T, H, N + V)
    starts = meta.query_starts_list

    # 1) new tokens among themselves, causally: this initialises every request's running (o, lse)
    acc_o: list[torch.Tensor | None] = []
    acc_lse: list[torch.Tensor | None] = []
    for b, n in enumerate(meta.query_lens_list):
        if n == 0:
            acc_o.append(None)
            acc_lse.append(None)
            continue
        s0, s1 = starts[b], starts[b + 1]
        o_b, lse_b = prefill_attention(q_nope[s0:s1], q_pe[s0:s1], new_kv[s0:s1, :, :N], k_pe[s0:s1],
                                       new_kv[s0:s1, :, N:], scale, causal=True, fused=fused)
        acc_o.append(o_b)
        acc_lse.append(lse_b)

    # 2) cached context in workspace-sized chunks, merged by LSE
    ctx = [c if n else 0 for c, n in zip(meta.context_lens_list, meta.query_lens_list, strict=True)]
    chunks = context_chunks(ctx, workspace.rows) if any(ctx) else []
    if chunks:
        biggest = max(sum(z - a for _, a, z in chunk) for chunk in chunks)
        latent_buf, kv_buf = workspace.buffers(*workspace_widths(R, P, H, N, V), q.dtype, q.device, rows=biggest)
        bt = meta.block_table.long()
        bs = cache.block_size
        flat = cache.flat_rows()  # None for a wrapped engine tensor whose blocks are not packed back to back
        direct = flat is not None and flat.dtype == q.dtype  # no dequantisation: gather into the workspace
        for chunk in chunks:
            rows = sum(z - a for _, a, z in chunk)
            if context_rows is not None:  # e.g. DCP: this rank's rows all-gathered across the group
                latent = context_rows(chunk, q.dtype)
            else:
                pos = torch.cat([torch.arange(a, z, device=q.device) for _, a, z in chunk])
                req = torch.cat([torch.full((z - a,), b, dtype=torch.long, device=q.device) for b, a, z in chunk])
                slots = position_slots(bt, req, pos, bs)
                if direct:
                    torch.index_select(flat, 0, slots, out=latent_buf[:rows])
                    latent = latent_buf[:rows]
                else:
                    latent = cache.read_slots(slots, q.dtype)
            kv = torch.matmul(latent[:, :R], w_t, out=kv_buf[:rows]).view(rows, H, N + V)
            k_pe_ctx = latent[:, R:]
            off = 0
            for b, a, z in chunk:
                seg = slice(off, off + (z - a))
                off += z - a
                s0, s1 = starts[b], starts[b + 1]
                o_c, lse_c = prefill_attention(q_nope[s0:s1], q_pe[s0:s1], kv[seg, :, :N], k_pe_ctx[seg],
                                               kv[seg, :, N:], scale, causal=False, fused=fused)
                prev_o, prev_lse = acc_o[b], acc_lse[b]
                assert prev_o is not None and prev_lse is not None
                acc_o[b], acc_lse[b] = merge_attention_states(prev_o, prev_lse, o_c, lse_c)

    for b, o_b in enumerate(acc_o):
        if o_b is not None:
            out[starts[b]: starts[b + 1]] = o_b.to(out.dtype)
    return out
