"""vllm_retro.index.resident: a layer decodes from device-resident KV where the config says
so — through decode_batch, equal to the per-row reference, grown as its batch grows, and not
at all where it does not apply."""

import pytest
import torch

from tests.helpers import random_indexes
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index.batched import append_batch, decode_batch
from vllm_retro.index.device_layer import (
    cache_block_size,
    cache_blocks_for,
    decode_given_step,
    decode_step,
)
from vllm_retro.index.meta_pool import MetaPool
from vllm_retro.index.padded import MetaViewCache
from vllm_retro.index.pages import PAGE_INDEXES
from vllm_retro.index.resident import (
    CacheCounts,
    in_place_capable,
    placement,
)
from vllm_retro.index.saap import SaapIndex
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model
from vllm_retro.index.steady import SteadyPool, ring_size
from vllm_retro.kernels.cluster_cache import ClusterCache
from vllm_retro.kernels.sync_check import SyncCheck


def _cfg(**kw):
    base = dict(segment_size=512, update_segment=64, update_clusters=4, local_window=16,
                sink_tokens=4, kmeans_iters=3, kernel_backend="torch", device_resident="on")
    base.update(kw)
    return RetroConfig(**base)


def _pool(cfg, h, d, dtype, slots):
    return SteadyPool(h, d, cfg.sink_tokens, ring_size(cfg.local_window, cfg.update_segment),
                      dtype, "cpu", slots=slots, zeroed=True)


def _adopt(indexes, steady):
    """The indexes' steady zones into ``steady`` (slot by slot) and their meta rows into one
    layer meta pool, as a layer's requests are kept in serving; the meta pool."""
    meta = MetaPool(*indexes[0].meta_pool_layout())
    for slot, index in enumerate(indexes):
        index.adopt_steady(steady, slot)
        index.adopt_meta(meta)
    return meta


