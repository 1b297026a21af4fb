"""DeepSeek-V4 ``forward_mqa`` inputs for the tests and their float64 reference, written out plainly: four
requests (a decode, a prefill, an extend, a short one) over scattered pages with NaN in every slot no request
owns, a compressed cache of entries with picks (some repeated, ``-1`` padded) and per-head sinks."""

from __future__ import annotations

import torch

from mla_backends import BatchMetadata, LatentKVCache

W, H, BS, CBS = 32, 4, 4, 2  # row width, heads, token page, entries a compressed page
QUERY, CONTEXT = [1, 5, 3, 2], [9, 0, 20, 6]
ENTRIES = [3, 1, 6, 0]  # compressed entries each request holds


def v4_setup(dtype=torch.float64, seed=0, poison=True):
    """``(meta, cache, compressed cache, its table (processing order), picks [T, 4], q [T, H, W] float64, sinks [H]
    float64, rows, compressed rows)``; the rows (float64, per caller request) are what the caches hold."""
    g = torch.Generator().manual_seed(seed)
    B = len(QUERY)
    seq = [q + c for q, c in zip(QUERY, CONTEXT, strict=True)]
    pages = [-(-s // BS) for s in seq]
    nb = sum(pages) + 3
    perm = torch.randperm(nb, generator=g)  # scattered pages
    table = torch.full((B, max(pages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[k:k + n]
        k += n
    meta = BatchMetadata.build(QUERY, CONTEXT, table, BS, num_blocks=nb)
    cache = LatentKVCache(nb, BS, W, 0, model_dtype=dtype)
    cache.data.fill_(float("nan") if poison else 0.0)  # every slot no request owns stays NaN
    rows = {}
    for b in range(B):  # in the caller's order, then mapped to the processing order below
        r = torch.randn(seq[b], W, generator=g, dtype=torch.float64)
        rows[b] = r
        for p in range(seq[b]):
            cache.data[table[b, p // BS], p % BS] = r[p].to(dtype)
    cpages = [max(1, -(-e // CBS)) for e in ENTRIES]
    cnb = sum(cpages) + 2
    cperm = torch.randperm(cnb, generator=g)
    ctable = torch.full((B, max(cpages)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(cpages):
        ctable[b, :n] = cperm[k:k + n]
        k += n
    ccache = LatentKVCache(cnb, CBS, W, 0, model_dtype=dtype)
    ccache.data.fill_(float("nan"))
    crows = {}
    for b in range(B):
        r = torch.randn(ENTRIES[b], W, generator=g, dtype=torch.float64)
        crows[b] = r
        for e in range(ENTRIES[b]):
            ccache.data[ctable[b, e // CBS], e % CBS] = r[e].to(dtype)
    # per token (processing order) the selected entries: some, repeated, -1 padded
    picks = []
    for tok in range(meta.num_tokens):
        b = int(meta.order[int(meta.token_request[tok])])
        e = ENTRIES[b]
        sel = [int(v) for v in torch.randint(0, e, (3,), generator=g)] if e else []
        sel = (sel + [-1] * 4)[:4]
        picks.append(sel)
    indices = torch.tensor(picks, dtype=torch.long)
    ctable_proc = ctable[meta.order]
    q = torch.randn(meta.num_tokens, H, W, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return meta, cache, ccache, ctable_proc, indices, q, sinks, rows, crows


def v4_reference(meta, rows, crows, indices, q, sinks, window, scale):
    """Plainly: per token, the keys it sees and one softmax with the sink in the denominator (``q [T, H, W]``)."""
    T, H, W = q.shape
    out = torch.zeros(T, H, W, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        b = int(meta.order[int(meta.token_request[t])])
        p = int(meta.token_positions[t])
        lo = 0 if window is None else max(0, p - window + 1)
        keys = [rows[b][j] for j in range(lo, p + 1)]
        keys += [crows[b][e] for e in sorted({int(v) for v in indices[t] if v >= 0})]
        k = torch.stack(keys)
        for h in range(H):
            s = (k @ q[t, h]) * scale
            z = torch.logsumexp(torch.cat([s, sinks[h:h + 1]]), 0)
            out[t, h] = torch.exp(s - z) @ k
            lse[t, h] = z
    return out, lse
