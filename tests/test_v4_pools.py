"""Per-pool block tables for a DeepSeek-V4 step (``plan_v4_step``): every store of a layer paged by its own table
and page size, as engines keep them (vLLM: window pages of 64 tokens, compressed pages of 256 tokens' entries,
compressor states on small pages that are recycled), gives the same outputs as one shared table; the state stores
then hold a few pages a request instead of a row for every token slot."""

from __future__ import annotations

import pytest
import torch
from v4_models import small_v4_layers

from mla_backends import BatchMetadata, plan_step
from mla_backends.core.v4dims import CSA, HCA
from mla_backends.step.v4 import PoolTable, V4PoolTables, plan_v4_step
from mla_backends.testing import no_host_sync

# steps of two requests: a prefill, a mixed step (decode + extend), then decodes to 14 and 13 tokens
STEPS = (([9, 6], [0, 0]), ([1, 3], [9, 6])) + tuple(([1, 1], [10 + i, 9 + i]) for i in range(4))
MAX_LEN = 16
BS = 4  # the window's page (tokens)
# the other pools' pages: compressed entries (CSA ratio 4, HCA ratio 8), states and indexer rows
PAGES = {"compressed": {CSA: 2, HCA: 1}, "state": {CSA: 2, HCA: 4}, "indexer_keys": 3, "indexer_state": 2}
# state pages a request keeps, by page size: enough for what one step writes and reads (a step's new tokens and
# the tokens its new entries pool), fewer than its sequence needs: later positions reuse the pages of earlier ones
RING = {2: 5, 4: 3}


