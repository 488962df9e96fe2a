"""vllm_retro.index.steady: the steady-zone pool (sinks + window ring per slot), the slot
table, and the wave index's steady zone living in it."""

import pytest
import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.batched import append_batch, decode_batch
from vllm_retro.index.steady import SlotTable, SteadyPool, fill_steady_batch, ring_size
from vllm_retro.index.store import fill_steady
from vllm_retro.index.wave_index import WaveIndex

CFG = RetroConfig(local_window=8, update_segment=32, update_clusters=4, sink_tokens=2,
                  kmeans_iters=3)


def test_ring_rows_wrap_and_views_read_them_in_order():
    pool = SteadyPool(2, 4, sink_cap=3, ring=5, dtype=torch.float32, device="cpu")
    toks = torch.arange(2 * 12 * 4, dtype=torch.float32).reshape(2, 12, 4)
    pool.write_sinks(0, toks[:, :2], -toks[:, :2])
    pool.write_rows(0, sinks=2, first=2, keys=toks[:, 2:6], values=-toks[:, 2:6])
    pool.write_rows(0, sinks=2, first=6, keys=toks[:, 6:9], values=-toks[:, 6:9])  # wraps
    assert pool.ring_row(2, 2) == 3 and pool.ring_row(2, 7) == 3  # (7 - 2) % 5 = 0
    # the window of the last 5 tokens (4..8) starts at ring row (4 - 2) % 5 = 2
    parts = pool.window_parts(0, start=2, n=5)
    assert len(parts) == 2
    assert torch.equal(torch.cat([k for k, _ in parts], 1), toks[:, 4:9])
    assert torch.equal(torch.cat([v for _, v in parts], 1), -toks[:, 4:9])
    sk, sv = pool.sink_view(0, 2)
    assert torch.equal(sk, toks[:, :2]) and torch.equal(sv, -toks[:, :2])
    assert sk.stride(-1) == 1


