"""vllm_retro.buffer.manager: request lifecycle, memory returning to zero, and the async
worker racing lookups against a synchronous run."""

import numpy as np
import pytest
import torch

from tests.fixtures import random_clusters
from vllm_retro.buffer import BufferStats, WaveBufferManager
from vllm_retro.buffer.worker import UpdateWorker
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex


def _ingest(mgr, rid, layers, h, m, c, d, g):
    stores = []
    for layer in range(layers):
        k, v = torch.randn(h, m, d, generator=g), torch.randn(h, m, d, generator=g)
        st = mgr.store(rid, h, d, torch.float32, "cpu", layer=f"L{layer}")
        st.append(k, v, torch.arange(m), random_clusters(h, m, c, g))
        stores.append(st)
    return stores


def _run(async_updates: bool, steps: int, seed: int):
    """Interleave steps of several requests and layers (each layer's stores in one pool),
    their layouts on the worker; record every execution buffer."""
    g = torch.Generator().manual_seed(seed)
    cfg = RetroConfig(async_updates=async_updates)
    mgr = WaveBufferManager(cfg)
    stores = [s for rid in ("a", "b", "c") for s in _ingest(mgr, rid, 2, 2, 300, 30, 32, g)]
    schedule = torch.randint(0, len(stores), (steps,), generator=g)
    seen = []
    for i in schedule.tolist():
        ids = torch.stack([torch.randperm(30, generator=g)[:5] for _ in range(2)])
        k, v, pos, n = stores[i].gather(ids, [])
        seen.append((k.clone(), v.clone(), pos.clone(), n.clone()))
    tables = []
    for st in stores:
        st.check_invariants()
        tables.append((st.table.records.copy(), sorted(st._extents)))
    stats = mgr.stats.snapshot()
    mgr.close()
    return seen, tables, stats


def test_async_worker_equals_synchronous_run():
    """Thousands of steps with the worker's layouts racing lookups of other stores:
    identical buffers and identical final tables (no lost or duplicated pages) as a
    synchronous run."""
    steps = 2000
    a_seen, a_tables, a_stats = _run(True, steps, seed=7)
    s_seen, s_tables, s_stats = _run(False, steps, seed=7)
    for (ak, av, ap, an), (sk, sv, sp, sn) in zip(a_seen, s_seen, strict=True):
        assert torch.equal(an, sn) and torch.equal(ap, sp)
        for i in range(ak.shape[0]):
            assert torch.equal(ak[i, :an[i]], sk[i, :sn[i]])
            assert torch.equal(av[i, :an[i]], sv[i, :sn[i]])
    for (ar, ae), (sr, se) in zip(a_tables, s_tables, strict=True):
        assert np.array_equal(ar, sr) and ae == se
    for key in ("device_cache_miss_clusters", "miss_tokens", "host_to_device_bytes"):
        assert a_stats[key] == s_stats[key] > 0
    assert a_stats["updates_done"] == a_stats["updates_submitted"]


def test_memory_returns_to_zero_after_finish_and_abort(rng):
    mgr = WaveBufferManager(RetroConfig())
    done = _ingest(mgr, "finished", 3, 2, 400, 40, 32, rng)
    aborted = _ingest(mgr, "aborted", 3, 2, 400, 40, 32, rng)
    for st in done + aborted:
        st.gather(torch.zeros(2, 3, dtype=torch.int64) + torch.arange(3), [])
    host = mgr.host_bytes()
    assert host > 0 and mgr.stats.host_bytes == host
    mgr.free_request("finished")
    mgr.free_request("aborted")
    assert mgr.host_bytes() == 0 and mgr.live_requests() == []
    assert mgr.stats.host_bytes == 0
    assert mgr.free_request("aborted") is False  # freeing twice is harmless
    mgr.close()
    assert mgr.stats.device_bytes == 0  # execution buffers too
    assert mgr.stats.queue_depth == 0


def test_index_free_releases_its_store(rng):
    mgr = WaveBufferManager()
    k, v = torch.randn(2, 2000, 64, generator=rng), torch.randn(2, 2000, 64, generator=rng)
    idx = WaveIndex.build(k, v, store=mgr.store("r", 2, 64, torch.float32, "cpu"))
    idx.decode(torch.randn(4, 64, generator=rng))
    assert mgr.host_bytes() > 0
    idx.free()
    assert mgr.host_bytes() == 0
    mgr.free_request("r")
    mgr.close()
    assert (mgr.stats.host_bytes, mgr.stats.device_bytes) == (0, 0)


def test_bad_cluster_ids_fail_clearly(rng):
    mgr = WaveBufferManager()
    st = _ingest(mgr, "r", 1, 2, 100, 10, 32, rng)[0]
    with pytest.raises(ValueError, match=r"cluster id 99 is out of range; accepted: 0 to 9"):
        st.gather(torch.full((2, 1), 99), [])
    st.gather(torch.zeros(2, 1, dtype=torch.int64), [])  # the store still works
    mgr.close()


@pytest.mark.parametrize("enabled", [True, False])
def test_worker_errors_reach_the_waiter(enabled):
    worker = UpdateWorker(BufferStats(), enabled=enabled)

    def boom():
        raise RuntimeError("update failed")

    fut = worker.submit(boom)
    with pytest.raises(RuntimeError, match="update failed"):
        worker.wait(fut)
    assert worker.wait(worker.submit(lambda: 3)) == 3  # the worker survives
    worker.shutdown()