@pytest.mark.parametrize("wave_buffer,mode", [(True, "on"), (False, "on"), (True, "in_place")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_batch_decodes_resident_layers_as_the_reference(wave_buffer, mode, dtype, tol):
    """A layer's rows in one steady pool, decoded through decode_batch as the route does
    (append_batch, then decode_batch with the layer's cache): 90 steps through update blocks
    (incremental loads); a request leaves and a longer one joins in its slot (a full load and
    a grown layer). The tokens copied into the layer, or read in place from the wave
    buffer's host tier. The meta rows are in the layer's meta pool (as serving keeps them),
    and the layer reads them there."""
    g = torch.Generator().manual_seed(11)
    cfg = _cfg(device_resident=mode)
    h, d = 2, 64
    mgr = WaveBufferManager(cfg) if wave_buffer else None
    indexes = random_indexes([40, 700, 1300], cfg, h, d, dtype, g, mgr)
    pool = _pool(cfg, h, d, dtype, 3)
    meta = _adopt(indexes, pool)
    cache = MetaViewCache()
    updates, grown = 0, set()
    for step in range(90):
        if step == 40:  # a request leaves; a longer one takes its slot
            old = indexes.pop(1)
            slot = old.slot
            old.free()
            new = random_indexes([3000], cfg, h, d, dtype, g, mgr, first=5)[0]
            new.adopt_steady(pool, slot)
            new.adopt_meta(meta)
            indexes.insert(1, new)
        keys, values = torch.randn(2, len(indexes), h, d, generator=g).to(dtype)
        updates += append_batch(indexes, keys, values)[0]
        q = torch.randn(len(indexes), h * 4, d, generator=g).to(dtype)
        out = decode_batch(indexes, q, d ** -0.5, cache=cache)
        grown.add(id(cache.resident.layer))
        with SyncCheck():  # loaded now: asking again reads nothing from the device
            assert cache.resident.applies(indexes, q)
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                   msg=f"step {step}")
    assert updates >= 2 and len(grown) == 2  # one growth for the 3000-token request
    assert cache.resident.layer.in_place == (mode == "in_place")
    assert cache.resident.layer.meta is meta
    if mode == "in_place":  # the device cache budget as a cluster cache, and it served reads
        assert min(cache.resident.layer.cache_tokens()) > 0
        # its counts reach the buffer's statistics (the server's device cache metrics),
        # those of the layer replaced at the growth included
        last = cache.resident.layer.cache.counts.sum(0).tolist()
        snap = mgr.stats.snapshot()
        assert snap["hit_tokens"] > last[0] and snap["device_cache_hit_clusters"] > last[2] > 0
        assert snap["device_cache_miss_clusters"] > last[3] > 0
        assert snap["host_to_device_bytes"] == snap["miss_tokens"] * 2 * d * torch.empty(
            0, dtype=dtype).element_size()
    else:
        assert cache.resident.layer.cache is None
    assert cache.nbytes() >= cache.resident.nbytes() > 0
    cache.clear()
    assert cache.resident.layer is None
    if mgr:
        for index in indexes:
            index.free()
        mgr.close()


def _policy_indexes(policy, cfg, lengths, h, d, dtype, g, mgr, device="cpu"):
    """Indexes of a policy choosing its own clusters, over the wave buffer stores of one
    layer pool."""
    out = []
    for n in lengths:
        k, v = (torch.randn(h, n, d, generator=g).to(device, dtype) for _ in range(2))
        store = mgr.store(f"r{len(out)}-{n}", h, d, dtype, device, layer="L0")
        if policy == "saap":
            identity = ModelIdentity("test", 3, h * 4, h, d, 10000.0, "0123456789abcdef")
            model = random_saap_model(identity, 32, 48, torch.Generator().manual_seed(3))
            out.append(SaapIndex.build(k, v, cfg, store=store, model=model, layer=1))
        else:
            out.append(PAGE_INDEXES[policy].build(k, v, cfg, store=store))
    return out


@pytest.mark.parametrize("policy", ["quest", "streaming", "saap"])
@pytest.mark.parametrize("mode,cache_on", [("on", False), ("in_place", False),
                                           ("in_place", True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_policies_choosing_their_clusters_decode_on_the_device_step(policy, mode, cache_on,
                                                                    dtype, tol):
    """The baselines decode on the device step too, read in place or copied, through the
    cluster cache or not, equal to the per-row reference through update blocks, the step
    free of host synchronisation: Quest's pages scored there by their bounds (rows twice
    the head dimension, the query split by sign), SAAP's and StreamingLLM's clusters chosen
    by the policy (select_batch) and read as given (no zones, nothing scored). The meta
    rows read in the layer's meta pool."""
    g = torch.Generator().manual_seed(21)
    cfg = _cfg(device_resident=mode, cache_fraction=0.1 if cache_on else 0.0,
               min_retrieval_clusters=0 if not cache_on else 16,
               quest_token_budget=96, streaming_tokens=64, saap_probes=4)
    h, d = 2, 64
    mgr = WaveBufferManager(cfg)
    indexes = _policy_indexes(policy, cfg, [300, 900, 1400], h, d, dtype, g, mgr)
    pool = _pool(cfg, h, d, dtype, 3)
    meta = _adopt(indexes, pool)
    cache = MetaViewCache()
    updates = 0
    for step in range(80):
        keys, values = torch.randn(2, len(indexes), h, d, generator=g).to(dtype)
        updates += append_batch(indexes, keys, values)[0]
        q = torch.randn(len(indexes), h * 4, d, generator=g).to(dtype)
        out = decode_batch(indexes, q, d ** -0.5, cache=cache)
        layer = cache.resident.layer
        assert layer is not None and layer.in_place == (mode == "in_place")
        assert layer.meta is meta
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                   msg=f"step {step}")
    assert updates >= 2
    if cache_on:
        assert layer.cache is not None and min(layer.cache_tokens()) > 0
    # the step itself, on the loaded layer: no operation that would wait for the device
    slots = [i.slot for i in indexes]
    assert layer.score_dim == (2 * d if policy == "quest" else d)
    if policy == "quest":
        plan = layer.plan(slots, indexes)
        assert plan.estimation == 0 and plan.ints[4].tolist() == [0, 0, 0]
        assert plan.ints[3].tolist() == [i.zone_sizes(i.num_clusters)[0] for i in indexes]
        with SyncCheck():
            again = decode_step(layer, plan, q, d ** -0.5)
    else:
        ids, counts = indexes[0].select_batch(indexes, q, d ** -0.5)
        plan = layer.plan(slots, indexes, given=counts)
        assert plan.estimation == 0 and plan.ints[3].tolist() == counts
        with SyncCheck():
            again = decode_given_step(layer, plan, q, ids, d ** -0.5)
    torch.testing.assert_close(again.float(), ref.float(), rtol=tol, atol=tol)
    cache.clear()
    for index in indexes:
        index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("policy", ["quest", "streaming", "saap"])
@pytest.mark.parametrize("cache_on", [False, True])
def test_the_baselines_device_step_with_triton_kernels(triton_device, policy, cache_on):
    """The baselines' device step with the Triton kernels (the CUDA configuration; on the
    CPU under the interpreter): equal to the per-row reference and free of host
    synchronisation in at most 8 launches: Quest's query split, its pages scored and
    ranked; or the given clusters padded; then the cache's lookup and the attention's two
    kernels."""
    if triton_device != "cpu":
        pytest.skip("runs the indexes on the CPU")
    g = torch.Generator().manual_seed(23)
    cfg = _cfg(device_resident="in_place", kernel_backend="triton",
               cache_fraction=0.1 if cache_on else 0.0, quest_token_budget=96,
               streaming_tokens=64, saap_probes=4)
    h, d = 2, 32
    mgr = WaveBufferManager(cfg)
    indexes = _policy_indexes(policy, cfg, [300, 700], h, d, torch.float32, g, mgr)
    pool = _pool(cfg, h, d, torch.float32, 2)
    _adopt(indexes, pool)
    cache = MetaViewCache()
    for _ in range(3):
        keys, values = torch.randn(2, 2, h, d, generator=g)
        append_batch(indexes, keys, values)
        q = torch.randn(2, h * 4, d, generator=g)
        out = decode_batch(indexes, q, d ** -0.5, cache=cache)
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        layer = cache.resident.layer
        check = SyncCheck()
        if policy == "quest":
            plan = layer.plan([0, 1], indexes)
            with check:
                again = decode_step(layer, plan, q, d ** -0.5)
        else:
            ids, counts = indexes[0].select_batch(indexes, q, d ** -0.5)
            plan = layer.plan([0, 1], indexes, given=counts)
            with check:
                again = decode_given_step(layer, plan, q, ids, d ** -0.5)
        torch.testing.assert_close(again, ref, rtol=1e-4, atol=1e-4)
        assert check.launches <= 8, check.ops
    assert (layer.cache is not None) == cache_on
    cache.clear()
    for index in indexes:
        index.free()
    mgr.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["quest", "saap"])
@pytest.mark.parametrize("mode", ["on", "in_place"])
def test_the_baselines_device_step_on_cuda_replays_from_a_graph(policy, mode):
    """On a GPU: Quest (scored on the device) and SAAP (its clusters given, a static input
    of the graph) decode through the layer's graphs, equal to the per-row reference; the
    step itself passes ``torch.cuda.set_sync_debug_mode("error")``."""
    g = torch.Generator().manual_seed(25)
    dtype, dev = torch.bfloat16, torch.device("cuda")
    cfg = _cfg(device_resident=mode, kernel_backend="auto", quest_token_budget=96,
               saap_probes=4)
    h, d = 2, 64
    mgr = WaveBufferManager(cfg)
    indexes = _policy_indexes(policy, cfg, [700, 1500], h, d, dtype, g, mgr, dev)
    pool = SteadyPool(h, d, cfg.sink_tokens, ring_size(cfg.local_window, cfg.update_segment),
                      dtype, dev, slots=2, zeroed=True)
    _adopt(indexes, pool)
    cache = MetaViewCache()
    for _ in range(4):
        keys, values = torch.randn(2, 2, h, d, generator=g).to(dev, dtype)
        append_batch(indexes, keys, values)
        q = torch.randn(2, h * 4, d, generator=g).to(dev, dtype)
        out = decode_batch(indexes, q, d ** -0.5, cache=cache)
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    layer = cache.resident.layer
    assert layer is not None and cache.resident.graphs.captures >= 1
    if policy == "quest":  # scored on the device
        plan = layer.plan([0, 1], indexes)
        step = lambda: decode_step(layer, plan, q, d ** -0.5)  # noqa: E731
    else:
        ids, counts = indexes[0].select_batch(indexes, q, d ** -0.5)
        plan = layer.plan([0, 1], indexes, given=counts)
        step = lambda: decode_given_step(layer, plan, q, ids, d ** -0.5)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(eager.float(), ref.float(), rtol=1e-2, atol=1e-2)
    cache.clear()
    torch.cuda.synchronize()
    for index in indexes:
        index.free()
    mgr.close()


def test_cache_blocks_for_the_device_cache_budget():
    """An in-place layer's cluster cache takes the wave buffer's device cache budget:
    RetroConfig.cache_tokens of a row's tokens, in whole blocks."""
    assert cache_blocks_for(_cfg(), 128 * 1024, 32) == 205  # 5% of 128K tokens: 6554
    assert cache_blocks_for(_cfg(), 4096, 32) == 45  # 1423 tokens: 2.8x the retrieval floor
    assert cache_blocks_for(_cfg(cache_fraction=0.1, min_retrieval_clusters=0), 1000, 32) == 4
    assert cache_blocks_for(_cfg(cache_pages=10), 1 << 20, 32) == 3  # 80 tokens
    assert cache_blocks_for(_cfg(cache_fraction=0.0), 1 << 20, 32) == 0
    assert cache_block_size(16) == 20 and cache_block_size(1) == 1


def test_resident_path_only_where_it_applies():
    g = torch.Generator().manual_seed(12)
    h, d = 2, 32
    for mode in ("auto", "off"):  # auto: CUDA only
        cfg = _cfg(device_resident=mode)
        indexes = random_indexes([300, 500], cfg, h, d, torch.float32, g)
        pool = _pool(cfg, h, d, torch.float32, 2)
        for slot, index in enumerate(indexes):
            index.adopt_steady(pool, slot)
        cache = MetaViewCache()
        assert not cache.resident.applies(indexes, torch.zeros(2, h, d))
        assert cache.resident.layer is None
    # steady zones in pools of their own: not one layer's batch
    cfg = _cfg()
    indexes = random_indexes([300, 500], cfg, h, d, torch.float32, g)
    assert not MetaViewCache().resident.applies(indexes, torch.zeros(2, h, d))
    # one steady pool, but the meta rows each in the index's own pool: the layer reads them
    # where the attention layer keeps them, so not here either
    pool = _pool(cfg, h, d, torch.float32, 2)
    for slot, index in enumerate(indexes):
        index.adopt_steady(pool, slot)
    cache = MetaViewCache()
    assert not cache.resident.applies(indexes, torch.zeros(2, h, d))
    _adopt(indexes, pool)
    assert MetaViewCache().resident.applies(indexes, torch.zeros(2, h, d))


def test_auto_copies_what_fits_and_reads_the_rest_in_place():
    assert placement(100, 10, 100, True) == "copy"
    assert placement(101, 10, 100, True) == "in_place"
    assert placement(101, 10, 100, False) is None  # tokens not in one pool the device reads
    assert placement(101, 101, 100, True) is None


def test_in_place_only_over_one_pool():
    """Dense stores (a pool each) or two layers' host tiers: not read in place."""
    g = torch.Generator().manual_seed(13)
    h, d = 2, 32
    cfg = _cfg(device_resident="in_place")
    dense = random_indexes([300, 500], cfg, h, d, torch.float32, g)
    assert not in_place_capable(dense, torch.device("cpu"))
    mgr = WaveBufferManager(cfg)
    one = random_indexes([300, 500], cfg, h, d, torch.float32, g, mgr)
    two = random_indexes([300], cfg, h, d, torch.float32, g, mgr, layer="L1", first=2)
    assert in_place_capable(one, torch.device("cpu"))
    assert not in_place_capable(one + two, torch.device("cpu"))
    pool = _pool(cfg, h, d, torch.float32, 3)
    _adopt(one + two, pool)
    cache = MetaViewCache()
    assert cache.resident.applies(one, torch.zeros(2, h, d))
    assert not cache.resident.applies(one + two, torch.zeros(3, h, d))
    out = decode_batch(one + two, torch.randn(3, h, d, generator=g), d ** -0.5, cache=cache)
    assert not out.isnan().any()  # served by the host tier's path
    for index in one + two:
        index.free()
    mgr.close()


def test_a_growth_between_two_reads_is_one_pool(monkeypatch):
    """The update worker swaps a grown pool in between the reads of two stores of one host
    tier (a block landing, or another request's layout, as a batch loads; seen under a
    loaded machine): the batch is read again and still read in place, not refused until its
    meta index changes. The stores' own room growths, queued after their layouts, are still
    running here as they may in serving."""
    g = torch.Generator().manual_seed(14)
    h, d = 2, 32
    cfg = _cfg(device_resident="in_place")
    mgr = WaveBufferManager(cfg)
    one = random_indexes([300, 500], cfg, h, d, torch.float32, g, mgr)
    store = one[1].store
    read = store.cluster_rows
    old = one[0].store.cluster_rows(wait=False)[0].data_ptr()

    def after_a_swap(wait=True):  # the first store was read before the pool grew, twice
        if len(calls) < 2:
            calls.append(wait)
            store.host.ensure_room(store.host.capacity_pages + 1)
        return read(wait=wait)

    calls: list[bool] = []
    monkeypatch.setattr(store, "cluster_rows", after_a_swap)
    assert in_place_capable(one, torch.device("cpu"))
    assert calls == [False, False]
    assert one[0].store.cluster_rows(wait=False)[0].data_ptr() != old  # it did grow
    for index in one:
        index.free()
    mgr.close()


class _Sink:
    def __init__(self):
        self.totals: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        for k, v in deltas.items():
            self.totals[k] = self.totals.get(k, 0) + v


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                        reason="needs a CUDA GPU"))])
def test_cache_counts_reach_the_statistics_without_waiting(device):
    """On CUDA a report never waits: it takes the copy an earlier report started once it has
    landed (checked under the sync debug mode); a report with ``wait`` takes everything."""
    cache = ClusterCache.allocate(3, 10, 4, 8, 16, torch.bfloat16, device)
    sink = _Sink()
    counts = CacheCounts(sink)
    cache.counts.add_(torch.tensor([5, 7, 2, 3], device=device))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        counts.report(cache)
        if device == "cuda":
            torch.cuda.synchronize()
        counts.report(cache)  # the first copy has landed
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert sink.totals == {"hit_tokens": 15, "miss_tokens": 21, "device_cache_hit_clusters": 6,
                           "device_cache_miss_clusters": 9, "host_to_device_bytes": 21 * 2 * 16 * 2}
    cache.counts[0, 0] += 1
    counts.report(cache, wait=True)
    assert sink.totals["hit_tokens"] == 16 and sink.totals["miss_tokens"] == 21
