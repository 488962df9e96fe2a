"""The layer's meta pool: extents handed out by an integer table, rows kept through every
move, and indexes reading their rows from it exactly as from their own buffers."""

import random

import pytest
import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.batched import decode_batch
from vllm_retro.index.meta_pool import ExtentTable, MetaPool, MetaRows
from vllm_retro.index.padded import MetaViewCache, padded_meta
from vllm_retro.index.pages import QuestIndex
from vllm_retro.index.wave_index import WaveIndex

CFG = RetroConfig(local_window=8, update_segment=32, update_clusters=4, sink_tokens=2,
                  kmeans_iters=3, min_retrieval_clusters=2)
FIELDS = {"c": ((3,), torch.float32), "n": ((), torch.int32)}


def test_extents_are_placed_first_fit_and_holes_are_reused():
    t = ExtentTable(10)
    a, b, c = t.alloc(3), t.alloc(3), t.alloc(3)
    assert [t.start(h) for h in (a, b, c)] == [0, 3, 6]
    assert t.alloc(2) is None  # 1 row left
    t.free(b)
    d = t.alloc(2)
    assert t.start(d) == 3 and t.room_after(d) == 1 and t.used == 8
    t.resize(d, 3)
    with pytest.raises(ValueError, match="cannot grow to 4 rows in place"):
        t.resize(d, 4)
    t.free(a)
    starts = t.packed(12, last=d)  # compaction, d last
    assert starts == {c: 0, d: 3} and t.capacity == 12 and t.room_after(d) == 6
    with pytest.raises(ValueError, match="extent length 0; accepted: >= 1"):
        t.alloc(0)
    with pytest.raises(ValueError, match=r"capacity 5; accepted: >= 6"):
        t.packed(5)


def _check_no_overlap(pool: MetaPool) -> None:
    spans = sorted(pool.table.extents().values())
    for (s0, n0), (s1, _) in zip(spans, spans[1:], strict=False):
        assert s0 + n0 <= s1
    assert not spans or spans[-1][0] + spans[-1][1] <= pool.capacity


def test_rows_survive_every_move_of_a_shared_pool():
    """Random appends, releases and adoptions of many indexes' rows in one pool (in-place
    growth, moves to a hole, growth of the pool, compaction, shrinking): every index reads
    exactly the rows it appended, and nothing is held once all are gone."""
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    pool = MetaPool(2, FIELDS, "cpu")
    live: dict[int, tuple[MetaRows, dict[str, torch.Tensor]]] = {}
    generations = {pool.generation}
    replaced = 0
    for step in range(400):
        tensors, storage = pool.tensors, pool.storage
        op = rnd.random()
        if op < 0.15 or not live:  # a new index: built on its own, then adopted
            rows = MetaRows(MetaPool(2, FIELDS, "cpu"), own=True)
            n = rnd.randint(1, 40)
            first = {"c": torch.randn(2, n, 3, generator=g),
                     "n": torch.randint(0, 99, (2, n), dtype=torch.int32, generator=g)}
            rows.append(first)
            own = rows.pool
            rows.adopt(pool)
            assert own.capacity == 0 and not rows.own
            live[step] = (rows, first)
        elif op < 0.25:  # one leaves
            key = rnd.choice(list(live))
            live.pop(key)[0].release()
        else:  # one appends to one field or both
            key = rnd.choice(list(live))
            rows, want = live[key]
            names = rnd.choice([["c"], ["n"], ["c", "n"]])
            n = rnd.randint(1, 30)
            new = {"c": torch.randn(2, n, 3, generator=g),
                   "n": torch.randint(0, 99, (2, n), dtype=torch.int32, generator=g)}
            rows.append({k: new[k] for k in names}, headroom=rnd.choice([0, 8]))
            for k in names:
                want[k] = torch.cat([want[k], new[k]], dim=1)
        generations.add(pool.generation)
        # the storage count moves exactly when the tensors are replaced
        assert pool.storage - storage == (pool.tensors is not tensors)
        replaced += pool.tensors is not tensors
        _check_no_overlap(pool)
        assert pool.table.used <= pool.capacity
        for rows, want in live.values():
            for k, v in want.items():
                assert rows.counts[k] == v.shape[1]
                assert torch.equal(rows.view(k), v), f"step {step}, field {k}"
    assert len(generations) > 10 and replaced > 5  # the rows did move, many times
    for rows, _ in live.values():
        rows.release()
    assert pool.capacity == 0 and pool.nbytes() == 0 and len(pool.table) == 0


