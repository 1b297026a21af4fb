"""A DeepSeek-V4 step as vLLM's V4 layer sees it (its SWA pool and compressed pool, their metadata, the indexer's
picks, the sinks), built on stand-in metadata or on vLLM's own metadata classes, and its float64 reference.

The pools hold 512-wide rows: fp8 records (vLLM's ``fp8_ds_mla``; written by the library's writer, which the record
tests pin to vLLM's) or bf16 rows; the window pool has pages of ``SWA_PAGE`` tokens, the compressed pool logical
pages of ``LOGICAL`` tokens (``LOGICAL // ratio`` entries a page), each with its own scattered table. Requests in
vLLM's order: decodes first.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mla_backends.testing.v4_cases import scattered_table

SWA_PAGE, LOGICAL, WINDOW, H = 4, 16, 5, 4
QUERY, CONTEXT = [1, 1, 5], [13, 20, 6]  # two decodes, then an extend


def _store(n_pages: int, rows_a_page: int, records: bool) -> torch.Tensor:
    from mla_backends.step.records import V4_RECORD

    if records:
        return torch.zeros(n_pages, V4_RECORD.page_bytes(rows_a_page), dtype=torch.uint8)
    return torch.zeros(n_pages, rows_a_page, 512, dtype=torch.bfloat16)


def _write(pool: torch.Tensor, rows_a_page: int, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Write ``rows`` at ``slots`` of an engine tensor through the library's wrapper; the values as stored."""
    from mla_backends.integrations.vllm.v4_backend import wrap_v4_cache

    cache = wrap_v4_cache(pool, rows_a_page)
    cache.write(rows, rows[:, :0], slots)
    return cache.read_slots(slots, torch.float64)


def v4_vllm_step(ratio: int, records: bool, seed: int = 0, *, metadata_classes=None):
    """``(inputs, reference)``. ``inputs``: ``q [T, H + 1, 512]`` bf16 (one padded head), ``swa_metadata``,
    ``swa_cache``, ``compressed_metadata``, ``compressed_cache``, ``topk [T, 6]`` (CSA's picks, repeats and -1),
    ``sinks [H]`` float32. ``metadata_classes``: ``(DeepseekSparseSWAMetadata, DeepseekV4FlashMLAMetadata)`` to
    build vLLM's own objects (else stand-ins with the same fields). ``reference``: ``[T, H, 512]`` float64."""
    g = torch.Generator().manual_seed(seed)
    seq = [q + c for q, c in zip(QUERY, CONTEXT, strict=True)]
    T = sum(QUERY)
    swa_table, n_swa = scattered_table(seq, SWA_PAGE, g)
    swa_cache = _store(n_swa, SWA_PAGE, records)
    rows = {}
    for b, s in enumerate(seq):
        r = torch.randn(s, 512, generator=g).to(torch.bfloat16)
        slots = torch.tensor([int(swa_table[b, p // SWA_PAGE]) * SWA_PAGE + p % SWA_PAGE for p in range(s)])
        rows[b] = _write(swa_cache, SWA_PAGE, r, slots)
    per_page = LOGICAL // max(ratio, 1)
    entries = [s // ratio for s in seq] if ratio > 1 else [0] * len(seq)
    c_table, n_c = scattered_table([max(1, e) * max(ratio, 1) for e in entries], LOGICAL, g)
    c_cache = _store(n_c, per_page, records) if ratio > 1 else None
    crows = {}
    for b, e in enumerate(entries):
        if ratio > 1 and e:
            r = torch.randn(e, 512, generator=g).to(torch.bfloat16)
            slots = torch.tensor([int(c_table[b, w // per_page]) * per_page + w % per_page for w in range(e)])
            crows[b] = _write(c_cache, per_page, r, slots)
    positions = torch.tensor([c + j for q, c in zip(QUERY, CONTEXT, strict=True) for j in range(q)])
    req = torch.tensor([b for b, q in enumerate(QUERY) for _ in range(q)])
    topk = torch.full((T, 6), -1, dtype=torch.int64)
    for t in range(T):
        vis = (int(positions[t]) + 1) // ratio if ratio > 1 else 0
        if vis:
            pick = torch.randint(0, vis, (4,), generator=g)
            topk[t, :4] = pick
            topk[t, 4] = pick[0]  # a repeat (attended once)
    q = torch.randn(T, H + 1, 512, generator=g).to(torch.bfloat16)
    sinks = torch.randn(H, generator=g)
    starts = torch.tensor([0, *torch.tensor(QUERY).cumsum(0).tolist()], dtype=torch.int32)
    swa_fields = dict(block_table=swa_table, slot_mapping=torch.zeros(T, dtype=torch.int64), block_size=SWA_PAGE,
                      seq_lens=torch.tensor(seq, dtype=torch.int32), query_start_loc=starts,
                      query_start_loc_cpu=starts, token_to_req_indices=req)
    c_fields = dict(num_reqs=len(seq), max_query_len=max(QUERY), max_seq_len=max(seq), num_actual_tokens=T,
                    query_start_loc=starts, slot_mapping=torch.zeros(T, dtype=torch.int64), block_table=c_table,
                    req_id_per_token=req.to(torch.int32), block_size=LOGICAL, topk_tokens=6)
    if metadata_classes is None:
        swa_md, c_md = SimpleNamespace(**swa_fields), SimpleNamespace(**c_fields)
    else:
        swa_md, c_md = metadata_classes[0](**swa_fields), metadata_classes[1](**c_fields)
    ref = torch.zeros(T, H, 512, dtype=torch.float64)
    qd = q.double()
    for t in range(T):
        b, p = int(req[t]), int(positions[t])
        keys = [rows[b][j] for j in range(max(0, p - WINDOW + 1), p + 1)]
        vis = (p + 1) // ratio if ratio > 1 else 0
        chosen = sorted({int(e) for e in topk[t] if e >= 0}) if ratio == 4 else list(range(vis))
        keys += [crows[b][e] for e in chosen]
        k = torch.stack(keys)
        for h in range(H):
            s = k @ qd[t, h] * 512 ** -0.5
            z = torch.logsumexp(torch.cat([s, sinks[h:h + 1].double()]), 0)
            ref[t, h] = torch.exp(s - z) @ k
    inputs = dict(q=q, swa_metadata=swa_md, swa_cache=swa_cache, compressed_metadata=c_md if ratio > 1 else None,
                  compressed_cache=c_cache, topk_indices=topk, sinks=sinks)
    return inputs, ref
