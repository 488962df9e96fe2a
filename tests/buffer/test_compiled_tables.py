"""The wave buffer's compiled table work (``buffer_lookup`` / ``buffer_update_batch`` in
kernels/csrc/buffer_cpu.cpp) against the numpy reference (ClusterMappingTable.lookup,
WaveBufferStore.update): lookups, tables, block pools and admission plans bit for bit."""

import re
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tests.buffer.test_layer_pool import _store
from tests.buffer.test_store import _ids, _stores
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.buffer.mapping import ClusterMappingTable
from vllm_retro.config import RetroConfig
from vllm_retro.kernels import cpu_ext

TABLE = ("page_start", "n_pages", "size", "cached", "last_access", "reads")
NO_FLOOR = dict(min_retrieval_clusters=0)
"""Caches sized by ``cache_fraction`` alone: these stores are small, and the retrieval
floor's minimum cache (:meth:`RetroConfig.cache_tokens`) would hold all of them."""


def _fraction_cfg(fraction: float) -> RetroConfig:
    return RetroConfig(page_size=4, cache_fraction=fraction, **NO_FLOOR)


def _state(buf) -> dict:
    """Copies of everything a cache update may change."""
    out = {f: getattr(buf.table, f).copy() for f in TABLE}
    out.update(capacity=buf.capacity.copy(), page_block=buf.host.page_block.copy(),
               free=np.array(buf.blocks.free_blocks), clock=buf.clock,
               stats=buf.stats.snapshot())
    return out


def _restore(buf, state: dict) -> None:
    for f in TABLE:
        getattr(buf.table, f)[...] = state[f]
    buf.host.page_block[...] = state["page_block"]
    n = state["free"].size
    buf.blocks.free_stack[:n] = state["free"]
    buf.blocks.n_free[0] = n
    buf.clock = state["clock"]


def _assert_same(before: dict, a: dict, b: dict, msg: str) -> None:
    """The states ``a`` and ``b`` two updates from ``before`` left are the same (the
    statistics by what each added: they are cumulative)."""
    for key in a:
        if key == "stats":
            for s in ("device_cache_admitted_pages", "device_cache_evicted_pages"):
                assert a[key][s] - before[key][s] == b[key][s] - a[key][s], f"{msg}: {s}"
        else:
            assert np.array_equal(a[key], b[key]), f"{msg}: {key}"


def _runs_by_definition(kind: np.ndarray, src: np.ndarray, row0: int, col0: int,
                        t_cap: int) -> np.ndarray:
    """The runs of per-token places, token by token: a token extends the run before it iff
    it is the next slot of the same head, from the same pool, at the next source row."""
    runs: list[list[int]] = []
    last = None  # (head, slot, kind, src) of the token before
    for h in range(kind.shape[0]):
        for t in range(kind.shape[1]):
            k, s = int(kind[h, t]), int(src[h, t])
            if k == 0:
                continue
            if last == (h, t - 1, k, s - 1):
                runs[-1][2] += 1 if k == 1 else -1
            else:
                runs.append([(row0 + h) * t_cap + col0 + t, s, 1 if k == 1 else -1])
            last = (h, t, k, s)
    return np.array(runs, dtype=np.int64).reshape(-1, 3)


def test_the_extension_builds():
    """The compiled path is what serving uses: it must build here (CI), not fall back."""
    assert cpu_ext.load() is not None, cpu_ext._error


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cache", [dict(cache_pages=0), dict(cache_pages=2),
                                   dict(cache_pages=9), dict(cache_pages=40),
                                   dict(cache_fraction=0.1, **NO_FLOOR)])
