"""vllm_retro.buffer.store: execution buffer contents, cache behaviour, invariants, and
bit-exact decode through the buffer."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.buffer.conftest import RefCache
from tests.fixtures import random_clusters
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index import DenseClusterStore, WaveIndex
from vllm_retro.index.functional import sparse_attention


def _stores(cfg, h, m, c, d, g, dtype=torch.float32):
    """A buffer store and a dense store holding the same clustered block."""
    keys = torch.randn(h, m, d, generator=g).to(dtype)
    values = torch.randn(h, m, d, generator=g).to(dtype)
    cl = random_clusters(h, m, c, g)
    pos = torch.arange(100, 100 + m)
    mgr = WaveBufferManager(cfg)
    buf = mgr.store("req", h, d, dtype, "cpu")
    buf.append(keys, values, pos, cl)
    dense = DenseClusterStore(h, d, dtype, torch.device("cpu"))
    dense.append(keys, values, pos, cl)
    return mgr, buf, dense, cl


def _ids(c, r, h, g):
    return torch.stack([torch.randperm(c, generator=g)[:r] for _ in range(h)])


def _assert_same_gather(buf, dense, ids, steady):
    """``buf``'s execution buffer for ``ids`` holds exactly ``dense``'s gather's bytes."""
    ek, ev, epos, elen = buf.gather(ids, steady)
    dk, dv, dpos, dlen = dense.gather(ids, steady)
    assert torch.equal(elen, dlen) and torch.equal(epos, dpos)
    for i in range(ids.shape[0]):
        n = int(dlen[i])
        assert torch.equal(ek[i, :n], dk[i, :n]) and torch.equal(ev[i, :n], dv[i, :n])


def _random_steps(buf, dense, steps, c, rng, dtype=torch.float32):
    """``steps`` decode steps of 1-11 random clusters per head through ``buf`` (its update
    joined and its invariants checked after each), each gather equal to ``dense``'s."""
    h, d = buf.num_heads, buf.head_dim
    steady = [tuple(torch.randn(h, 5, d, generator=rng).to(dtype) for _ in range(2))]
    for _ in range(steps):
        _assert_same_gather(buf, dense, _ids(c, int(torch.randint(1, 12, (1,), generator=rng)),
                                             h, rng), steady)
        buf.step_done()
        buf.check_invariants()


