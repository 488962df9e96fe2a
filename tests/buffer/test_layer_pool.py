"""vllm_retro.buffer.layer_pool and its two pools: one host page pool and one device block
pool per layer, shared by the layer's stores."""

import sys
import threading

import numpy as np
import pytest
import torch

from tests.fixtures import random_clusters
from vllm_retro.buffer import BufferStats, WaveBufferManager
from vllm_retro.buffer.block_cache import DeviceBlockPool
from vllm_retro.buffer.host_tier import HostTier
from vllm_retro.config import RetroConfig
from vllm_retro.index.store import fill_steady


def test_host_extents_are_reused_first_fit_and_merged():
    host = HostTier(8, 4, torch.float32, BufferStats(), pin=False)
    a = host.reserve(3)
    b = host.reserve(5)
    c = host.reserve(2)
    assert (a, b, c) == (0, 3, 8) and host.used_pages == 10
    host.page_block[b:b + 5] = 7
    host.release(b, 5)
    assert host.free_extents == [(3, 5)] and (host.page_block[3:8] == -1).all()
    assert (host.positions.numpy()[3 * 4:8 * 4] == -1).all()
    assert host.reserve(6) == 10  # does not fit in the hole: past the high-water mark
    assert host.reserve(4) == 3 and host.free_extents == [(7, 1)]  # first fit
    host.release(3, 4)
    assert host.free_extents == [(3, 5)]  # merged with its free neighbour
    host.release(10, 6)  # ends at the high-water mark: given back to it
    assert host.used_pages == 10 and host.allocated_pages == 5
    host.release(0, 3)
    host.release(8, 2)
    assert host.used_pages == 0 and host.free_extents == [] and host.allocated_pages == 0