def test_lookup_and_update_equal_the_reference(policy, cache, rng):
    """Random steps of 1-15 clusters per head over a store whose cache ranges from none to
    room for most reads (so admissions are skipped as too big, admitted greedily, and made
    after evictions by the policy's order): each step's lookup and update equal numpy's."""
    h, m, c = 3, 900, 60
    cfg = RetroConfig(page_size=4, cache_policy=policy, **cache)
    mgr, buf, _, _ = _stores(cfg, h, m, c, 16, rng)
    mod = buf.compiled
    assert mod is not None
    admitted = evicted = mixed = 0
    for step in range(60):
        ids = _ids(c, int(torch.randint(1, 16, (1,), generator=rng)), h, rng).numpy()
        ns = int(torch.randint(0, 5, (1,), generator=rng))
        buf.sync()
        ref = buf.table.lookup(ids, buf.host.page_block)
        w = ref.kind.shape[1]
        t_cap = ns + w + int(torch.randint(0, 4, (1,), generator=rng))
        # a plan reused from an earlier step: the lookup writes its runs from entry `at`
        # (rows 1 .. h of the execution buffer) and touches nothing else
        at = int(torch.randint(0, 5, (1,), generator=rng))
        plan = np.full((at + h * w + 3, 3), 7, dtype=np.int64)
        got = buf.table.lookup_into(mod, ids, buf.host.page_block, plan, at, 1, ns, t_cap)
        want = _runs_by_definition(ref.kind, ref.src_row, 1, ns, t_cap)
        assert np.array_equal(got.runs, want), f"step {step}: runs"
        assert np.array_equal(ref.plan(1, ns, t_cap), want), f"step {step}: numpy runs"
        assert (plan[:at] == 7).all() and (plan[at + len(want):] == 7).all()
        assert len(want) == 0 or np.shares_memory(got.runs, plan)
        for f in ("cached", "begins", "totals"):
            assert np.array_equal(getattr(got, f), getattr(ref, f)), f"step {step}: {f}"
        pages = int(np.take_along_axis(buf.table.n_pages, ids, 1)[~ref.cached].sum())
        assert got.counts.tolist() == [int((ref.kind == 1).sum()), int((ref.kind == 2).sum()),
                                       int(ref.cached.sum()), pages]
        if ref.cached.any() and (~ref.cached).any():
            mixed += 1
        before = _state(buf)
        plan = buf.update(ids, got, ns)
        compiled = _state(buf)
        _restore(buf, before)
        buf.compiled = None
        want = buf.update(ids, ref, ns)
        buf.compiled = mod
        _assert_same(before, compiled, _state(buf), f"step {step}")
        for p, q in zip(plan, want, strict=True):
            assert np.array_equal(p, q), f"step {step}: plan"
        buf.check_invariants()
        admitted += plan[0].size
        evicted += (compiled["stats"]["device_cache_evicted_pages"]
                    - before["stats"]["device_cache_evicted_pages"])
    if cache.get("cache_pages", 1) > 0:
        assert admitted > 0 and mixed > 0
    if cache.get("cache_pages") in (2, 9):
        assert evicted > 0
    mgr.close()


def _layer_stores(cfg, n, h, rng):
    """``n`` stores of one layer pool (one host pool, one page -> block map), each holding
    30 clusters per head over a block of its own length."""
    mgr = WaveBufferManager(cfg)
    stores = [_store(mgr, f"r{i}", "L0", rng, m=150 + 90 * i) for i in range(n)]
    for st in stores:
        st.sync()
        assert st.table.size.shape[0] == h
    return mgr, stores


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_one_lookup_call_for_a_layer_equals_each_stores_own(threads, rng):
    """buffer_lookup_batch (the stores in parallel, each into a region of its own, then
    closed up) gives every store what its own buffer_lookup gives at its place in the plan:
    runs, cached, begins, totals, counts; random store counts, retrieval widths, steady
    zones and buffer widths, over steps whose updates make caches mixed."""
    mgr, stores = _layer_stores(_fraction_cfg(0.3), 5, 2, rng)
    mod = stores[0].compiled
    assert mod is not None
    mixed = 0
    for step in range(40):
        n = int(torch.randint(1, 6, (1,), generator=rng))
        sts = [stores[int(i)] for i in torch.randperm(5, generator=rng)[:n]]
        h = 2
        ids = [_ids(st.table.num_clusters, int(torch.randint(1, 12, (1,), generator=rng)),
                    h, rng).numpy() for st in sts]
        col0 = [int(torch.randint(0, 5, (1,), generator=rng)) for _ in sts]
        need = [c + int(st.table.size[np.arange(h)[:, None], i].sum(1).max())
                for st, i, c in zip(sts, ids, col0, strict=True)]
        t_cap = max(need) + int(torch.randint(0, 3, (1,), generator=rng))
        plan = np.full((n * h * t_cap + 2, 3), 7, dtype=np.int64)
        got = ClusterMappingTable.lookup_batch_into(
            mod, [st.table for st in sts], ids, sts[0].host.page_block, plan, col0, t_cap,
            threads)
        at = 0
        for j, (st, i, c, lk) in enumerate(zip(sts, ids, col0, got, strict=True)):
            own = np.zeros((h * t_cap, 3), dtype=np.int64)
            want = st.table.lookup_into(mod, i, st.host.page_block, own, 0, j * h, c, t_cap)
            assert np.array_equal(lk.runs, want.runs), f"step {step}, store {j}: runs"
            assert np.array_equal(plan[at:at + len(want.runs)], want.runs)
            at += len(want.runs)
            for f in ("cached", "begins", "totals", "counts"):
                assert np.array_equal(getattr(lk, f), getattr(want, f)), f"{step}: {f}"
            mixed += bool(lk.cached.any() and (~lk.cached).any())
        for st, i, lk in zip(sts, ids, got, strict=True):  # let the caches move
            st.update(i, lk, 0)
    assert mixed > 0
    mgr.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_layers_lookup_call_rejects_bad_batches_clearly(threads, rng):
    mgr, stores = _layer_stores(_fraction_cfg(0.3), 3, 2, rng)
    mod, tables, pb = stores[0].compiled, [st.table for st in stores], stores[0].host.page_block
    c = min(t.num_clusters for t in tables)
    ids = [_ids(c, 3, 2, rng).numpy() for _ in stores]
    plan = np.zeros((3 * 2 * 400, 3), dtype=np.int64)

    def call(ids=ids, plan=plan, t_cap=400, tables=tables, threads=threads):
        return ClusterMappingTable.lookup_batch_into(mod, tables, ids, pb, plan,
                                                     [0] * len(tables), t_cap, threads)

    bad = [i.copy() for i in ids]
    bad[2][1, 0] = tables[2].num_clusters
    with pytest.raises(ValueError, match=f"cluster id {tables[2].num_clusters} is out of "
                                         f"range; accepted: 0 to {tables[2].num_clusters - 1}"):
        call(bad)
    with pytest.raises(RuntimeError,
                       match="store 1's ids are \\[1, 3\\]; every store has store 0's 2 heads"):
        call([ids[0], ids[1][:1]], tables=tables[:2])
    with pytest.raises(RuntimeError, match="the gather plan has room for 10 runs, the batch "
                                           "needs room for 2400"):
        call(plan=plan[:10])
    # stores 1 and 2 overflow the buffer: the error is store 1's, as a loop's would be
    col0 = [0, 395, 399]
    with pytest.raises(RuntimeError, match="the execution buffer has 400 slots") as first:
        tables[1].lookup_into(mod, ids[1], pb, plan, 0, 2, col0[1], 400)
    with pytest.raises(RuntimeError, match=re.escape(str(first.value).splitlines()[0])):
        ClusterMappingTable.lookup_batch_into(mod, tables, ids, pb, plan, col0, 400, threads)
    with pytest.raises(RuntimeError, match="buffer: threads 0; accepted: >= 1"):
        call(threads=0)
    assert call([], tables=[]) == []
    mgr.close()