@pytest.mark.parametrize("cache_pages", [0, 3, 20, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_execution_buffer_equals_direct_gather(cache_pages, dtype, rng):
    """Random hit/miss mixes: the assembled buffer holds exactly the dense gather's bytes."""
    h, m, c, d = 3, 900, 60, 64
    mgr, buf, dense, _ = _stores(RetroConfig(cache_pages=cache_pages), h, m, c, d, rng, dtype)
    _random_steps(buf, dense, 30, c, rng, dtype)
    snap = mgr.stats.snapshot()
    assert snap["device_cache_hit_clusters"] + snap["device_cache_miss_clusters"] > 0
    if cache_pages == 0:
        assert snap["device_cache_hit_clusters"] == 0
    if cache_pages == 10_000:
        assert snap["device_cache_hit_clusters"] > 0
    mgr.close()


def test_a_pool_without_a_block_cache_reads_every_cluster_from_the_host(rng):
    """A CPU server's pools (``WaveBufferManager(cpu_block_cache=False)``): no block is
    reserved or allocated, every read is a miss served from the host pool, byte for byte the
    dense gather's."""
    h, m, c, d = 3, 900, 60, 64
    cfg = RetroConfig()
    keys, values = torch.randn(h, m, d, generator=rng), torch.randn(h, m, d, generator=rng)
    cl, pos = random_clusters(h, m, c, rng), torch.arange(m)
    stores = {}
    for cache in (True, False):
        manager = WaveBufferManager(cfg, cpu_block_cache=cache)
        stores[cache] = [manager.store(rid, h, d, torch.float32, "cpu", layer="l0")
                         for rid in ("a", "b")]
        for buf in stores[cache]:
            buf.append(keys, values, pos, cl)
            buf.settle()  # the layout, on the buffer's worker, done
    with_cache = stores[True][0]
    assert with_cache.pool.block_cache and with_cache.capacity.sum() > 0  # the default
    assert with_cache.pool.blocks.num_blocks > 0
    a, b = stores[False]
    assert not a.pool.block_cache and a.pool is b.pool
    assert a.capacity.sum() == b.capacity.sum() == 0 and a.pool.blocks.num_blocks == 0
    assert a.pool.nbytes()[1] == 0 and a.pool.nbytes()[0] > 0
    dense = DenseClusterStore(h, d, torch.float32, torch.device("cpu"))
    dense.append(keys, values, pos, cl)
    _random_steps(a, dense, 20, c, rng)
    snap = a.stats.snapshot()
    assert snap["device_cache_hit_clusters"] == 0 and snap["device_cache_miss_clusters"] > 0
    assert snap["device_cache_admitted_pages"] == 0 and a.pool.nbytes()[1] == 0
    for bufs in stores.values():
        for buf in bufs:
            buf.free()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cache_pages=st.integers(0, 40),
       steps=st.lists(st.integers(1, 10), min_size=1, max_size=40))
def test_lru_matches_reference_model(seed, cache_pages, steps):
    """Property: the cached set of every head equals an LRU reference model's after every
    step; capacity is never exceeded; no block both free and mapped, none lost."""
    g = torch.Generator().manual_seed(seed)
    h, m, c = 2, 400, 40
    mgr, buf, _, cl = _stores(RetroConfig(cache_pages=cache_pages, page_size=8), h, m, c, 32, g)
    pages = [[(int(s) + 7) // 8 for s in cl.sizes[i]] for i in range(h)]
    refs = [RefCache(cache_pages, pages[i]) for i in range(h)]
    for r in steps:
        ids = _ids(c, r, h, g)
        buf.gather(ids, [])
        buf.step_done()
        buf.check_invariants()
        for i in range(h):
            refs[i].step(ids[i].tolist())
            assert set(np.nonzero(buf.table.cached[i])[0].tolist()) == set(refs[i].order)
            used = int(buf.table.n_pages[i][buf.table.cached[i]].sum())
            assert used <= cache_pages == buf.capacity[i]
    mgr.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_lfu_and_lru_keep_invariants(policy, rng):
    mgr, buf, _, _ = _stores(RetroConfig(cache_pages=12, cache_policy=policy), 2, 500, 50, 32,
                             rng)
    for _ in range(60):
        buf.gather(_ids(50, 6, 2, rng), [])
        buf.step_done()
        buf.check_invariants()
    mgr.close()


def _decode_pair(cfg, hq, hkv, n, d, steps, g, dtype):
    k = torch.randn(hkv, n + steps, d, generator=g).to(dtype)
    v = torch.randn(hkv, n + steps, d, generator=g).to(dtype)
    k[:, :: 7] *= 3  # some structure so that retrieval repeats across steps
    mgr = WaveBufferManager(cfg)
    dense = WaveIndex.build(k[:, :n], v[:, :n], cfg)
    buf = WaveIndex.build(k[:, :n], v[:, :n], cfg,
                          store=mgr.store("r", hkv, d, dtype, "cpu"))
    outs = []
    base = torch.randn(hq, d, generator=g)
    for t in range(steps):
        q = (base + 0.3 * torch.randn(hq, d, generator=g)).to(dtype)
        a, b = dense.decode(q), buf.decode(q)
        outs.append((a.output, b.output))
        dense.append(k[:, n + t:n + t + 1], v[:, n + t:n + t + 1])
        buf.append(k[:, n + t:n + t + 1], v[:, n + t:n + t + 1])
    return mgr, buf, dense, outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 128), (4, 1, 256)])
def test_decode_through_buffer_is_bit_exact(dtype, hq, hkv, d, rng):
    """Through the wave buffer the decode output equals the plain index's, bit for bit,
    across an index update (the window passes 64 + 128 tokens; the default 1024-token
    blocks would take 6x the steps for the same path)."""
    cfg = RetroConfig(update_segment=128, update_clusters=8)
    n = 2000
    steps = (cfg.local_window + cfg.update_segment) - (cfg.local_window) + 40  # one update
    mgr, buf, dense, outs = _decode_pair(cfg, hq, hkv, n, d, steps, rng, dtype)
    assert buf.num_updates == dense.num_updates == 1
    for a, b in outs:
        assert torch.equal(a, b)
    assert mgr.stats.device_cache_hit_clusters > 0  # the cache was really in use
    buf.store.check_invariants()
    mgr.close()


