"""vllm_retro.index.padded: the batched path over padded rows (CUDA's, and the CPU's with the
'torch' / 'triton' backends) gives what each row's WaveIndex.decode (the per-row reference)
gives, on mixed batches over both stores, and keeps its meta view only while it is valid."""

import pytest
import torch

from tests.helpers import equivalence_cases, random_indexes
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex
from vllm_retro.index.batched import decode_batch, fused_supported
from vllm_retro.index.padded import MetaViewCache, decode_padded, padded_meta


def _cfg(**kw):
    base = dict(segment_size=512, update_segment=64, update_clusters=4, local_window=16,
                sink_tokens=4, kmeans_iters=3, kernel_backend="torch")
    base.update(kw)
    return RetroConfig(**base)


def _check(indexes, q, scale, tol, cache, msg=""):
    out = decode_batch(indexes, q, scale, cache=cache)
    ref = torch.stack([i.decode(q[b], scale).output for b, i in enumerate(indexes)])
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=msg)


@pytest.mark.parametrize("dtype,tol,estimator,wave_buffer,group,d", equivalence_cases(
    [(1, 64), (4, 128), (8, 256)], [True, False]))
def test_padded_batch_equals_per_row_decode(dtype, tol, estimator, wave_buffer, group, d):
    """Rows of different lengths (one dense), 70 steps crossing update blocks at different
    steps; a row finishes mid-run (freed, dropped from the batch) and a new one joins."""
    g = torch.Generator().manual_seed(d + group)
    cfg = _cfg(estimator=estimator)
    h = 2
    mgr = WaveBufferManager(cfg) if wave_buffer else None
    indexes = random_indexes([40, 700, 1300, 333], cfg, h, d, dtype, g, mgr)
    assert indexes[0].is_dense and not indexes[1].is_dense
    if estimator == "auto":  # each row's heads split between the two estimators
        for n, index in enumerate(indexes):
            index.residuals.set_tilted_heads(torch.arange(h) % 2 == n % 2)
    cache = MetaViewCache()
    scale = d ** -0.5
    updates = 0
    for step in range(70):
        if step == 30:  # a request finishes; another joins
            indexes.pop(2).free()
            indexes += random_indexes([900], cfg, h, d, dtype, g, mgr, first=4)
        q = torch.randn(len(indexes), h * group, d, generator=g).to(dtype)
        for index in indexes:
            updates += index.append(torch.randn(h, 1, d, generator=g).to(dtype),
                                    torch.randn(h, 1, d, generator=g).to(dtype))
        assert not any(fused_supported(i, q) for i in indexes)
        _check(indexes, q, scale, tol, cache, msg=f"step {step}")
    assert updates >= 3
    if mgr:
        # every cluster read from the layer's host pool, and the table stayed consistent
        assert mgr.stats.snapshot()["miss_tokens"] > 0
        for index in indexes:
            index.store.check_invariants()
        mgr.close()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_layer_pool_batch_alone_equals_stores_of_their_own(dtype, tol):
    """The batched path on its own over one layer's pools (one gather and one admission
    copy per call) against identical indexes decoded row by row over pools of their own:
    the same outputs over 80 steps crossing update blocks, with a request leaving and
    another joining in its freed pages; the pools stay consistent and are released with
    the last request."""
    cfg = _cfg(min_retrieval_clusters=0)
    h, d, group = 2, 64, 4
    mgr, own_mgr = WaveBufferManager(cfg), WaveBufferManager(cfg)
    g = torch.Generator().manual_seed(11)

    def twins(lengths, first=0):
        state = g.get_state()
        pooled = random_indexes(lengths, cfg, h, d, dtype, g, mgr, first=first)
        g.set_state(state)
        return pooled, random_indexes(lengths, cfg, h, d, dtype, g, own_mgr, layer=None,
                                      first=first)

    pooled, alone = twins([40, 700, 1300, 333])
    cache = MetaViewCache()
    scale = d ** -0.5
    for step in range(80):
        if step == 30:
            pooled.pop(1).free()
            alone.pop(1).free()
            more = twins([900], first=4)
            pooled += more[0]
            alone += more[1]
        q = torch.randn(len(pooled), h * group, d, generator=g).to(dtype)
        for a, b in zip(pooled, alone, strict=True):
            k = torch.randn(h, 1, d, generator=g).to(dtype)
            v = torch.randn(h, 1, d, generator=g).to(dtype)
            a.append(k, v)
            b.append(k, v)
        out = decode_batch(pooled, q, scale, cache=cache)
        ref = torch.stack([i.decode(q[j], scale).output for j, i in enumerate(alone)])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                   msg=f"step {step}")
    stats = mgr.stats.snapshot()
    assert stats["miss_tokens"] > 0 and stats["hit_tokens"] == 0  # every read from the host
    assert len({id(i.store.pool) for i in pooled}) == 1
    for index in pooled:
        index.store.check_invariants()
    for index in pooled + alone:
        index.free()
    assert mgr.host_bytes() == 0 == own_mgr.host_bytes()
    mgr.close()
    own_mgr.close()


