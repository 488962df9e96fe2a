"""vllm_retro.index.device_layer: the device-resident decode step equals the per-row reference
on mixed batches through update blocks, joins and departures, and never synchronises with the
device (held to it on CPU tensors under kernels.sync_check.SyncCheck)."""

import pytest
import torch

from tests.helpers import equivalence_cases, random_indexes
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index.device_layer import DeviceLayer, decode_step
from vllm_retro.index.meta_pool import MetaPool
from vllm_retro.index.steady import SteadyPool, ring_size
from vllm_retro.kernels.step_plan import PLAN_FIELDS
from vllm_retro.kernels.sync_check import SyncCheck


def _cfg(**kw):
    base = dict(segment_size=512, update_segment=64, update_clusters=4, local_window=16,
                sink_tokens=4, kmeans_iters=3, kernel_backend="torch")
    base.update(kw)
    return RetroConfig(**base)


def _shared_steady(indexes, cfg, slots, capacity=0):
    """Move the indexes' steady zones into one layer pool (as serving does), in ``slots``
    (of at least ``capacity``), and their meta rows into one layer meta pool."""
    first = indexes[0]
    pool = SteadyPool(first.num_kv_heads, first.head_dim, cfg.sink_tokens,
                      ring_size(cfg.local_window, cfg.update_segment),
                      first.centroids.dtype, "cpu", slots=max(max(slots) + 1, capacity),
                      zeroed=True)
    for index, slot in zip(indexes, slots, strict=True):
        index.adopt_steady(pool, slot)
    _shared_meta(indexes)
    return pool


def _layer(cfg, first, slots=8, clusters=256, tokens=4096, in_place=False, cache_blocks=0):
    """A layer over ``first``'s meta pool (moved into one first when it has its own)."""
    meta = (first.meta_place() or (_shared_meta([first]),))[0]
    return DeviceLayer(cfg, first.num_kv_heads, first.head_dim, first.centroids.dtype, "cpu",
                       slots=slots, max_clusters=clusters, max_tokens=tokens,
                       rank=first.residuals.rank, meta=meta, in_place=in_place,
                       cache_blocks=cache_blocks, cache_block_tokens=8)


def _shared_meta(indexes, pool=None):
    """Move the indexes' meta rows into one layer meta pool (as serving does); the pool."""
    pool = pool or MetaPool(*indexes[0].meta_pool_layout())
    for index in indexes:
        index.adopt_meta(pool)
    return pool


def _step(layer, slots, indexes, q, scale, check=None):
    layer.refresh(slots, indexes)
    plan = layer.plan(slots, indexes)
    if check is None:
        return decode_step(layer, plan, q, scale)
    with check:
        return decode_step(layer, plan, q, scale)


@pytest.mark.parametrize("dtype,tol,estimator,store,group,d", equivalence_cases(
    [(1, 64), (4, 128)], ["dense", "wave_buffer", "in_place", "in_place_cache"]))