def test_first_step_matches_sparse_attention(rng):
    """The functional API and a buffer-backed index agree exactly on a fresh context."""
    q, k, v = torch.randn(8, 64, generator=rng), torch.randn(2, 3000, 64, generator=rng), \
        torch.randn(2, 3000, 64, generator=rng)
    ref, _ = sparse_attention(q, k, v)
    mgr = WaveBufferManager()
    idx = WaveIndex.build(k, v, store=mgr.store("r", 2, 64, torch.float32, "cpu"))
    assert torch.equal(idx.decode(q).output, ref)
    mgr.close()


@pytest.mark.parametrize("floor", [0, 16])
def test_cache_size_follows_the_fraction(floor, rng):
    """cache_fraction of each head's pages; with the retrieval floor (the default), never
    less than cache_fraction / retrieval_budget times the floor's tokens, at most all."""
    cfg = RetroConfig(cache_fraction=0.1, min_retrieval_clusters=floor, page_size=4)
    mgr, buf, _, _ = _stores(cfg, 2, 800, 50, 32, rng)
    buf.check_invariants()
    for i in range(2):
        pages = int(buf.table.n_pages[i].sum())
        by_fraction = int(np.ceil(0.1 * pages))
        want = min(pages, max(by_fraction, int(np.ceil(0.1 / 0.018 * 16 * 16 / 4)))) \
            if floor else by_fraction
        assert buf.capacity[i] == want
    assert floor == 0 or buf.capacity.min() > int(np.ceil(0.1 * buf.table.n_pages.sum(1).max()))
    mgr.close()


class TokenReadModel:
    """One head's cache under token reads, from the store's documented rules, one cluster
    at a time: the clusters read are stamped fewest tokens first, hits count a read, then
    at most ADMIT_BLOCKS misses, most tokens first, are admitted greedily within the
    budget, evicting least recently read unprotected clusters."""

    def __init__(self, capacity: int, pages: list[int], admit: int):
        self.capacity, self.pages, self.admit = capacity, pages, admit
        self.stamp: dict[int, int] = {}  # cached cluster -> last read
        self.clock = 0

    def step(self, tokens: list[int]) -> None:
        count: dict[int, int] = {}
        for c in tokens:
            count[c] = count.get(c, 0) + 1
        read = sorted(count, key=lambda c: (count[c], c))
        for c in read:
            self.clock += 1
            if c in self.stamp:
                self.stamp[c] = self.clock
        stamps = {c: i for i, c in enumerate(read)}
        misses = sorted((c for c in read if c not in self.stamp), key=lambda c: (-count[c], c))
        misses = [c for c in misses[:self.admit] if 0 < self.pages[c] <= self.capacity]
        used = sum(self.pages[c] for c in self.stamp)
        evictable = sorted((c for c in self.stamp if c not in count), key=self.stamp.get)
        budget = self.capacity - used + sum(self.pages[c] for c in evictable)
        taken, total = [], 0
        for c in misses:
            if total + self.pages[c] <= budget:
                taken.append(c)
                total += self.pages[c]
        while used + total > self.capacity:
            victim = evictable.pop(0)
            used -= self.pages[victim]
            del self.stamp[victim]
        for c in taken:
            self.stamp[c] = self.clock - len(read) + 1 + stamps[c]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cache_pages=st.integers(0, 30),
       steps=st.lists(st.integers(1, 40), min_size=1, max_size=25))
