"""The host pool's pinning lifecycle against a strict fake of the CUDA driver
(:mod:`tests.buffer.fake_driver`): no range registered twice, no registered memory unmapped,
nothing registered after the pool is freed."""

import numpy as np
import pytest
import torch

from tests.buffer.fake_driver import StrictDriver
from tests.fixtures import random_clusters
from vllm_retro.buffer import BufferStats, LayerPool, WaveBufferManager
from vllm_retro.buffer.host_tier import PIN_CHUNK, HostTier, bits
from vllm_retro.buffer.store import WaveBufferStore
from vllm_retro.config import RetroConfig


def test_the_fake_driver_refuses_what_the_cuda_driver_refuses():
    drv = StrictDriver()
    mm = drv.map(1 << 20)
    ptr = drv.mappings.copy().popitem()[0]
    drv.register(ptr, 4096)
    with pytest.raises(AssertionError, match="double registration"):
        drv.register(ptr + 4095, 10)
    with pytest.raises(AssertionError, match="not mapped"):
        drv.register(ptr + (1 << 20) - 4096, 8192)
    with pytest.raises(AssertionError, match="not a registered start"):
        drv.unregister(ptr + 64)
    drv.register(ptr + 4096, 4096)  # adjacent: fine
    with pytest.raises(AssertionError, match="left registered"):
        drv.close()
    drv.unregister(ptr)
    drv.unregister(ptr + 4096)
    del mm  # unmapped, nothing registered: fine
    drv.close()


def test_the_fake_driver_catches_registered_memory_unmapped():
    drv = StrictDriver()
    mm = drv.map(1 << 16)
    ptr = next(iter(drv.mappings))
    drv.register(ptr, 4096)
    del mm  # the last reference: unmapped
    with pytest.raises(AssertionError, match="unmapped while"):
        drv.check()
    other = drv.map(1 << 16)
    with pytest.raises(AssertionError, match="unmapped while"):
        drv.register(next(iter(drv.mappings)), 4096)
    del other


def _pool(driver, stats, d=8, page=4, dtype=torch.float32, register=None, **kw):
    return HostTier(d, page, dtype, stats, pin=True, mapper=driver.map, fence=driver.fence,
                    pinner=(register or driver.register, driver.unregister), **kw)


def _write(host, first, pages, value):
    rows = np.arange(first * host.page_size, (first + pages) * host.page_size)
    kv = np.full((rows.size, host.head_dim), value, bits(host.k).dtype)
    host.write_rows(rows, kv, kv, rows)


def _free(host, driver):
    """Free ``host``; its ranges were unregistered after one fence, none is left."""
    at = len(driver.log)
    host.free()
    assert driver.log[at] == "fence" and set(driver.log[at + 1:]) == {"unregister"}
    driver.close()


def test_a_growing_pinned_pool_keeps_what_it_registered_mapped_until_free(driver):
    """Without a reservation the pool grows, several times, as requests claim and release
    extents: every range registered, in the current pool or one replaced, stays mapped and
    registered once until free() unregisters it after the fence."""
    stats = BufferStats()
    host = _pool(driver, stats)
    rng = np.random.default_rng(0)
    live = []  # (first page, pages, value written) of each request's extent
    for i in range(16):
        pages = int(rng.integers(1, 40))
        first = host.reserve(pages, headroom=8)
        _write(host, first, pages, i + 1)
        live.append((first, pages, i + 1))
        if i % 3 == 2:  # a request finishes
            host.release(*live.pop(0)[:2])
        if i % 4 == 3:  # the worker makes room for the next block
            host.ensure_room(64)
        driver.check()
    assert host.generation >= 4
    for first, pages, value in live:  # growth kept every page
        assert (bits(host.k)[first:first + pages] == value).all()
        assert (bits(host.v)[first:first + pages] == value).all()
    assert len(driver.registered) == 2 * host.generation  # K and V of every pool, once
    assert stats.host_bytes == sum(driver.registered.values())
    _free(host, driver)
    assert stats.host_bytes == 0 and host.capacity_pages == 0


