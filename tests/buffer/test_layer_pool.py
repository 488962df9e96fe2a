"""vllm_retro.buffer.layer_pool and its host page pool: one per layer, shared by the
layer's stores."""

import sys
import threading

import numpy as np
import pytest
import torch

from tests.fixtures import random_clusters
from vllm_retro.buffer import BufferStats, WaveBufferManager
from vllm_retro.buffer.host_tier import HostTier
from vllm_retro.config import RetroConfig
from vllm_retro.index.store import fill_steady


def test_host_extents_are_reused_first_fit_and_merged():
    host = HostTier(8, 4, torch.float32, BufferStats(), pin=False)
    a = host.reserve(3)
    b = host.reserve(5)
    c = host.reserve(2)
    assert (a, b, c) == (0, 3, 8) and host.used_pages == 10
    host.release(b, 5)
    assert host.free_extents == [(3, 5)]
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


def test_host_growth_keeps_pages_and_positions():
    host = HostTier(2, 2, torch.float32, BufferStats(), pin=False)
    first = host.reserve(3)
    rows = np.arange(6)
    host.write_rows(rows, np.arange(12, dtype=np.int32).reshape(6, 2),
                    np.arange(12, dtype=np.int32).reshape(6, 2), rows + 100)
    old_k = host.k
    assert host.ensure_room(10) and host.generation == 2  # the first reserve made one
    assert host.capacity_pages >= 13 and host.k is not old_k
    assert torch.equal(host.k[:3], old_k[:3])
    assert host.positions[:6].tolist() == list(range(100, 106))
    nxt = host.reserve(2)  # a claim past the old pool: padding
    assert nxt == 3 and first == 0
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
    assert c == 0
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


def _store(mgr, rid, layer, g, m=300, c=30):
    h, d = 2, 16
    k, v = torch.randn(h, m, d, generator=g), torch.randn(h, m, d, generator=g)
    st = mgr.store(rid, h, d, torch.float32, "cpu", layer=layer)
    st.append(k, v, torch.arange(m), random_clusters(h, m, c, g))
    st.settle()
    return st


def test_stores_of_a_layer_share_its_pool_and_free_into_it():
    g = torch.Generator().manual_seed(0)
    mgr = WaveBufferManager(RetroConfig())
    a = _store(mgr, "a", "L0", g)
    b = _store(mgr, "b", "L0", g)
    other = _store(mgr, "a", "L1", g)
    assert a.pool is b.pool is not other.pool
    ids = torch.stack([torch.randperm(30, generator=g)[:8] for _ in range(2)])
    want = [x.clone() for x in b.gather(ids, [])[:2]]
    pages_a = a.nbytes() // a.host.page_nbytes()
    mgr.free_request("a")
    # b's pages are untouched; a's are free for the next request
    assert a.host.allocated_pages == b.nbytes() // b.host.page_nbytes()
    c = _store(mgr, "c", "L0", g, m=200)
    assert c.pool is b.pool and c.nbytes() // c.host.page_nbytes() <= pages_a
    got = b.gather(ids, [])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    c.check_invariants()
    b.check_invariants()
    mgr.free_request("b")
    mgr.free_request("c")
    assert mgr.host_bytes() == 0 and mgr.stats.host_bytes == 0
    mgr.close()
    assert mgr.stats.device_bytes == 0


@pytest.mark.parametrize("async_updates", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_batch_gather_equals_each_stores_own_gather(async_updates, compiled, monkeypatch):
    """gather_batch fills every store's rows as each store's own gather does (one lookup
    call for the layer when compiled, one per store in numpy), submitting no worker job."""
    g = torch.Generator().manual_seed(1)
    cfg = RetroConfig(async_updates=async_updates)
    mgr = WaveBufferManager(cfg)
    stores = [_store(mgr, f"r{i}", "L0", g, m=200 + 100 * i) for i in range(3)]
    if not compiled:
        for st in stores:
            monkeypatch.setattr(st, "compiled", None)
    elif stores[0].compiled is None:
        pytest.skip("the C++ extension is not available")
    h, d, r = 2, 16, 6
    for _ in range(6):
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
        assert mgr.stats.updates_submitted == jobs
        for j, st in enumerate(stores):
            k, v, _, n = st.gather(torch.from_numpy(ids[j]), steady[j])  # its own path
            for hh in range(h):
                assert torch.equal(exec_k[j * h + hh, :n[hh]], k[hh, :n[hh]])
                assert torch.equal(exec_v[j * h + hh, :n[hh]], v[hh, :n[hh]])
    assert mgr.stats.hit_tokens == 0 and mgr.stats.miss_tokens > 0
    stores[0].check_invariants()
    mgr.close()
    assert mgr.host_bytes() == 0


def test_a_freed_store_fails_the_batch_gather_and_the_others_stay_usable():
    """A store that cannot be read (freed) fails the batch gather with its error; the other
    stores read as before."""
    g = torch.Generator().manual_seed(2)
    mgr = WaveBufferManager(RetroConfig())
    a, b = _store(mgr, "a", "L0", g), _store(mgr, "b", "L0", g)
    c = _store(mgr, "c", "L0", g)
    mgr.free_request("b")
    ids = [torch.arange(4).repeat(2, 1).numpy()] * 3
    exec_k = torch.zeros(6, 200, 16)
    with pytest.raises(RuntimeError, match="freed"):
        a.pool.gather_batch([a, b, c], ids, [0] * 3, exec_k, torch.zeros_like(exec_k))
    a.pool.gather_batch([a, c], ids[:2], [0] * 2, exec_k[:4], torch.zeros_like(exec_k[:4]))
    a.check_invariants()
    mgr.close()