def test_token_reads_cache_matches_a_one_head_model(seed, cache_pages, steps):
    """Token reads (PQCache, the graph index) update every head at once; each head's
    cached set and recency order equal a one-cluster-at-a-time model's."""
    g = torch.Generator().manual_seed(seed)
    h, m, c = 3, 400, 40
    mgr, buf, _, cl = _stores(RetroConfig(cache_pages=cache_pages, page_size=8), h, m, c, 32, g)
    buf.ADMIT_BLOCKS = 4  # small, so that the cut matters
    sizes = cl.sizes.long()
    pages = [[(int(s) + 7) // 8 for s in sizes[i]] for i in range(h)]
    models = [TokenReadModel(cache_pages, pages[i], 4) for i in range(h)]
    rng = np.random.default_rng(seed)
    for k in steps:
        ids = np.zeros((h, k), dtype=np.int64)
        offs = np.zeros((h, k), dtype=np.int64)
        for i in range(h):
            nonempty = np.nonzero(sizes[i].numpy() > 0)[0]
            ids[i] = nonempty[rng.integers(0, nonempty.size, k) % rng.integers(1, 8)]
            offs[i] = rng.integers(0, sizes[i].numpy()[ids[i]])
        dk = torch.zeros(h, k, 32)
        buf.gather_tokens_into(ids, offs, 0, dk, dk.clone())
        buf.step_done()
        buf.check_invariants()
        for i in range(h):
            models[i].step(ids[i].tolist())
            cached = np.nonzero(buf.table.cached[i])[0].tolist()
            assert cached == sorted(models[i].stamp)
            by_recency = sorted(cached, key=lambda x: buf.table.last_access[i, x])
            assert by_recency == sorted(models[i].stamp, key=models[i].stamp.get)
    mgr.close()


@pytest.mark.parametrize("fail_at", [3, 7])
def test_a_failed_cache_update_drops_the_cache_and_the_reads_stay_exact(fail_at, rng,
                                                                        monkeypatch, caplog):
    """The update worker raises in one step's cache update (after that update changed the
    tables or before): the store gives back every block it held, marks nothing cached, keeps
    its invariants, counts the failure, and its gathers stay byte-exact while the cache
    refills."""
    from vllm_retro.buffer.store import WaveBufferStore

    h, m, c, d = 3, 900, 60, 32
    mgr, buf, dense, _ = _stores(RetroConfig(cache_pages=40), h, m, c, d, rng)
    real = WaveBufferStore.update
    calls = {"n": 0}

    def update(self, *a):
        calls["n"] += 1
        plan = real(self, *a)
        if calls["n"] == fail_at:
            raise RuntimeError("injected: update worker")
        return plan

    monkeypatch.setattr(WaveBufferStore, "update", update)
    sk, sv = torch.randn(h, 5, d, generator=rng), torch.randn(h, 5, d, generator=rng)
    for step in range(12):
        ids = _ids(c, 8, h, rng)
        _assert_same_gather(buf, dense, ids, [(sk, sv)])
        buf.step_done()
        buf.check_invariants()
        if step + 1 == fail_at:
            assert not buf.table.cached.any()
            assert all((buf.host.page_block[f:f + n] < 0).all() for f, n in buf._extents)
            assert sorted(buf.blocks.free_blocks) == list(range(buf.blocks.num_blocks))
    assert mgr.stats.buffer_update_failures == 1
    assert buf.table.cached.any()  # refilled since
    assert "its device cache is dropped" in caplog.text
    buf.free()
    assert buf.nbytes() == 0
    mgr.close()


def test_a_failed_room_growth_is_logged_and_the_next_layout_grows_the_pool(rng, monkeypatch,
                                                                         caplog):
    """The host pool's room growth (queued after each layout) raises: settling the store
    does not (the next layout grows the pool itself), the failure is counted, and a later
    block lays out and reads back exactly."""
    from vllm_retro.buffer.host_tier import HostTier

    h, m, c, d = 2, 700, 30, 32
    real = HostTier.ensure_room
    fails = {"left": 1}

    def ensure_room(self, pages):
        if fails["left"]:
            fails["left"] -= 1
            raise MemoryError("injected: room growth")
        return real(self, pages)

    monkeypatch.setattr(HostTier, "ensure_room", ensure_room)
    mgr, buf, dense, _ = _stores(RetroConfig(cache_pages=0), h, m, c, d, rng)
    buf.settle()  # does not raise
    assert mgr.stats.buffer_update_failures == 1
    assert "growing the host pool for request req failed" in caplog.text
    keys, values = torch.randn(h, m, d, generator=rng), torch.randn(h, m, d, generator=rng)
    cl = random_clusters(h, m, c, rng)
    pos = torch.arange(2000, 2000 + m)
    buf.append(keys, values, pos, cl)
    dense.append(keys, values, pos, cl)
    buf.settle()
    ids = _ids(2 * c, 10, h, rng)
    sk, sv = torch.randn(h, 3, d, generator=rng), torch.randn(h, 3, d, generator=rng)
    ek, ev, _, elen = buf.gather(ids, [(sk, sv)])
    dk, dv, _, dlen = dense.gather(ids, [(sk, sv)])
    for i in range(h):
        n = int(dlen[i])
        assert torch.equal(ek[i, :n], dk[i, :n]) and torch.equal(ev[i, :n], dv[i, :n])
    buf.step_done()
    buf.free()
    mgr.close()