def test_batch_write_and_growth_keep_slots():
    pool = SteadyPool(2, 4, sink_cap=1, ring=6, dtype=torch.float32, device="cpu", slots=1,
                      zeroed=True)
    assert torch.equal(pool.k, torch.zeros_like(pool.k))
    pool.write_sinks(0, torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    gen = pool.generation
    pool.ensure(3)
    assert pool.num_slots >= 3 and pool.generation == gen + 1
    assert torch.equal(pool.k[0, 0], torch.ones(2, 4))
    assert torch.equal(pool.k[1:], torch.zeros_like(pool.k[1:]))  # new slots zeroed
    keys = torch.randn(3, 2, 4)
    slots, rows = torch.tensor([2, 0, 1]), torch.tensor([1, 4, 6])
    pool.write(slots, rows, keys, -keys)
    for b in range(3):
        assert torch.equal(pool.k[slots[b], rows[b]], keys[b])
        assert torch.equal(pool.v[slots[b], rows[b]], -keys[b])
    pool.release()
    assert pool.num_slots == 0 and pool.nbytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_write_puts_each_row_in_place_as_index_put_does(dtype):
    """:meth:`SteadyPool.write` on the CPU (one extension call) writes exactly what two
    ``index_put_`` write, from strided token views (the step's QKV split), leaving every
    other row alone; new tokens of another dtype take the ``index_put_`` path and are
    converted; an index outside the pool is named and nothing is written."""
    g = torch.Generator().manual_seed(3)
    pool = SteadyPool(2, 64, sink_cap=4, ring=40, dtype=dtype, device="cpu", slots=5,
                      zeroed=True)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    qkv = torch.randn(3, 9 * 64, generator=g).to(dtype)  # q: 5 heads, k and v: 2 each
    keys, values = qkv[:, 5 * 64:7 * 64].view(3, 2, 64), qkv[:, 7 * 64:].view(3, 2, 64)
    assert not keys.is_contiguous()
    slots, rows = torch.tensor([4, 0, 2]), torch.tensor([43, 4, 17])
    ref_k, ref_v = pool.k.clone(), pool.v.clone()
    ref_k.index_put_((slots, rows), keys)
    ref_v.index_put_((slots, rows), values)
    pool.write(slots, rows, keys, values)
    assert torch.equal(pool.k, ref_k) and torch.equal(pool.v, ref_v)
    half = torch.randn(3, 2, 64, generator=g).half()
    pool.write(slots, rows, half, -half)
    assert torch.equal(pool.k[slots, rows], half.to(dtype))
    assert torch.equal(pool.v[slots, rows], (-half).to(dtype))
    before = pool.k.clone()
    with pytest.raises(RuntimeError, match=r"\(slot 5, row 3\) is outside the pool; "
                                           r"accepted: slots 0 to 4, rows 0 to 43"):
        pool.write(torch.tensor([0, 5]), torch.tensor([9, 3]), keys[:2], values[:2])
    assert torch.equal(pool.k, before)


def test_slot_table_reuses_the_lowest_free_slot():
    t = SlotTable()
    assert [t.get(r) for r in "abc"] == [0, 1, 2]
    assert t.get("b") == 1 and t.find("z") is None
    t.release("b")
    t.release("a")
    assert t.get("d") == 0 and t.get("e") == 1 and t.high_water == 3
    for r in "cde":
        t.release(r)
    assert len(t) == 0 and t.high_water == 0 and t.get("f") == 0


def _kv(h, n, d, g, dtype=torch.float32):
    return tuple(torch.randn(h, n, d, generator=g).to(dtype) for _ in range(2))


@pytest.mark.parametrize("rounds", [1, 0])
def test_window_holds_the_latest_tokens_across_update_blocks(rounds):
    """Decoding token by token past several update blocks (and a catch-up of more than a
    ring at once): the steady zone is always the sinks plus the tokens after the last
    landed block, read from the ring in order."""
    g = torch.Generator().manual_seed(0)
    cfg = CFG.replace(update_rounds_per_step=rounds)
    k, v = _kv(2, 120, 16, g)
    index = WaveIndex.build(k, v, cfg)
    all_k, all_v = [k], [v]
    for step in range(140):
        n = 90 if step == 70 else 1  # a catch-up larger than the ring (8 + 64 rows)
        nk, nv = _kv(2, n, 16, g)
        index.append(nk, nv)
        all_k.append(nk)
        all_v.append(nv)
        assert index.win_len < ring_size(cfg.local_window, cfg.update_segment)
        ks, vs = torch.cat(all_k, 1), torch.cat(all_v, 1)
        assert torch.equal(index.sink_k, ks[:, :2]) and torch.equal(index.sink_v, vs[:, :2])
        assert torch.equal(index.win_k, ks[:, index.window_start:])
        assert torch.equal(index.win_v, vs[:, index.window_start:])
        assert index.num_tokens == ks.shape[1]
    assert index.num_updates >= 6
    parts = index.steady_parts()
    assert sum(p[0].shape[1] for p in parts) == index.num_steady


def _adopted(indexes, pool_slots):
    """The indexes' steady zones moved into one shared pool, at the given slots."""
    first = indexes[0].steady
    pool = SteadyPool(first.num_heads, first.head_dim, first.sink_cap, first.ring,
                      first.dtype, first.device, slots=0, zeroed=True)
    pool.ensure(max(pool_slots) + 1)
    for index, slot in zip(indexes, pool_slots, strict=True):
        index.adopt_steady(pool, slot)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_batch_equals_each_index_appending_its_own(dtype):
    """Indexes of one layer in a shared pool: one write for the batch, then each index's
    update-block work, gives bit-equal steady zones, meta indexes and decode outputs to
    twin indexes appending one by one in pools of their own; the rows tensors are reused
    by a second 'layer' at the same positions."""
    g = torch.Generator().manual_seed(1)
    lengths = (100, 150, 61)  # the last one dense until its window fills
    kvs = [_kv(2, n, 16, g, dtype) for n in lengths]
    shared = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    twins = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    layer2 = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    pool = _adopted(shared, [2, 0, 1])
    pool2 = _adopted(layer2, [2, 0, 1])
    generations = pool.generation, pool2.generation
    for _ in range(80):
        keys = torch.randn(3, 2, 16, generator=g).to(dtype)
        values = torch.randn(3, 2, 16, generator=g).to(dtype)
        landed, rows = append_batch(shared, keys, values)
        landed2, rows2 = append_batch(layer2, keys, values, rows)
        assert rows2 is rows and landed2 == landed
        twin_landed = sum(t.append(keys[b, :, None], values[b, :, None])
                          for b, t in enumerate(twins))
        assert landed == twin_landed
        for a, t in zip(shared, twins, strict=True):
            assert a.window_start == t.window_start and a.num_clusters == t.num_clusters
            assert torch.equal(a.win_k, t.win_k) and torch.equal(a.sink_v, t.sink_v)
        q = torch.randn(3, 4, 16, generator=g).to(dtype)
        got = decode_batch(shared, q, 0.25)
        want = decode_batch(twins, q, 0.25)
        assert torch.equal(got, want)
    assert all(i.num_updates >= 2 for i in shared)
    assert (pool.generation, pool2.generation) == generations  # nothing regrown


def test_fill_steady_batch_equals_each_index_filling_its_own():
    g = torch.Generator().manual_seed(2)
    kvs = [_kv(2, n, 16, g) for n in (100, 130, 30)]
    indexes = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    for i, index in enumerate(indexes):  # windows of different lengths, some wrapped
        for _ in range(17 * i + 40):
            index.append(*_kv(2, 1, 16, g))
    own = [WaveIndex.build(*kv, CFG) for kv in kvs]  # not shared: filled piece by piece
    _adopted(indexes, [1, 0, 3])
    t = max(i.num_steady for i in indexes) + 5
    want_k, want_v = torch.full((6, t, 16), 7.0), torch.full((6, t, 16), 7.0)
    for j, index in enumerate(indexes):
        fill_steady(index.steady_parts(), want_k[2 * j:2 * j + 2], want_v[2 * j:2 * j + 2])
    got_k, got_v = torch.full((6, t, 16), 7.0), torch.full((6, t, 16), 7.0)
    counts = fill_steady_batch(indexes, got_k, got_v)
    assert counts == [i.num_steady for i in indexes]
    for j, n in enumerate(counts):
        rows = slice(2 * j, 2 * j + 2)
        assert torch.equal(got_k[rows, :n], want_k[rows, :n])
        assert torch.equal(got_v[rows, :n], want_v[rows, :n])
        assert torch.isfinite(got_k[rows]).all()  # rows past n: finite (zeros or KV)
    assert fill_steady_batch(own, got_k, got_v) == [i.num_steady for i in own]


def test_adopting_keeps_decode_and_frees_the_private_pool():
    g = torch.Generator().manual_seed(3)
    k, v = _kv(2, 200, 16, g)
    a, b = WaveIndex.build(k, v, CFG), WaveIndex.build(k, v, CFG)
    for _ in range(50):
        kv = _kv(2, 1, 16, g)
        a.append(*kv)
        b.append(*kv)
    own = a.steady
    assert a.steady_nbytes() == own.nbytes() > 0
    pool = _adopted([a], [4])
    assert a.slot == 4 and a.steady is pool and own.nbytes() == 0
    assert a.steady_nbytes() == 0  # the shared pool's owner counts it
    q = torch.randn(4, 16, generator=g)
    torch.testing.assert_close(a.decode(q).output, b.decode(q).output, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layout differs"):
        WaveIndex.build(k[:, :, :8], v[:, :, :8], CFG).adopt_steady(pool, 0)


@pytest.mark.parametrize("pooled", [True, False])
def test_append_batch_records_a_failing_index_and_appends_the_others(pooled):
    """One index's append raises: with ``failed`` given, it is recorded (position, error)
    and every other index appends exactly as alone; without, the error propagates."""
    g = torch.Generator().manual_seed(3)
    kvs = [_kv(2, n, 16, g) for n in (100, 150, 120)]
    batch = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    twins = [WaveIndex.build(k, v, CFG) for k, v in kvs]
    if pooled:
        _adopted(batch, [0, 1, 2])
    broken = batch[1]

    def boom(*a, **kw):
        raise MemoryError("injected")

    broken.appended = boom
    broken.append = boom
    for _ in range(40):
        keys, values = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
        failed = []
        append_batch(batch, keys, values, None, failed)
        assert [b for b, _ in failed] == [1] and isinstance(failed[0][1], MemoryError)
        for b in (0, 2):
            twins[b].append(keys[b, :, None], values[b, :, None])
    for b in (0, 2):
        assert batch[b].num_tokens == twins[b].num_tokens
        assert torch.equal(batch[b].centroids, twins[b].centroids)
        q = torch.randn(1, 2, 16, generator=g)
        assert torch.equal(decode_batch([batch[b]], q, 0.25), decode_batch([twins[b]], q, 0.25))
    with pytest.raises(MemoryError):
        append_batch(batch, keys, values)
