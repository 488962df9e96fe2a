"""vllm_retro.index.batched: one fused call for a layer's rows gives what each row's
WaveIndex.decode (the per-row reference) gives, on mixed batches over both stores."""

import pytest
import torch

from tests.helpers import equivalence_cases, random_indexes
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex
from vllm_retro.index.batched import decode_batch, fused_supported
from vllm_retro.index.padded import MetaViewCache


def _cfg(**kw):
    base = dict(segment_size=512, update_segment=64, update_clusters=4, local_window=16,
                sink_tokens=4, kmeans_iters=3)
    base.update(kw)
    return RetroConfig(**base)


@pytest.mark.parametrize("dtype,tol,estimator,wave_buffer,group,d", equivalence_cases(
    [(1, 64), (4, 128), (8, 256)], [True, False]))
def test_batch_equals_per_row_decode(dtype, tol, estimator, wave_buffer, group, d):
    """Rows of different lengths (one too short to index, i.e. dense), decoding 70 steps so
    that rows cross update blocks at different steps, some mid-batch."""
    g = torch.Generator().manual_seed(d + group)
    cfg = _cfg(estimator=estimator)
    h = 2
    mgr = WaveBufferManager(cfg) if wave_buffer else None
    indexes = random_indexes([40, 700, 1300, 333], cfg, h, d, dtype, g, mgr)
    assert indexes[0].is_dense and not indexes[1].is_dense
    if estimator == "auto":  # each row's heads split between the two estimators
        for n, index in enumerate(indexes):
            index.residuals.set_tilted_heads(torch.arange(h) % 2 == n % 2)
    scale = d ** -0.5
    updates = 0
    cache = MetaViewCache()  # a layer's: its fused batch kept across steps
    batches = []
    for step in range(70):
        q = torch.randn(len(indexes), h * group, d, generator=g).to(dtype)
        for index in indexes:
            updates += index.append(torch.randn(h, 1, d, generator=g).to(dtype),
                                    torch.randn(h, 1, d, generator=g).to(dtype))
        assert all(fused_supported(i, q) for i in indexes)
        out = decode_batch(indexes, q, scale)
        ref = torch.stack([i.decode(q[b], scale).output for b, i in enumerate(indexes)])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                   msg=f"step {step}")
        assert torch.equal(decode_batch(indexes, q, scale, cache=cache), out), step
        if not any(b is cache.packed for b in batches):
            batches.append(cache.packed)
    assert updates >= len(indexes)
    # kept while no row changed, rebuilt when one did (update blocks landing)
    assert 1 < len(batches) < 70
    if mgr:
        mgr.close()


def test_falls_back_to_per_row_for_other_backends():
    g = torch.Generator().manual_seed(0)
    cfg = _cfg(kernel_backend="torch")
    k, v = torch.randn(2, 600, 64, generator=g), torch.randn(2, 600, 64, generator=g)
    index = WaveIndex.build(k, v, cfg)
    q = torch.randn(1, 4, 64, generator=g)
    assert not fused_supported(index, q)
    out = decode_batch([index], q, 0.125)
    torch.testing.assert_close(out[0], index.decode(q[0], 0.125).output)


def test_a_layer_asks_its_batchs_route_once_and_again_when_the_batch_changes(monkeypatch):
    """The layer (its :class:`MetaViewCache`) remembers whether its batch decodes through the
    fused kernel; another batch (here one index whose backend rules the kernel out) is
    asked again and takes its own route."""
    from vllm_retro.index import batched
    from vllm_retro.kernels import cpu_decode

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 600, 64, generator=g), torch.randn(2, 600, 64, generator=g)
    fused = WaveIndex.build(k, v, _cfg())
    plain = WaveIndex.build(k, v, _cfg(kernel_backend="torch"))
    asked, kernel = [], []
    fused_batch, decode_packed = batched.fused_batch, cpu_decode.decode_packed
    monkeypatch.setattr(batched, "fused_batch",
                        lambda *a, **kw: asked.append(1) or fused_batch(*a, **kw))
    monkeypatch.setattr(cpu_decode, "decode_packed",
                        lambda *a, **kw: kernel.append(1) or decode_packed(*a, **kw))
    cache = MetaViewCache()
    q = torch.randn(1, 4, 64, generator=g)
    for _ in range(3):
        torch.testing.assert_close(decode_batch([fused], q, 0.125, cache=cache)[0],
                                   fused.decode(q[0], 0.125).output, rtol=1e-5, atol=1e-5)
    assert len(asked) == 1 and len(kernel) == 3
    out = decode_batch([plain], q, 0.125, cache=cache)
    torch.testing.assert_close(out[0], plain.decode(q[0], 0.125).output, rtol=1e-5, atol=1e-5)
    assert len(asked) == 2 and len(kernel) == 3  # asked again; not the fused kernel
    decode_batch([fused], q, 0.125, cache=cache)
    assert len(asked) == 3 and len(kernel) == 4
    cache.clear()
    decode_batch([fused], q, 0.125, cache=cache)
    assert len(asked) == 4  # a cleared layer asks again