def test_decode_step_equals_per_row_decode(dtype, tol, estimator, store, group, d):
    """Rows of different lengths (one dense) in scattered slots, 70 steps crossing update
    blocks at different steps (reloads); a row finishes mid-run and a new one takes another
    slot. Every step runs under SyncCheck. The indexes' KV is copied into the layer from
    dense stores or from a wave buffer's host tier, or read in place from the host tier
    (its pool grows, and is replaced, as blocks land: the layer reloads its starts), also
    through a small cluster cache (6 blocks of 8 tokens per row: hits, admissions,
    evictions, clusters larger than a block, a slot taken by a new request). The meta rows
    are read in the layer's meta pool (extents growing, moving and freed as blocks land
    and requests come and go)."""
    g = torch.Generator().manual_seed(d + group)
    cfg = _cfg(estimator=estimator)
    h = 2
    mgr = WaveBufferManager(cfg) if store != "dense" else None
    indexes = random_indexes([40, 700, 1300, 333], cfg, h, d, dtype, g, mgr)
    assert indexes[0].is_dense and not indexes[1].is_dense
    if estimator == "auto":  # each row's heads split between the two estimators
        for n, index in enumerate(indexes):
            index.residuals.set_tilted_heads(torch.arange(h) % 2 == n % 2)
    slots = [5, 0, 3, 6]
    _shared_steady(indexes, cfg, [2, 7, 0, 4])
    meta = indexes[0].meta_place()[0]
    layer = _layer(cfg, indexes[0], in_place=store.startswith("in_place"),
                   cache_blocks=6 if store == "in_place_cache" else 0)
    meta_moves = set()
    scale = d ** -0.5
    updates = 0
    launches = set()
    layouts = set()  # the token pools the steps read
    for step in range(70):
        if step == 30:  # a request finishes; another joins in a free slot
            layer.release(slots.pop(2))
            indexes.pop(2).free()
            new = random_indexes([900], cfg, h, d, dtype, g, mgr, first=4)
            new[0].adopt_steady(indexes[0].steady, 1)
            _shared_meta(new, meta)
            indexes += new
            slots.append(2)
        q = torch.randn(len(indexes), h * group, d, generator=g).to(dtype)
        for index in indexes:
            updates += index.append(torch.randn(h, 1, d, generator=g).to(dtype),
                                    torch.randn(h, 1, d, generator=g).to(dtype))
        check = SyncCheck()
        out = _step(layer, slots, indexes, q, scale, check)
        launches.add(check.launches)
        layouts.add(layer.keys.data_ptr())
        meta_moves.add((meta.generation, tuple(i.meta_place()[1] for i in indexes)))
        ref = torch.stack([i.decode(q[b], scale).output for b, i in enumerate(indexes)])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                   msg=f"step {step}")
    assert updates >= 3
    assert len(launches) == 1  # one fixed sequence of operations, whatever the step
    if store.startswith("in_place"):  # the layer reads the host tier's pool itself
        assert layouts == {indexes[0].store.cluster_rows()[0].data_ptr()}
    assert len(meta_moves) >= 3  # read where they were, as the pool moved them
    cached, read = layer.cache_tokens()
    assert (cached > 0 and read > 0) if store == "in_place_cache" else cached == read == 0
    if mgr:
        mgr.close()


def test_the_step_is_one_fixed_sequence_whatever_the_batch():
    """The same operations, in number and kind, for a batch of 1 and of 5 (a CUDA graph per
    batch size replays it); no operation would wait for the device."""
    g = torch.Generator().manual_seed(3)
    cfg = _cfg()
    h, d = 2, 64
    indexes = random_indexes([600, 1200, 90, 2000, 400], cfg, h, d, torch.float32, g)
    _shared_steady(indexes, cfg, [0, 1, 2, 3, 4])
    layer = _layer(cfg, indexes[0])
    counts = []
    for n in (1, 5):
        check = SyncCheck()
        q = torch.randn(n, h * 4, d, generator=g)
        _step(layer, list(range(n)), indexes[:n], q, d ** -0.5, check)
        counts.append(check.ops)
    assert counts[0] == counts[1] and sum(counts[0].values()) > 0
    # (the torch path's ~200 operations are the reference's; CUDA's configuration runs the
    # step in five launches: test_decode_step_with_triton_kernels)