def test_all_dense_batch_is_exact_attention():
    g = torch.Generator().manual_seed(1)
    cfg = _cfg()
    h, d = 2, 32
    indexes = random_indexes([20, 50], cfg, h, d, torch.float32, g, None)
    assert all(i.is_dense for i in indexes)
    q = torch.randn(2, h * 2, d, generator=g)
    out = decode_batch(indexes, q, d ** -0.5, cache=MetaViewCache())
    for b, index in enumerate(indexes):
        k = index.win_k if index.sink_k.shape[1] == 0 else torch.cat([index.sink_k,
                                                                      index.win_k], 1)
        v = index.win_v if index.sink_v.shape[1] == 0 else torch.cat([index.sink_v,
                                                                      index.win_v], 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(h, 2, 1, d), k[:, None], v[:, None], scale=d ** -0.5).view(h * 2, d)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


def test_meta_view_is_kept_until_the_batch_or_a_meta_index_changes():
    g = torch.Generator().manual_seed(2)
    cfg = _cfg()
    h, d = 2, 32
    indexes = random_indexes([700, 1300], cfg, h, d, torch.float32, g, None)
    cache = MetaViewCache()

    def step(batch):
        q = torch.randn(len(batch), h * 2, d, generator=g)
        for index in batch:
            index.append(torch.randn(h, 1, d, generator=g), torch.randn(h, 1, d, generator=g))
        _check(batch, q, d ** -0.5, 1e-5, cache)
        return cache.view

    view = step(indexes)
    generations = [i.meta_generation for i in indexes]
    assert step(indexes) is view  # one more window row each: same view
    assert step(indexes[:1]) is not view  # the batch changed
    view = step(indexes)
    while [i.meta_generation for i in indexes] == generations:
        latest = step(indexes)
        if [i.meta_generation for i in indexes] == generations:
            assert latest is view
    assert cache.view is not view  # a block landed: rebuilt
    cache.clear()
    assert cache.view is None


def test_padded_path_reads_each_selected_cluster_once_and_nothing_else():
    """The execution buffer holds the steady zone and exactly the retrieval clusters the
    per-row selection picks: a full retrieval budget makes attention exact."""
    g = torch.Generator().manual_seed(3)
    cfg = _cfg(retrieval_budget=1.0, estimation_budget=0.0)
    h, d = 2, 32
    mgr = WaveBufferManager(cfg)
    lengths = [700, 1300]
    keys = [torch.randn(h, n, d, generator=g) for n in lengths]
    values = [torch.randn(h, n, d, generator=g) for n in lengths]
    indexes = [WaveIndex.build(k, v, cfg, store=mgr.store(f"r{i}", h, d, torch.float32, "cpu"))
               for i, (k, v) in enumerate(zip(keys, values, strict=True))]
    q = torch.randn(2, h * 4, d, generator=g)
    out = decode_padded(indexes, q, d ** -0.5, torch.empty_like(q))
    for b in range(2):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(h, 4, 1, d), keys[b][:, None], values[b][:, None],
            scale=d ** -0.5).view(h * 4, d)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
    mgr.close()


def test_view_has_padding_only_past_each_rows_clusters():
    g = torch.Generator().manual_seed(4)
    cfg = _cfg()
    h, d = 2, 16
    indexes = random_indexes([40, 700, 1300], cfg, h, d, torch.float32, g, None)
    meta = padded_meta(indexes)
    width = max(i.num_clusters for i in indexes)
    assert meta.centroids.shape == (3 * h, width, d)
    for b, index in enumerate(indexes):
        c = index.num_clusters
        rows = slice(b * h, (b + 1) * h)
        torch.testing.assert_close(meta.centroids[rows, :c], index.centroids)
        assert (meta.sizes[rows, c:] == 0).all()
        assert meta.n_retrieval[b] == cfg.num_retrieval(c)
        assert (meta.n_est[rows] == cfg.num_estimation(c)).all()


def test_padded_batch_with_triton_kernels(triton_device):
    """The same path with the Triton kernels (the CUDA configuration; on the CPU under the
    interpreter)."""
    if triton_device != "cpu":
        pytest.skip("runs the stores on the CPU")
    g = torch.Generator().manual_seed(5)
    cfg = _cfg(kernel_backend="triton", segment_size=256)
    h, d = 2, 32
    mgr = WaveBufferManager(cfg)
    indexes = random_indexes([40, 300, 520], cfg, h, d, torch.float32, g, mgr)
    cache = MetaViewCache()
    for _ in range(3):
        q = torch.randn(3, h * 2, d, generator=g)
        for index in indexes:
            index.append(torch.randn(h, 1, d, generator=g), torch.randn(h, 1, d, generator=g))
        _check(indexes, q, d ** -0.5, 1e-4, cache)
    mgr.close()