def _layer_state(stores) -> list[np.ndarray]:
    pool = stores[0].pool
    n = int(pool.blocks.n_free[0])
    out = [pool.host.page_block.copy(), pool.blocks.free_stack[:n].copy()]
    for st in stores:
        out += [st.table.records.copy(), st.table.cached.copy(), np.array(st.clock)]
    return out


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("cache", [dict(cache_pages=3, cache_policy="lru"),
                                   dict(cache_pages=7, cache_policy="lfu"),
                                   dict(cache_fraction=0.3, **NO_FLOOR)])
def test_one_update_call_for_a_layer_equals_the_stores_updates_in_order(threads, cache):
    """buffer_update_batch (each store's stamps and evictions in parallel, the shared free
    stack given and taken in store order, the admissions in parallel) leaves the layer's
    tables, page -> block map and free stack, and returns the plans, exactly as each store's
    own update (a batch of one) run one after another in store order: two identical layers, random
    subsets of their stores per step, caches small enough to evict."""
    cfg = RetroConfig(page_size=4, **cache)
    layers = [_layer_stores(cfg, 5, 2, torch.Generator().manual_seed(5)) for _ in range(2)]
    (mgr_a, a), (mgr_b, b) = layers
    mod = a[0].compiled
    g = torch.Generator().manual_seed(6)
    evicted = 0
    for step in range(40):
        n = int(torch.randint(1, 6, (1,), generator=g))
        pick = [int(i) for i in torch.randperm(5, generator=g)[:n]]
        ids = [_ids(a[i].table.num_clusters, int(torch.randint(1, 12, (1,), generator=g)), 2,
                    g).numpy() for i in pick]
        col0 = [int(torch.randint(0, 4, (1,), generator=g)) for _ in pick]
        t_cap = 4 + max(int(a[i].table.size[np.arange(2)[:, None], x].sum(1).max())
                        for i, x in zip(pick, ids, strict=True))
        plan = np.zeros((n * 2 * t_cap, 3), dtype=np.int64)
        before = mgr_a.stats.snapshot()
        want = []
        for j, (i, x, c) in enumerate(zip(pick, ids, col0, strict=True)):  # one by one
            lk = a[i].table.lookup_into(mod, x, a[i].host.page_block, plan, 0, j * 2, c, t_cap)
            want.append(a[i].update(x, lk, c))
        sts = [b[i] for i in pick]
        lks = ClusterMappingTable.lookup_batch_into(
            mod, [st.table for st in sts], ids, sts[0].host.page_block, plan, col0, t_cap)
        futures = [Future() for _ in sts]
        b[0].pool.update_batch(sts, ids, lks, col0, futures, threads=threads)
        for j, (fut, w) in enumerate(zip(futures, want, strict=True)):
            for p, q in zip(fut.result(), w, strict=True):
                assert np.array_equal(p, q), f"step {step}, store {j}: plan"
        for x, y in zip(_layer_state(a), _layer_state(b), strict=True):
            assert np.array_equal(x, y), f"step {step}: tables"
        snap_a, snap_b = mgr_a.stats.snapshot(), mgr_b.stats.snapshot()
        for key in ("device_cache_admitted_pages", "device_cache_evicted_pages"):
            assert snap_a[key] == snap_b[key], key
        evicted += snap_a["device_cache_evicted_pages"] - before["device_cache_evicted_pages"]
    assert evicted > 0 and mgr_a.stats.device_cache_admitted_pages > 0
    a[0].check_invariants()
    b[0].check_invariants()
    mgr_a.close()
    mgr_b.close()