def test_the_plan_holds_each_rows_integers_and_widths_over_every_row():
    """Each column of a plan is its row's integers in PLAN_FIELDS' order (what changes only
    at a load, computed there; the window's place read per step); the widths bound every
    row of the batch, whichever batch came before; with ``upload=False`` the same
    integers (on the CPU the host is the device). The meta rows: the row's extent in the
    layer's meta pool."""
    g = torch.Generator().manual_seed(11)
    cfg = _cfg(update_rounds_per_step=0)
    h, d = 2, 32
    indexes = random_indexes([300, 1500, 700], cfg, h, d, torch.float32, g)
    slots = [2, 0, 1]
    _shared_steady(indexes, cfg, [1, 2, 0])
    meta = indexes[0].meta_place()[0]
    layer = _layer(cfg, indexes[0], slots=3, tokens=2048)
    for _ in range(20):  # windows of different lengths, an update block may land
        for i in indexes:
            i.append(torch.randn(h, 1, d, generator=g), torch.randn(h, 1, d, generator=g))
    for batch in ([0, 1, 2], [0], [2, 0], [1]):
        rows = [indexes[j] for j in batch]
        where = [slots[j] for j in batch]
        layer.refresh(where, rows)
        steps = layer.steps
        plan = layer.plan(where, rows)
        kept = layer.plan(where, rows, upload=False)
        for p, step in ((plan, steps + 1), (kept, steps + 2)):
            expected = {"slot": where, "steady_slot": [i.slot for i in rows],
                        "clusters": [i.num_clusters for i in rows],
                        "retrieval": [cfg.num_retrieval(i.num_clusters) for i in rows],
                        "estimation": [cfg.num_estimation(i.num_clusters) for i in rows],
                        "sinks": [i.num_sinks for i in rows],
                        "ring_start": [i.ring_start for i in rows],
                        "window": [i.win_len for i in rows], "step": [step] * len(rows),
                        "meta_row": [i.meta_place()[1] for i in rows],
                        "meta_stride": [meta.capacity] * len(rows)}
            assert p.ints.dtype == torch.int64
            assert {f: p.ints[n].tolist() for n, f in enumerate(PLAN_FIELDS)} == expected
        most = max(i.num_clusters for i in rows)
        assert plan.clusters == min(-(-most // 64) * 64, layer.max_clusters) >= most
        assert plan.retrieval >= max(expected["retrieval"])
        assert plan.estimation >= max(expected["estimation"])
        bound = max(int(i.sizes.long().sort(1, descending=True).values[
            :, :cfg.num_retrieval(i.num_clusters)].sum(1).max()) for i in rows)
        assert plan.retrieval_tokens >= bound and plan.retrieval_tokens % 64 == 0
        assert (kept.clusters, kept.retrieval_tokens) == (plan.clusters,
                                                          plan.retrieval_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place,cache", [(False, 0), (True, 0), (True, 12)])
def test_footprint_is_what_a_layer_allocates(dtype, in_place, cache):
    """What a layer holds: its tokens (none read in place), each cluster's first token row,
    the residual model, the cluster cache; not the meta rows (the meta pool's)."""
    pool = MetaPool(2, {"sizes": ((), torch.int32)}, "cpu")
    layer = DeviceLayer(_cfg(), 2, 64, dtype, "cpu", slots=3, max_clusters=70, max_tokens=900,
                        rank=4, meta=pool, in_place=in_place, cache_blocks=cache,
                        cache_block_tokens=16)
    assert DeviceLayer.footprint(3, 2, 64, dtype, 70, 900, 4, in_place, cache, 16) == \
        layer.nbytes()
    # read in place, the layer holds no token: 2 x 3 x 2 x 900 x 64 elements fewer
    kv = 2 * 3 * 2 * 900 * 64 * torch.empty(0, dtype=dtype).element_size()
    assert DeviceLayer.footprint(3, 2, 64, dtype, 70, 900, 4, True) == \
        DeviceLayer.footprint(3, 2, 64, dtype, 70, 900, 4, False) - kv
    assert DeviceLayer.footprint(3, 2, 64, dtype, 70, 0, 4, True) == 3 * 2 * (
        70 * 8 + 4 * 64 * (1 + 2 * 4))


def test_read_in_place_follows_the_host_tier_when_its_pool_is_replaced():
    """A request joining the layer's host tier outgrows its pool, which is replaced by a
    larger one (a pool without a reservation): loading the new request moves the layer to
    the new pool, the slots loaded before are reloaded against it, and the step still equals
    the reference."""
    g = torch.Generator().manual_seed(8)
    cfg = _cfg()
    h, d = 2, 32
    mgr = WaveBufferManager(cfg)
    indexes = random_indexes([300, 500], cfg, h, d, torch.float32, g, mgr)
    _shared_steady(indexes, cfg, [0, 1], capacity=3)
    layer = _layer(cfg, indexes[0], clusters=512, tokens=0, in_place=True)
    q = torch.randn(2, h * 2, d, generator=g)
    _step(layer, [0, 1], indexes, q, d ** -0.5)
    before = (indexes[0].store.layout_generation, layer.keys.data_ptr())
    big = random_indexes([6000], cfg, h, d, torch.float32, g, mgr, first=2)
    big[0].adopt_steady(indexes[0].steady, 2)
    _shared_meta(big, layer.meta)
    indexes += big
    big[0].store.cluster_rows()  # (waits until the buffer's worker has laid it out)
    assert indexes[0].store.layout_generation != before[0]  # the pool was replaced
    q = torch.randn(3, h * 2, d, generator=g)
    out = _step(layer, [0, 1, 2], indexes, q, d ** -0.5, SyncCheck())
    assert layer.keys.data_ptr() != before[1]
    ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    mgr.close()


def test_read_in_place_needs_one_pool_the_device_can_read():
    g = torch.Generator().manual_seed(2)
    cfg = _cfg()
    h, d = 2, 32
    mgr = WaveBufferManager(cfg)
    # two layers' pools (as if two models' requests were batched): not one pool
    a = random_indexes([300], cfg, h, d, torch.float32, g, mgr, layer="L0")
    b = random_indexes([300], cfg, h, d, torch.float32, g, mgr, layer="L1", first=1)
    _shared_steady(a + b, cfg, [0, 1])
    layer = _layer(cfg, a[0], in_place=True)
    layer.refresh([0, 1], a + b)
    with pytest.raises(ValueError, match="different pools"):
        layer.plan([0, 1], a + b)
    meta = DeviceLayer(cfg, h, d, torch.float32, "meta", slots=2, max_clusters=256,
                       max_tokens=0, rank=a[0].residuals.rank,
                       meta=MetaPool(h, a[0].meta_fields(torch.float32), "meta"),
                       in_place=True)
    with pytest.raises(ValueError, match="pool is on cpu, unpinned; accepted: on meta, or "
                                         "pinned host memory for a CUDA layer"):
        meta.load(0, a[0])
    mgr.close()


def test_load_rejects_what_does_not_fit_naming_the_bound():
    g = torch.Generator().manual_seed(4)
    cfg = _cfg()
    indexes = random_indexes([3000], cfg, 2, 32, torch.float32, g)
    c = indexes[0].num_clusters
    small = _layer(cfg, indexes[0], clusters=c - 1)
    with pytest.raises(ValueError, match=rf"{c} clusters; accepted: at most {c - 1}"):
        small.load(0, indexes[0])
    layer = _layer(cfg, indexes[0], slots=2, clusters=c, tokens=1000)
    with pytest.raises(ValueError, match=r"indexed tokens per head; accepted: at most 1000"):
        layer.load(0, indexes[0])
    layer = _layer(cfg, indexes[0], slots=2, clusters=c)
    with pytest.raises(ValueError, match=r"slot=2; accepted: 0..1"):
        layer.load(2, indexes[0])
    with pytest.raises(ValueError, match="refresh first"):
        layer.plan([0], indexes)
    with pytest.raises(ValueError, match=r"slots=0; accepted: an integer >= 1"):
        _layer(cfg, indexes[0], slots=0)
    alone = random_indexes([300], cfg, 2, 32, torch.float32, g)[0]  # its own meta pool
    with pytest.raises(ValueError, match="meta rows are not in the layer's meta pool"):
        layer.load(1, alone)


def test_a_stale_slot_is_reloaded_when_its_block_lands():
    """After an update block lands the plan refuses the stale slot until refreshed."""
    g = torch.Generator().manual_seed(6)
    cfg = _cfg(update_rounds_per_step=0)
    h, d = 2, 32
    indexes = random_indexes([700], cfg, h, d, torch.float32, g)
    _shared_steady(indexes, cfg, [0])
    layer = _layer(cfg, indexes[0])
    layer.refresh([0], indexes)
    landed = False
    while not landed:
        landed = indexes[0].append(torch.randn(h, 1, d, generator=g),
                                   torch.randn(h, 1, d, generator=g))
    with pytest.raises(ValueError, match="refresh first"):
        layer.plan([0], indexes)
    q = torch.randn(1, h, d, generator=g)
    out = _step(layer, [0], indexes, q, d ** -0.5)
    torch.testing.assert_close(out[0], indexes[0].decode(q[0], d ** -0.5).output,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("estimator", ["tilted", "centroid"])
@pytest.mark.parametrize("store", ["dense", "in_place"])
def test_the_cpu_step_is_the_fused_kernel_reading_the_layer(dtype, tol, estimator, store):
    """With the 'auto' backend on the CPU the step is one call of the fused kernel over the
    layer's pools (:func:`cpu_decode.decode_plan`): through update blocks, a departure and
    a join, it equals the fused kernel on the rows' own tensors exactly (the CPU's path
    before the layer held them) and the per-row reference to tolerance; copied into the
    layer from dense stores, or read in place from the wave buffer's host tier."""
    from vllm_retro.index.batched import decode_batch

    g = torch.Generator().manual_seed(12)
    cfg = _cfg(kernel_backend="auto", estimator=estimator)
    h, d = 2, 64
    mgr = WaveBufferManager(cfg) if store != "dense" else None
    indexes = random_indexes([40, 700, 1300, 333], cfg, h, d, dtype, g, mgr)
    slots = [5, 0, 3, 6]
    _shared_steady(indexes, cfg, [2, 7, 0, 4])
    meta = indexes[0].meta_place()[0]
    layer = _layer(cfg, indexes[0], in_place=store == "in_place")
    assert layer.fused
    updates = 0
    for step in range(70):
        if step == 30:
            layer.release(slots.pop(2))
            indexes.pop(2).free()
            new = random_indexes([900], cfg, h, d, dtype, g, mgr, first=4)
            new[0].adopt_steady(indexes[0].steady, 1)
            _shared_meta(new, meta)
            indexes += new
            slots.append(2)
        q = torch.randn(len(indexes), h * 4, d, generator=g).to(dtype)
        for index in indexes:
            updates += index.append(torch.randn(h, 1, d, generator=g).to(dtype),
                                    torch.randn(h, 1, d, generator=g).to(dtype))
        check = SyncCheck()
        out = _step(layer, slots, indexes, q, d ** -0.5, check)
        assert check.launches == 0  # one extension call: nothing through the dispatcher
        rows = decode_batch(indexes, q, d ** -0.5)  # each row's own tensors
        torch.testing.assert_close(out, rows, rtol=0, atol=0, msg=f"step {step}")
        if step % 5 == 0:
            ref = torch.stack([i.decode(q[b], d ** -0.5).output
                               for b, i in enumerate(indexes)])
            assert not torch.isnan(out).any()
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert updates >= 3
    if mgr:
        mgr.close()


@pytest.mark.parametrize("cache", [False, True])
def test_decode_step_with_triton_kernels(triton_device, cache):
    """The same step with the Triton kernels (the CUDA configuration; on the CPU under the
    interpreter): equal to the per-row reference, free of host synchronisation (wrappers
    included) and five launches — six read in place through a cluster cache (its lookup)."""
    if triton_device != "cpu":
        pytest.skip("runs the indexes on the CPU")
    g = torch.Generator().manual_seed(5)
    cfg = _cfg(kernel_backend="triton", segment_size=256)
    h, d = 2, 32
    mgr = WaveBufferManager(cfg) if cache else None
    indexes = random_indexes([40, 300, 520], cfg, h, d, torch.float32, g, mgr)
    _shared_steady(indexes, cfg, [2, 0, 1])
    layer = _layer(cfg, indexes[0], in_place=cache, cache_blocks=4 if cache else 0)
    for _ in range(3):
        q = torch.randn(3, h * 2, d, generator=g)
        for index in indexes:
            index.append(torch.randn(h, 1, d, generator=g), torch.randn(h, 1, d, generator=g))
        check = SyncCheck()
        out = _step(layer, [1, 4, 0], indexes, q, d ** -0.5, check)
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        # CUDA's configuration: scoring (2 Triton kernels), top-k, (the cache's lookup),
        # attention (2): at most 8 launches per layer step, whatever the batch
        assert check.launches == (6 if cache else 5), check.ops
    assert min(layer.cache_tokens()) > 0 if cache else layer.cache is None
    if mgr:
        mgr.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_place,cache", [(False, 0), (True, 0), (True, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_decode_step_on_cuda_never_syncs_and_replays_from_a_graph(dtype, tol, in_place, cache):
    """On a GPU: the step equals the per-row reference, passes
    ``torch.cuda.set_sync_debug_mode("error")``, and a CUDA graph replays it exactly; the
    tokens copied into the layer or read in place from the wave buffer's pinned host tier
    (over the bus), there also through a cluster cache on the device (the replay then
    reads the eager step's admissions)."""
    from vllm_retro.index.device_graph import StepGraphs
    from vllm_retro.index.wave_index import WaveIndex

    g = torch.Generator().manual_seed(9)
    cfg = _cfg(kernel_backend="auto")
    h, d, dev = 2, 128, torch.device("cuda")
    mgr = WaveBufferManager(cfg) if in_place else None
    indexes = [WaveIndex.build(torch.randn(h, n, d, generator=g).to(dev, dtype),
                               torch.randn(h, n, d, generator=g).to(dev, dtype), cfg,
                               store=mgr.store(f"r{n}", h, d, dtype, dev, layer="L0")
                               if mgr else None)
               for n in (700, 2500)]
    pool = SteadyPool(h, d, cfg.sink_tokens, ring_size(cfg.local_window, cfg.update_segment),
                      dtype, dev, slots=2, zeroed=True)
    for slot, index in enumerate(indexes):
        index.adopt_steady(pool, slot)
    meta = _shared_meta(indexes)
    layer = DeviceLayer(cfg, h, d, dtype, dev, slots=4, max_clusters=256, max_tokens=4096,
                        rank=indexes[0].residuals.rank, meta=meta, in_place=in_place,
                        cache_blocks=cache, cache_block_tokens=16)
    graphs = StepGraphs(layer)
    slots = [3, 1]
    for _ in range(3):
        for index in indexes:
            index.append(torch.randn(h, 1, d, generator=g).to(dev, dtype),
                         torch.randn(h, 1, d, generator=g).to(dev, dtype))
        q = torch.randn(2, h * 4, d, generator=g).to(dev, dtype)
        layer.refresh(slots, indexes)
        plan = layer.plan(slots, indexes)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = decode_step(layer, plan, q, d ** -0.5)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replay = graphs(plan, q, d ** -0.5)
        torch.testing.assert_close(replay, eager, rtol=0, atol=0)
        ref = torch.stack([i.decode(q[b], d ** -0.5).output for b, i in enumerate(indexes)])
        torch.testing.assert_close(eager.float(), ref.float(), rtol=tol, atol=tol)
    assert graphs.captures == 1
    assert (min(layer.cache_tokens()) > 0) if cache else layer.cache is None
    if in_place:
        assert layer.keys.device.type == "cpu" and layer.keys.is_pinned()
        torch.cuda.synchronize()
        for index in indexes:
            index.free()
        mgr.close()