def test_an_own_pool_holds_what_growing_buffers_did():
    rows = MetaRows(MetaPool(2, FIELDS, "cpu"), own=True)
    for _ in range(20):
        rows.append({"c": torch.ones(2, 7, 3), "n": torch.ones(2, 7, dtype=torch.int32)}, 4)
        assert rows.pool.capacity <= int(1.5 * (rows.counts["c"] + 4)) + 1
        assert rows.pool.capacity == rows.capacity()
    with pytest.raises(ValueError, match=r"meta fields \['x'\]; accepted: \['c', 'n'\]"):
        rows.append({"x": torch.ones(2, 1)})
    rows.release()
    assert rows.pool.nbytes() == 0


def test_adopting_into_a_pool_of_another_layout_is_refused():
    rows = MetaRows(MetaPool(2, FIELDS, "cpu"), own=True)
    rows.append({"c": torch.ones(2, 1, 3), "n": torch.ones(2, 1, dtype=torch.int32)})
    with pytest.raises(ValueError, match="layout differs"):
        rows.adopt(MetaPool(4, FIELDS, "cpu"))
    with pytest.raises(ValueError, match="num_heads 0"):
        MetaPool(0, FIELDS, "cpu")


def _kv(h, n, d, g):
    return tuple(torch.randn(h, n, d, generator=g) for _ in range(2))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kind", [WaveIndex, QuestIndex])
def test_indexes_in_a_layer_pool_decode_as_standalone_ones(kind, backend):
    """Indexes adopted into one pool, decoding token by token past update blocks (which land
    in the pool and move it), with one leaving and another joining midway, give exactly the
    outputs of the same indexes each keeping its own rows, through the fused CPU kernel
    ('auto') and the padded route, whose view is gathered from the pool ('torch'); once all
    are freed the pool holds nothing."""
    g = torch.Generator().manual_seed(1)
    cfg = CFG.replace(kernel_backend=backend)
    h, d, lengths = 2, 16, [300, 120, 700]
    kvs = [_kv(h, n, d, g) for n in lengths]
    pooled = [kind.build(*kv, cfg) for kv in kvs]
    alone = [kind.build(*kv, cfg) for kv in kvs]
    views = [MetaViewCache(), MetaViewCache()]
    pool = MetaPool(*pooled[0].meta_pool_layout())
    for index in pooled:
        own = index.meta_nbytes()
        index.adopt_meta(pool)
        assert index.meta_nbytes() < own  # the layer counts the rows now
    assert pool.nbytes() > 0
    generations = {pool.generation}
    for step in range(160):
        if step == 60:  # the second leaves, a new one joins (into its extent's hole)
            pooled.pop(1).free()
            alone.pop(1).free()
            kv = _kv(h, 500, d, g)
            pooled.append(kind.build(*kv, cfg))
            alone.append(kind.build(*kv, cfg))
            pooled[-1].adopt_meta(pool)
        for a, b in zip(pooled, alone, strict=True):
            kv = _kv(h, 1, d, g)
            a.append(*kv)
            b.append(*kv)
        generations.add(pool.generation)
        q = torch.randn(len(pooled), 4, d, generator=g)
        got = decode_batch(pooled, q, d ** -0.5, cache=views[0])
        want = decode_batch(alone, q, d ** -0.5, cache=views[1])
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
        for a, b in zip(pooled, alone, strict=True):
            assert torch.equal(a.sizes, b.sizes)
            assert torch.equal(a.centroids, b.centroids)
    assert sum(i.num_updates for i in pooled) >= 10 and len(generations) > 1
    if kind is WaveIndex:  # the padded view: gathered from the pool, as copied row by row
        assert all(i.meta_place()[0] is pool for i in pooled)
        assert all(i.meta_place() is None for i in alone)
        a, b = padded_meta(pooled), padded_meta(alone)
        for name in ("centroids", "value_sums", "sizes", "spreads", "deviates", "empty"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for index in pooled:
        index.free()
    assert pool.nbytes() == 0