def test_a_store_failing_in_the_layers_update_call_fails_alone():
    """A store whose update cannot be made (here: it reads every cluster and may take more
    blocks than the pool has, as if budgets were overcommitted) gets its own error; the
    stores after it are updated, as separate updates would be."""
    cfg = _fraction_cfg(0.3)
    mgr, stores = _layer_stores(cfg, 3, 2, torch.Generator().manual_seed(7))
    sts = [stores[2], stores[0], stores[1]]
    pool, mod = sts[0].pool, sts[0].compiled
    g = torch.Generator().manual_seed(8)
    c = sts[0].table.num_clusters
    ids = [torch.stack([torch.randperm(c, generator=g) for _ in range(2)]).numpy()]
    ids += [_ids(st.table.num_clusters, 6, 2, g).numpy() for st in sts[1:]]
    assert sts[0].nbytes() // sts[0].host.page_nbytes() > pool.blocks.num_blocks
    plan = np.zeros((3 * 2 * 400, 3), dtype=np.int64)
    lks = ClusterMappingTable.lookup_batch_into(mod, [st.table for st in sts], ids,
                                                pool.host.page_block, plan, [0] * 3, 400)
    free = int(pool.blocks.n_free[0])
    sts[0].capacity[:] += pool.blocks.num_blocks
    futures = [Future() for _ in sts]
    pool.update_batch(sts, ids, lks, [0] * 3, futures, threads=2)
    with pytest.raises(RuntimeError, match="blocks asked, .* free .budgets overcommitted"):
        futures[0].result()
    taken = sum(f.result()[2].size for f in futures[1:])  # one entry per admitted page
    assert taken > 0 and int(pool.blocks.n_free[0]) == free - taken
    mgr.close()


def test_bad_ids_and_an_overcommitted_pool_are_clear_errors(rng):
    h, m, c = 2, 300, 30
    mgr, buf, _, _ = _stores(RetroConfig(page_size=4, cache_pages=8), h, m, c, 16, rng)
    buf.sync()
    bad = np.array([[0, 30], [1, 2]])
    plan = np.zeros((400, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup_into(buf.compiled, bad, buf.host.page_block, plan, 0, 0, 0, 200)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup(bad, buf.host.page_block)
    ids = _ids(c, 3, h, rng).numpy()
    lk = buf.table.lookup(ids, buf.host.page_block)
    need = int(lk.totals.max())
    mod = buf.compiled
    for compiled in (mod, None):  # the same errors either way
        buf.compiled = compiled
        with pytest.raises(RuntimeError, match=f"the execution buffer has {need + 1} slots, "
                                               f"the step's tokens need {need + 2}"):
            buf.lookup_into(ids, plan, 0, 0, 2, need + 1)
        with pytest.raises(RuntimeError, match="the gather plan has room for 1 runs"):
            buf.lookup_into(ids, plan[:1], 0, 0, 0, need)
    buf.compiled = mod
    buf.blocks.n_free[0] = 0  # as if another store had taken every block past its budget
    for compiled in (buf.compiled, None):
        buf.compiled = compiled
        with pytest.raises(RuntimeError, match="blocks asked, 0 free .budgets overcommitted"):
            buf.update(ids, lk, 0)