def _pool_table(page: int, gen: torch.Generator, *, ring: int | None = None) -> tuple[torch.Tensor, int]:
    """A scattered table for MAX_LEN rows a request (``ring``: only that many distinct pages a request, reused in
    turn, as a pool that recycles pages older than what a step reads). Returns ``(table [2, pages], pages)``."""
    logical = -(-MAX_LEN // page)
    own = logical if ring is None else min(ring, logical)
    ids = torch.randperm(2 * own + 3, generator=gen)[: 2 * own].view(2, own)
    cols = torch.arange(logical) % own
    return ids[:, cols].to(torch.int32), 2 * own + 3


def _setups(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    window, n_window = _pool_table(BS, g)
    tables, pages = {}, {}
    for kind, ratio in ((CSA, 4), (HCA, 8)):
        epp, sbs = PAGES["compressed"][kind], PAGES["state"][kind]
        ctab, cn = _pool_table(epp * ratio, g)  # entries a page: a page covers epp * ratio tokens
        stab, sn = _pool_table(sbs, g, ring=RING[sbs])
        tables[kind] = (PoolTable(ctab, epp, cn), PoolTable(stab, sbs, sn))
        pages[kind] = {"compressed": (cn, epp), "state": (sn, sbs)}
    ikeys, ikn = _pool_table(PAGES["indexer_keys"] * 4, g)
    istate, isn = _pool_table(PAGES["indexer_state"], g, ring=RING[PAGES["indexer_state"]])
    pages[CSA] |= {"indexer_keys": (ikn, PAGES["indexer_keys"]), "indexer_state": (isn, PAGES["indexer_state"])}
    pools = V4PoolTables(compressed={k: v[0] for k, v in tables.items()}, state={k: v[1] for k, v in tables.items()},
                         indexer_keys=PoolTable(ikeys, PAGES["indexer_keys"], ikn),
                         indexer_state=PoolTable(istate, PAGES["indexer_state"], isn))
    return window, n_window, pools, pages


def _run(layers, caches, window_table, n_window, tables, xs):
    outs = []
    for (q, c), x in zip(STEPS, xs, strict=True):
        meta = BatchMetadata.build(q, c, window_table, BS, num_blocks=n_window)
        plan = plan_step(meta, layers) if tables is None else plan_v4_step(meta, layers, tables)
        h = x
        for layer, cache in zip(layers, caches, strict=True):
            h = h + layer(h, None, cache, plan)
        outs.append(h)
    return outs


def test_per_pool_tables_give_the_shared_tables_outputs_with_small_recycled_state_pools():
    layers = small_v4_layers()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(sum(q), 32, generator=g, dtype=torch.float64) for q, _ in STEPS]
    window, n_window, pools, pages = _setups()
    shared = [layer.allocate_cache(n_window, BS) for layer in layers]
    want = _run(layers, shared, window, n_window, None, xs)
    own = [layer.allocate_cache(n_window, BS, pool_pages=pages.get(layer.kind)) for layer in layers]
    for cache in own:
        for store in cache.stores.values():
            store.data.fill_(float("nan"))  # every row no request owns is NaN (and stale ring rows before use)
    got = _run(layers, own, window, n_window, pools, xs)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    # the stores are paged as the tables say; the state pools hold RING pages a request, not a row per token slot
    csa = own[1]
    assert (csa.compressed.block_size, csa.state.block_size, csa.indexer_keys.block_size) == (2, 2, 3)
    assert csa.state.num_slots < shared[1].state.num_slots and csa.state.num_slots == pages[CSA]["state"][0] * 2
    # one planned state per step, made from the tables
    meta = BatchMetadata.build(*STEPS[0], window, BS, num_blocks=n_window)
    plan = plan_v4_step(meta, layers, pools)
    st = plan.state(layers[1].planner, meta)
    assert st.tables is pools and st.for_kind(CSA).entries_per_page == 2


def test_a_wrong_table_is_refused_before_anything_is_written():
    layers = small_v4_layers()
    window, n_window, pools, pages = _setups()
    meta = BatchMetadata.build(*STEPS[0], window, BS, num_blocks=n_window)
    x = torch.zeros(meta.num_tokens, 32, dtype=torch.float64)
    own = layers[1].allocate_cache(n_window, BS, pool_pages=pages[CSA])
    for store in own.stores.values():
        store.data.fill_(7.0)
    # a cache with its own state pages planned against the shared table: refused by the layer, nothing written
    with pytest.raises(ValueError, match=r"state\[.compressed_sparse_attention.\]: got a store of 2 rows a page"):
        layers[1](x, None, own, plan_step(meta, layers))
    assert all(bool((s.data == 7.0).all()) for s in own.stores.values())
    bad = V4PoolTables(state={CSA: PoolTable(torch.full((2, 6), -1, dtype=torch.int32), 2)})
    with pytest.raises(ValueError, match=r"state\[.compressed_sparse_attention.\].block_table: request 0 uses "
                                         r"block id -1"):
        plan_v4_step(meta, layers, bad)
    with pytest.raises(ValueError, match="block_table: got 1 rows; supported one per request"):
        plan_v4_step(meta, layers, V4PoolTables(compressed={HCA: PoolTable(window[:1], 1)}))
    with pytest.raises(ValueError, match="participants: got no DeepSeek-V4 layer"):
        plan_v4_step(meta, [], pools)
    with pytest.raises(TypeError, match="tables: got dict"):
        plan_v4_step(meta, layers, {})
    with pytest.raises(ValueError, match="compressed: got kinds"):
        V4PoolTables(compressed={"sliding_attention": PoolTable(window, 4)})
    with pytest.raises(ValueError, match="pool_pages: got store 'window'"):
        layers[1].allocate_cache(n_window, BS, pool_pages={"window": (4, 4)})


def test_a_step_with_per_pool_tables_reads_nothing_back_after_planning():
    layers = small_v4_layers()
    window, n_window, pools, pages = _setups()
    caches = [layer.allocate_cache(n_window, BS, pool_pages=pages.get(layer.kind)) for layer in layers]
    meta = BatchMetadata.build(*STEPS[0], window, BS, num_blocks=n_window)
    plan = plan_v4_step(meta, layers, pools)
    x = torch.randn(meta.num_tokens, 32, dtype=torch.float64)
    with no_host_sync():
        for layer, cache in zip(layers, caches, strict=True):
            x = x + layer(x, None, cache, plan)
    assert torch.isfinite(x).all()