def test_a_reserved_pinned_pool_is_registered_in_chunks_and_never_remapped(driver):
    """With a reservation the pool is mapped once and registered chunk by chunk as its
    used pages rise; a claim past the reservation fails clearly and changes nothing,
    room-making for the next block leaves the pool as it is, and free() unregisters all."""
    stats = BufferStats()
    d, ps = 128, 8
    page = ps * d * 2  # bytes of one page of K (or V)
    chunk = PIN_CHUNK // page
    host = _pool(driver, stats, d, ps, torch.bfloat16, reserve_pages=3 * chunk)
    a = host.reserve(10)
    assert driver.covered(host.k) == driver.covered(host.v) == PIN_CHUNK
    assert len(driver.registered) == 2 and stats.host_bytes == 2 * PIN_CHUNK
    b = host.reserve(chunk)  # past the first chunk: the next one
    assert driver.covered(host.k) == driver.covered(host.v) == 2 * PIN_CHUNK
    _write(host, b, 1, 7)
    host.release(b, chunk)  # pinned memory stays (locked pages)
    assert (bits(host.k)[b] == 7).all()
    assert host.nbytes() == 4 * PIN_CHUNK == stats.host_bytes
    k = host.k
    with pytest.raises(RuntimeError, match="pinned host pool is full"):
        host.reserve(3 * chunk)
    assert host.ensure_room(3 * chunk) is False
    assert host.k is k and host.generation == 1 and host.used_pages == 10
    assert len(driver.registered) == 4 and driver.log.count("register") == 4
    c = host.reserve(3 * chunk - 10)  # what fits still fits: the rest of the reservation
    assert c == 10 and driver.covered(host.k) == 3 * chunk * page
    host.release(a, 10)
    host.release(c, 3 * chunk - 10)
    assert driver.log.count("register") == 6 and host.generation == 1
    _free(host, driver)
    assert stats.host_bytes == 0


def _flaky(driver, fail_at):
    """A register that fails (as cudaHostRegister does without lockable memory) at the
    registrations numbered in ``fail_at`` (0 the first)."""
    calls = []

    def register(ptr, nbytes):
        calls.append(ptr)
        if len(calls) - 1 in fail_at:
            raise RuntimeError("pinning failed (cudaHostRegister error 2)")
        driver.register(ptr, nbytes)

    return register


def test_a_failed_registration_leaves_nothing_registered_and_the_claim_undone(driver):
    """A registration that fails (the pool's V after its K) fails the claim, undoes the
    other's, and leaves the pool as it was: a retry registers each range once."""
    stats = BufferStats()
    d, ps = 128, 8
    chunk = PIN_CHUNK // (ps * d * 2)
    host = _pool(driver, stats, d, ps, torch.bfloat16, reserve_pages=2 * chunk,
                 register=_flaky(driver, {3}))
    host.reserve(10)
    with pytest.raises(RuntimeError, match="error 2"):
        host.reserve(chunk)  # K's second chunk registered, V's refused
    driver.check()
    assert host.used_pages == 10 and len(driver.registered) == 2
    assert host.reserve(chunk) == 10 and len(driver.registered) == 4
    _free(host, driver)


def test_a_failed_registration_in_growth_keeps_the_old_pool(driver):
    """Growth whose new pool cannot be registered fails, leaves the old pool in place and
    no byte of the new one registered (nor unmapped while registered)."""
    stats = BufferStats()
    host = _pool(driver, stats, register=_flaky(driver, {3}))
    first = host.reserve(20)
    _write(host, first, 20, 5)
    k = host.k
    with pytest.raises(RuntimeError, match="error 2"):
        host.ensure_room(1000)  # the new pool's K registered, its V refused
    del k  # no reader holds the old pool: it is the pool's own
    driver.check()
    assert host.generation == 1 and len(driver.registered) == 2
    assert (bits(host.k)[:20] == 5).all()
    assert host.ensure_room(1000) and host.generation == 2
    assert (bits(host.k)[:20] == 5).all()
    _free(host, driver)