@pytest.mark.parametrize("wave_buffer", [True, False])
def test_packed_view_follows_the_index(wave_buffer):
    """The fused kernel's packed view of an index is kept across steps while only the
    window's length changes, and rebuilt when the window buffer is replaced (an append
    larger than its room) or a block joins the meta index; outputs equal the per-row
    reference throughout."""
    g = torch.Generator().manual_seed(7)
    cfg = _cfg()
    h, d, dtype = 2, 64, torch.float32
    mgr = WaveBufferManager(cfg) if wave_buffer else None
    store = mgr.store("r", h, d, dtype, "cpu") if mgr else None
    index = WaveIndex.build(torch.randn(h, 900, d, generator=g),
                            torch.randn(h, 900, d, generator=g), cfg, store=store)
    if store is not None:
        store.settle()  # as the runtime does after a build

    def check() -> None:
        q = torch.randn(1, h * 2, d, generator=g)
        out = decode_batch([index], q, d ** -0.5)
        torch.testing.assert_close(out[0], index.decode(q[0], d ** -0.5).output,
                                   rtol=1e-5, atol=1e-5)

    check()
    view = index.fused_view
    assert view is not None
    index.append(torch.randn(h, 1, d, generator=g), torch.randn(h, 1, d, generator=g))
    check()
    assert index.fused_view is view  # one more window row: same view, length per call
    clusters = index.num_clusters
    big = 3 * cfg.update_segment  # more than the window buffer holds: regrown, blocks land
    assert index.append(torch.randn(h, big, d, generator=g), torch.randn(h, big, d, generator=g))
    assert index.num_clusters > clusters
    check()
    assert index.fused_view is not view
    if mgr:
        # the worker grows the host pool for the next block: the view re-reads the new pool
        # at the next step (so the old one is released) and decodes the same
        store.settle()
        view = index.fused_view
        assert store.host.ensure_room(store.host.capacity_pages)
        check()
        assert index.fused_view is not view
        assert index.fused_view[1].kv[0].data_ptr() == store.host.k.data_ptr()
        mgr.close()


def _index_classes() -> list[type]:
    """Every wave index policy class defined in the package (subclasses, recursively)."""
    import vllm_retro.index.baselines  # noqa: F401  (the modules defining the subclasses)
    import vllm_retro.index.graph_index  # noqa: F401
    import vllm_retro.index.pages  # noqa: F401
    import vllm_retro.index.pq_index  # noqa: F401
    import vllm_retro.index.saap  # noqa: F401
    from vllm_retro.index.wave_index import WaveIndex

    out, todo = [], [WaveIndex]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_each_policys_capabilities_match_what_it_overrides():
    """The batched decode and the update schedule read capabilities, not classes: each
    class's flags must say what its methods do (a subclass overriding ``_cluster`` clusters
    in one go; one overriding ``_add_block`` lands blocks itself; only the wave index itself
    selects zones, the rule the padded and resident decodes implement)."""
    from vllm_retro.index.wave_index import WaveIndex

    classes = _index_classes()
    names = {c.__name__ for c in classes}
    assert {"WaveIndex", "QuestIndex", "StreamingIndex", "PQIndex", "SaapIndex",
            "GraphIndex", "OracleIndex"} <= names
    for cls in classes:
        assert cls.clusters_in_rounds == (cls._cluster is WaveIndex._cluster), cls
        assert cls.lands_in_store == (cls._add_block is WaveIndex._add_block), cls
        # a policy choosing its own way (or a base of such policies) never claims the rule
        assert cls.selects_zones == (cls is WaveIndex), cls
        # the fused kernel scores only the centroids and Quest's page bounds
        assert cls.kernel_scores == (cls.__name__ in ("WaveIndex", "QuestIndex")), cls
        assert (cls.select_batch is not None) == (
            cls.__name__ in ("SaapIndex", "QuestIndex", "StreamingIndex", "PageIndex")), cls
        assert (cls.decode_own is not None) == (cls.__name__ in ("PQIndex", "GraphIndex")), cls
