"""vllm_retro.buffer.store: execution buffer contents, token reads, invariants, statistics,
and bit-exact decode through the buffer."""

import numpy as np
import pytest
import torch

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
    """``steps`` decode steps of 1-11 random clusters per head through ``buf`` (its
    invariants checked after each), each gather equal to ``dense``'s."""
    h, d = buf.num_heads, buf.head_dim
    steady = [tuple(torch.randn(h, 5, d, generator=rng).to(dtype) for _ in range(2))]
    for _ in range(steps):
        _assert_same_gather(buf, dense, _ids(c, int(torch.randint(1, 12, (1,), generator=rng)),
                                             h, rng), steady)
        buf.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_execution_buffer_equals_direct_gather(dtype, rng):
    """Random steps: the assembled buffer holds exactly the dense gather's bytes, every token
    read from the layer's host pool and counted so (two stores share the layer's pool)."""
    h, m, c, d = 3, 900, 60, 64
    cfg = RetroConfig()
    keys = torch.randn(h, m, d, generator=rng).to(dtype)
    values = torch.randn(h, m, d, generator=rng).to(dtype)
    cl, pos = random_clusters(h, m, c, rng), torch.arange(m)
    mgr = WaveBufferManager(cfg)
    a, b = (mgr.store(rid, h, d, dtype, "cpu", layer="l0") for rid in ("a", "b"))
    for buf in (a, b):
        buf.append(keys, values, pos, cl)
        buf.settle()  # the layout, on the buffer's worker, done
    assert a.pool is b.pool and a.pool.nbytes() > 0 and a.nbytes() > 0
    dense = DenseClusterStore(h, d, dtype, torch.device("cpu"))
    dense.append(keys, values, pos, cl)
    _random_steps(a, dense, 30, c, rng, dtype)
    snap = mgr.stats.snapshot()
    assert snap["device_cache_hit_clusters"] == snap["hit_tokens"] == 0
    assert snap["device_cache_miss_clusters"] > 0
    row = 2 * d * keys.element_size()
    assert snap["host_to_device_bytes"] == snap["miss_tokens"] * row > 0
    mgr.close()
    assert mgr.host_bytes() == 0


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
    assert mgr.stats.miss_tokens > 0  # the buffer was really read
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


def test_token_reads_equal_the_dense_stores(rng):
    """Token reads (PQCache, the graph index): single tokens of clusters, from the host pool,
    equal the dense store's and are counted as tokens read."""
    h, m, c, d = 3, 400, 40, 32
    mgr, buf, dense, cl = _stores(RetroConfig(page_size=8), h, m, c, d, rng)
    sizes = cl.sizes.long().numpy()
    g = np.random.default_rng(0)
    for k in (1, 7, 40):
        ids = np.zeros((h, k), dtype=np.int64)
        offs = np.zeros((h, k), dtype=np.int64)
        for i in range(h):
            nonempty = np.nonzero(sizes[i] > 0)[0]
            ids[i] = nonempty[g.integers(0, nonempty.size, k)]
            offs[i] = g.integers(0, sizes[i][ids[i]])
        before = mgr.stats.miss_tokens
        got = [torch.full((h, k + 2, d), 7.0) for _ in range(2)]
        want = [x.clone() for x in got]
        buf.gather_tokens_into(ids, offs, 2, *got)
        dense.gather_tokens_into(ids, offs, 2, *want)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert mgr.stats.miss_tokens - before == h * k
    with pytest.raises(ValueError, match="outside its cluster"):
        buf.gather_tokens_into(ids, offs + 10_000, 0, *got)
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
    mgr, buf, dense, _ = _stores(RetroConfig(), h, m, c, d, rng)
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
    buf.free()
    mgr.close()