def test_host_rows_are_one_pools_keys_and_values_while_the_worker_grows_it():
    """rows() while another thread grows the pool: keys and values always of one generation
    (reading ``k`` then ``v`` straddled a growth about 7 times a round here, handing an
    in-place device layer a key pool and a value pool of two sizes)."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            host = HostTier(4, 2, torch.float32, BufferStats(), pin=False)
            done = threading.Event()

            def grow(host=host, done=done):
                for _ in range(2000):
                    host.reserve(1)
                done.set()

            worker = threading.Thread(target=grow)
            worker.start()
            while not done.is_set():
                k, v = host.rows()
                assert k.shape == v.shape and k.shape[1] == 4
            worker.join()
            assert host.generation > 10
    finally:
        sys.setswitchinterval(switch)


def test_host_growth_keeps_pages_and_their_block_map():
    host = HostTier(2, 2, torch.float32, BufferStats(), pin=False)
    first = host.reserve(3)
    rows = np.arange(6)
    host.write_rows(rows, np.arange(12, dtype=np.int32).reshape(6, 2),
                    np.arange(12, dtype=np.int32).reshape(6, 2), rows + 100)
    host.page_block[first:first + 3] = [5, -1, 9]
    old_k = host.k
    assert host.ensure_room(10) and host.generation == 2  # the first reserve made one
    assert host.capacity_pages >= 13 and host.k is not old_k
    assert torch.equal(host.k[:3], old_k[:3])
    assert host.page_block[:3].tolist() == [5, -1, 9]
    assert host.positions[:6].tolist() == list(range(100, 106))
    nxt = host.reserve(2)  # a claim past the old pool: uncached padding
    assert nxt == 3 and (host.page_block[3:5] == -1).all()
    assert (host.positions.numpy()[6:10] == -1).all()


def test_a_reserved_pool_is_mapped_once_and_holds_only_what_is_claimed():
    stats = BufferStats()
    page = 2 * 4 * 8 * 4  # K+V bytes of a page (page_size 4, D 8, fp32)
    host = HostTier(8, 4, torch.float32, stats, pin=False, reserve_pages=1000)
    assert host.capacity_pages == 0 and host.nbytes() == 0  # nothing before a claim
    a = host.reserve(30, headroom=50)
    assert host.capacity_pages == 1000 and host.generation == 1
    rows = np.arange(30 * 4)
    host.write_rows(rows, np.ones((rows.size, 8), np.int32), np.ones((rows.size, 8), np.int32),
                    rows)
    b = host.reserve(900)
    assert (a, b) == (0, 30) and host.generation == 1  # no growth, no copy
    assert host.nbytes() == 930 * page == stats.host_bytes
    host.release(a, 30)
    assert host.nbytes() == 900 * page == stats.host_bytes
    # the released extent's memory went back to the OS: whole OS pages of it read zero
    assert int(host.k[:30].count_nonzero()) < 4096 // 4
    c = host.reserve(10)
    assert c == 0 and (host.page_block[:10] == -1).all()
    assert (host.positions.numpy()[:40] == -1).all()
    assert host.ensure_room(60) is False  # room past the mark: nothing happens
    assert host.reserve(60) == 930 and host.generation == 1
    host.reserve(100)  # past the reservation: grows, copying, as a pool without one
    assert host.generation == 2 and host.capacity_pages >= 1090
    host.free()
    assert host.capacity_pages == 0 and stats.host_bytes == 0


def test_a_reservation_larger_than_memory_is_only_address_space():
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    ram = psutil.virtual_memory().total
    d = 128
    page = 2 * 8 * d * 2
    host = HostTier(d, 8, torch.bfloat16, BufferStats(), pin=False,
                    reserve_pages=2 * ram // page)  # twice the machine's memory
    before = proc.memory_info().rss
    first = host.reserve(4096)  # 16 MB of K+V claimed and written
    rows = np.arange(first * 8, (first + 4096) * 8)
    kv = np.ones((rows.size, d), np.int16)
    host.write_rows(rows, kv, kv, rows)
    grown = proc.memory_info().rss - before
    assert host.capacity_pages * page >= 2 * ram
    assert 16 << 20 <= grown < 64 << 20  # what was written, not the reservation
    host.free()


def test_block_pool_holds_the_budgets_and_refuses_overcommit():
    stats = BufferStats()
    pool = DeviceBlockPool(4, 2, torch.float32, torch.device("cpu"), stats)
    pool.reserve(5)
    assert pool.num_blocks == 5 == len(pool.free_blocks) and pool.reserved == 5
    got = pool.take(3)
    src = torch.cat([torch.zeros(1, 4), torch.ones(1, 4)]), torch.full((2, 4), 2.0)
    pool.write_runs(*src, *src, np.array([[got[0] * 2, 1, 1]]), "torch")
    pool.reserve(1)  # grows, contents and block ids kept
    assert pool.num_blocks >= 6
    assert torch.equal(pool.k[got[0], 0], torch.ones(4))
    assert torch.equal(pool.v[got[0], 0], torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="blocks asked"):
        pool.take(len(pool.free_blocks) + 1)
    pool.give(got)
    pool.unreserve(6)
    assert pool.reserved == 0 and len(pool.free_blocks) == pool.num_blocks
    assert stats.device_bytes == pool.nbytes()
    pool.free()
    assert stats.device_bytes == 0


def _store(mgr, rid, layer, g, m=300, c=30):
    h, d = 2, 16
    k, v = torch.randn(h, m, d, generator=g), torch.randn(h, m, d, generator=g)
    st = mgr.store(rid, h, d, torch.float32, "cpu", layer=layer)
    st.append(k, v, torch.arange(m), random_clusters(h, m, c, g))
    st.settle()
    return st


def test_stores_of_a_layer_share_its_pools_and_free_into_them():
    g = torch.Generator().manual_seed(0)
    mgr = WaveBufferManager(RetroConfig(cache_fraction=0.5))
    a = _store(mgr, "a", "L0", g)
    b = _store(mgr, "b", "L0", g)
    other = _store(mgr, "a", "L1", g)
    assert a.pool is b.pool is not other.pool
    for st in (a, b):  # fill both caches
        for _ in range(3):
            st.gather(torch.stack([torch.randperm(30, generator=g)[:8] for _ in range(2)]), [])
            st.step_done()
    a.check_invariants()
    held_b = b.mapped_blocks().copy()
    pages_a = a.nbytes() // a.host.page_nbytes()
    blocks_before = a.blocks.num_blocks
    mgr.free_request("a")
    # b's cached blocks and pages are untouched; a's are free for the next request
    assert np.array_equal(b.mapped_blocks(), held_b)
    assert a.host.allocated_pages == b.nbytes() // b.host.page_nbytes()
    c = _store(mgr, "c", "L0", g, m=200)
    assert c.pool is b.pool and c.blocks.num_blocks == blocks_before  # reused, not grown
    assert c.nbytes() // c.host.page_nbytes() <= pages_a
    c.gather(torch.arange(8).repeat(2, 1), [])
    c.step_done()
    c.check_invariants()
    mgr.free_request("b")
    mgr.free_request("c")
    assert mgr.live_bytes() == (0, 0) and mgr.stats.host_bytes == 0
    mgr.close()
    assert mgr.stats.device_bytes == 0


@pytest.mark.parametrize("async_updates", [True, False])
def test_batch_gather_is_one_gather_and_one_update_job_per_layer_step(async_updates):
    """gather_batch fills every store's rows as each store's own gather does, with one
    worker job for all their cache updates; join_batch lands every admission."""
    g = torch.Generator().manual_seed(1)
    cfg = RetroConfig(cache_fraction=0.3, async_updates=async_updates)
    mgr = WaveBufferManager(cfg)
    stores = [_store(mgr, f"r{i}", "L0", g, m=200 + 100 * i) for i in range(3)]
    h, d, r = 2, 16, 6
    for _ in range(12):
        ids = [torch.stack([torch.randperm(30, generator=g)[:r] for _ in range(h)]).numpy()
               for _ in stores]
        steady = [[(torch.randn(h, 3 + j, d, generator=g),) * 2] for j in range(3)]
        lengths = [3 + j + int(s.table.size[np.arange(h)[:, None], i].sum(1).max())
                   for j, (s, i) in enumerate(zip(stores, ids, strict=True))]
        exec_k = torch.zeros(3 * h, max(lengths), d)
        exec_v = torch.zeros_like(exec_k)
        jobs = mgr.stats.updates_submitted
        n_steady = [3 + j for j in range(3)]
        for j, parts in enumerate(steady):  # the caller fills the steady zone
            fill_steady(parts, exec_k[j * h:(j + 1) * h], exec_v[j * h:(j + 1) * h])
        stores[0].pool.gather_batch(stores, ids, n_steady, exec_k, exec_v)
        assert mgr.stats.updates_submitted == jobs + 1
        for j, st in enumerate(stores):
            k, v, _, n = st.gather(torch.from_numpy(ids[j]), steady[j])  # its own path
            st.step_done()
            for hh in range(h):
                assert torch.equal(exec_k[j * h + hh, :n[hh]], k[hh, :n[hh]])
                assert torch.equal(exec_v[j * h + hh, :n[hh]], v[hh, :n[hh]])
        stores[0].pool.join_batch(stores)  # joined by their own reads already: no-op
        stores[0].pool.gather_batch(stores, ids, n_steady, exec_k, exec_v)
        stores[0].pool.join_batch(stores)
    assert mgr.stats.hit_tokens > 0 and mgr.stats.device_cache_admitted_pages > 0
    stores[0].check_invariants()
    mgr.close()
    assert mgr.live_bytes() == (0, 0)


def test_a_failing_store_leaves_the_others_without_a_half_begun_step():
    """A store that cannot be read (freed) fails the batch gather with its error; the stores
    before it keep no step to join (their rows were never filled) and stay usable."""
    g = torch.Generator().manual_seed(2)
    mgr = WaveBufferManager(RetroConfig(cache_fraction=0.5))
    a, b = _store(mgr, "a", "L0", g), _store(mgr, "b", "L0", g)
    c = _store(mgr, "c", "L0", g)
    mgr.free_request("b")
    ids = [torch.arange(4).repeat(2, 1).numpy()] * 3
    exec_k = torch.zeros(6, 200, 16)
    with pytest.raises(RuntimeError, match="freed"):
        a.pool.gather_batch([a, b, c], ids, [0] * 3, exec_k, torch.zeros_like(exec_k))
    assert a._step is None and a._pending is None and c._step is None
    a.pool.join_batch([a, c])
    a.gather(torch.arange(4).repeat(2, 1), [])
    a.step_done()
    a.check_invariants()
    mgr.close()