def test_a_pool_serving_the_cpu_is_never_pinned(monkeypatch):
    """Pinning is the owner's decision, from the device its pool serves: a CPU layer's
    pool stays unpinned (and unfenced) on a machine with CUDA too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = LayerPool(2, 8, 4, torch.float32, torch.device("cpu"), BufferStats())
    assert pool.host.pin is False
    assert HostTier(8, 4, torch.float32, BufferStats()).pin is False
    first = pool.host.reserve(3)  # the CUDA driver is never called (it would fail here)
    pool.host.release(first, 3)
    pool.release()


def _blocks(h, d, g, dtype, n=4):
    """A prefill block and update blocks of random keys, values and clusterings:
    (keys [h, m, d], values, positions [m], clusters) each."""
    out, at = [], 0
    for i, (m, c) in enumerate([(700, 40)] + [(64, 4)] * (n - 1)):
        k = torch.randn(h, m, d, generator=g).to(dtype)
        v = torch.randn(h, m, d, generator=g).to(dtype)
        if i == 0:
            k[1, 5, 3] = float("nan")  # a NaN key lands where its token goes, and only there
        out.append((k, v, torch.arange(at, at + m), random_clusters(h, m, c, g)))
        at += m
    return out


def _layer(mgr, h, d, dtype, device, host=None):
    return LayerPool(h, d, mgr.config.page_size, dtype, torch.device(device), mgr.stats,
                     worker=mgr.worker, host=host)


@pytest.mark.parametrize("reserve", [0, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("async_updates", [False, True])
def test_a_block_lands_in_a_pinned_pool_from_its_device_rows_as_the_worker_lays_it_out(
        driver, reserve, dtype, async_updates):
    """Into a pinned pool (the pool a CUDA layer reads by address) a block is laid out in
    page order where it lives and copied into its extent in one piece, no staging buffer:
    every page, position and table entry equals the CPU pool's, where the worker
    scatters the block row by row; with a reservation (never remapped: the copy runs
    outside the pool's lock) and without (growing: under it), stores of two requests
    interleaved, one freed and its extent reused. Freed, nothing stays registered."""
    h, d = 2, 16
    cfg = RetroConfig(async_updates=async_updates)
    g = torch.Generator().manual_seed(7)
    reqs = {rid: _blocks(h, d, g, dtype) for rid in ("a", "b", "c")}
    mgr = WaveBufferManager(cfg)
    pinned = HostTier(d, cfg.page_size, dtype, mgr.stats, pin=True, mapper=driver.map,
                      fence=driver.fence, pinner=(driver.register, driver.unregister),
                      reserve_pages=reserve)
    layers = [_layer(mgr, h, d, dtype, "cpu"), _layer(mgr, h, d, dtype, "cpu", pinned)]
    stores: list[dict[str, WaveBufferStore]] = [{}, {}]
    # a and b interleave; a finishes and c takes its pages
    for event in ["a0", "b0", "a1", "b1", "-a", "c0", "b2", "c1", "b3", "c2", "c3"]:
        rid, what = event[-2], event[-1]
        for sts, pool in zip(stores, layers, strict=True):
            if event.startswith("-"):
                sts.pop(what).free()
                continue
            if rid not in sts:
                sts[rid] = WaveBufferStore(pool, cfg, mgr.exec_buffer, rid)
            sts[rid].append(*reqs[rid][int(what)])
            for st in sts.values():  # where a claim lands must not depend on the worker's
                st.sync()            # speed against the frees (first fit)
    for sts in stores:
        for st in sts.values():
            st.sync()
    plain, pin = (p.host for p in layers)
    assert pin.used_pages == plain.used_pages and pin.free_extents == plain.free_extents
    used = plain.used_pages
    rows = used * cfg.page_size
    assert torch.equal(pin.positions[:rows], plain.positions[:rows])
    tokens = (plain.positions[:rows] >= 0).numpy()  # padding rows may hold a freed extent's
    for a, b in ((pin.k, plain.k), (pin.v, plain.v)):
        assert np.array_equal(bits(a).reshape(-1, d)[:rows][tokens],
                              bits(b).reshape(-1, d)[:rows][tokens])
    assert torch.isnan(pin.k.view(-1, d)[:rows][tokens]).sum() == 2  # b's and c's NaN key
    for rid in ("b", "c"):
        a, b = stores[0][rid].table, stores[1][rid].table
        assert np.array_equal(a.page_start, b.page_start) and np.array_equal(a.size, b.size)
    assert mgr.stats.bytes_offloaded > 0
    for sts in stores:
        for st in sts.values():
            st.free()
    assert pin.capacity_pages == 0  # the layer's last store gave the pool back
    mgr.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_layers_blocks_land_in_its_pinned_pool_and_decode_as_on_cpu():
    """On CUDA: the blocks reach the registered pool by one device-to-host copy each (no
    ``pin_memory=True`` staging, so torch's pinned allocator is never asked), and the
    pages, positions and a gather from the pinned pool equal a CPU layer's."""
    h, d = 2, 64
    dtype = torch.bfloat16
    cfg = RetroConfig()
    g = torch.Generator().manual_seed(3)
    blocks = _blocks(h, d, g, dtype)
    ids = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(h)])
    handed_out = _pinned_allocator_counts()
    out = []
    for device in ("cpu", "cuda"):
        mgr = WaveBufferManager(cfg, pool_reserve_bytes=256 << 20)
        st = mgr.store("r", h, d, dtype, device, layer="L0")
        for k, v, pos, cl in blocks:
            st.append(k.to(device), v.to(device), pos.to(device), cl)
        st.sync()
        used = st.host.used_pages
        got = [st.host.k[:used].clone(), st.host.v[:used].clone(),
               st.host.positions[:used * cfg.page_size].clone()]
        for _ in range(3):
            ek, ev, epos, elen = st.gather(ids.to(device), [])
            got += [ek.cpu(), ev.cpu(), epos.cpu(), elen.cpu()]
        out.append(got)
        mgr.close()
    for a, b in zip(*out, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    assert _pinned_allocator_counts() == handed_out


def _pinned_allocator_counts() -> dict:
    """torch's pinned-memory allocator's running totals (blocks handed out, created): they
    only grow, so equal totals mean it was not asked for memory in between."""
    stats = getattr(torch.cuda, "host_memory_stats", dict)()
    return {k: v for k, v in stats.items()
            if k.endswith(".allocated") or k in ("num_host_alloc", "num_alloc")}


@pytest.mark.parametrize("reserve", [0, 512])
def test_a_block_whose_copy_fails_gives_its_extent_back(driver, reserve, monkeypatch):
    """A copy into the pool that fails (a device error) raises, and the pages claimed for
    it go back: nobody was told of them, so nothing else would ever free them."""
    stats = BufferStats()
    host = _pool(driver, stats, reserve_pages=reserve)
    first = host.reserve(3)
    rows = torch.ones(2 * host.page_size, host.head_dim)
    positions = np.arange(2 * host.page_size)

    def broken(*_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(host, "_copy_in", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        host.claim_rows(rows, rows, positions)
    assert host.allocated_pages == 3 and host.used_pages == first + 3
    monkeypatch.undo()
    assert host.claim_rows(rows, rows, positions) == first + 3  # the same pages, reused
    assert (host.positions[(first + 3) * host.page_size:][:positions.size].numpy()
            == positions).all()
    _free(host, driver)
