"""The wave buffer's compiled table work (``buffer_lookup`` / ``buffer_lookup_batch`` in
kernels/csrc/buffer_cpu.cpp) against the numpy reference (ClusterMappingTable.lookup): the
gather plan's runs, begins, totals and counts bit for bit."""

import re

import numpy as np
import pytest
import torch

from tests.buffer.test_layer_pool import _store
from tests.buffer.test_store import _ids, _stores
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.buffer.mapping import ClusterMappingTable
from vllm_retro.config import RetroConfig
from vllm_retro.kernels import cpu_ext


def _runs_by_definition(host_row: np.ndarray, row0: int, col0: int, t_cap: int
                        ) -> np.ndarray:
    """The runs of per-token host rows, token by token: a token extends the run before it
    iff it is the next slot of the same head at the next source row."""
    runs: list[list[int]] = []
    last = None  # (head, slot, src) of the token before
    for h in range(host_row.shape[0]):
        for t in range(host_row.shape[1]):
            s = int(host_row[h, t])
            if s < 0:
                continue
            if last == (h, t - 1, s - 1):
                runs[-1][2] -= 1
            else:
                runs.append([(row0 + h) * t_cap + col0 + t, s, -1])
            last = (h, t, s)
    return np.array(runs, dtype=np.int64).reshape(-1, 3)


def test_the_extension_builds():
    """The compiled path is what serving uses: it must build here (CI), not fall back."""
    assert cpu_ext.load() is not None, cpu_ext._error


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_lookup_equals_the_reference(page_size, rng):
    """Random steps of 1-15 clusters per head: each step's compiled lookup equals numpy's
    (and the runs their definition), written at its place in a reused plan."""
    h, m, c = 3, 900, 60
    mgr, buf, _, _ = _stores(RetroConfig(page_size=page_size), h, m, c, 16, rng)
    mod = buf.compiled
    assert mod is not None
    for step in range(60):
        ids = _ids(c, int(torch.randint(1, 16, (1,), generator=rng)), h, rng).numpy()
        ns = int(torch.randint(0, 5, (1,), generator=rng))
        buf.sync()
        ref = buf.table.lookup(ids)
        w = ref.host_row.shape[1]
        t_cap = ns + w + int(torch.randint(0, 4, (1,), generator=rng))
        # a plan reused from an earlier step: the lookup writes its runs from entry `at`
        # (rows 1 .. h of the execution buffer) and touches nothing else
        at = int(torch.randint(0, 5, (1,), generator=rng))
        plan = np.full((at + h * w + 3, 3), 7, dtype=np.int64)
        got = buf.table.lookup_into(mod, ids, buf.host.capacity_pages, plan, at, 1, ns, t_cap)
        want = _runs_by_definition(ref.host_row, 1, ns, t_cap)
        assert np.array_equal(got.runs, want), f"step {step}: runs"
        assert np.array_equal(ref.plan(1, ns, t_cap), want), f"step {step}: numpy runs"
        assert (plan[:at] == 7).all() and (plan[at + len(want):] == 7).all()
        assert len(want) == 0 or np.shares_memory(got.runs, plan)
        for f in ("begins", "totals", "counts"):
            assert np.array_equal(getattr(got, f), getattr(ref, f)), f"step {step}: {f}"
        pages = int(np.take_along_axis(buf.table.n_pages, ids, 1).sum())
        assert got.counts.tolist() == [int((ref.host_row >= 0).sum()), pages]
    mgr.close()


def _layer_stores(cfg, n, h, rng):
    """``n`` stores of one layer pool (one host pool), each holding 30 clusters per head
    over a block of its own length."""
    mgr = WaveBufferManager(cfg)
    stores = [_store(mgr, f"r{i}", "L0", rng, m=150 + 90 * i) for i in range(n)]
    for st in stores:
        st.sync()
        assert st.table.size.shape[0] == h
    return mgr, stores


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_one_lookup_call_for_a_layer_equals_each_stores_own(threads, rng):
    """buffer_lookup_batch (the stores in parallel, each into a region of its own, then
    closed up) gives every store what its own buffer_lookup gives at its place in the plan:
    runs, begins, totals, counts; random store counts, retrieval widths, steady zones and
    buffer widths."""
    mgr, stores = _layer_stores(RetroConfig(page_size=4), 5, 2, rng)
    mod = stores[0].compiled
    assert mod is not None
    pages = stores[0].host.capacity_pages
    for step in range(40):
        n = int(torch.randint(1, 6, (1,), generator=rng))
        sts = [stores[int(i)] for i in torch.randperm(5, generator=rng)[:n]]
        h = 2
        ids = [_ids(st.table.num_clusters, int(torch.randint(1, 12, (1,), generator=rng)),
                    h, rng).numpy() for st in sts]
        col0 = [int(torch.randint(0, 5, (1,), generator=rng)) for _ in sts]
        need = [c + int(st.table.size[np.arange(h)[:, None], i].sum(1).max())
                for st, i, c in zip(sts, ids, col0, strict=True)]
        t_cap = max(need) + int(torch.randint(0, 3, (1,), generator=rng))
        plan = np.full((n * h * t_cap + 2, 3), 7, dtype=np.int64)
        got = ClusterMappingTable.lookup_batch_into(
            mod, [st.table for st in sts], ids, pages, plan, col0, t_cap, threads)
        at = 0
        for j, (st, i, c, lk) in enumerate(zip(sts, ids, col0, got, strict=True)):
            own = np.zeros((h * t_cap, 3), dtype=np.int64)
            want = st.table.lookup_into(mod, i, pages, own, 0, j * h, c, t_cap)
            assert np.array_equal(lk.runs, want.runs), f"step {step}, store {j}: runs"
            assert np.array_equal(plan[at:at + len(want.runs)], want.runs)
            at += len(want.runs)
            for f in ("begins", "totals", "counts"):
                assert np.array_equal(getattr(lk, f), getattr(want, f)), f"{step}: {f}"
    mgr.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_layers_lookup_call_rejects_bad_batches_clearly(threads, rng):
    mgr, stores = _layer_stores(RetroConfig(page_size=4), 3, 2, rng)
    mod, tables = stores[0].compiled, [st.table for st in stores]
    pb = stores[0].host.capacity_pages
    c = min(t.num_clusters for t in tables)
    ids = [_ids(c, 3, 2, rng).numpy() for _ in stores]
    plan = np.zeros((3 * 2 * 400, 3), dtype=np.int64)

    def call(ids=ids, plan=plan, t_cap=400, tables=tables, threads=threads):
        return ClusterMappingTable.lookup_batch_into(mod, tables, ids, pb, plan,
                                                     [0] * len(tables), t_cap, threads)

    bad = [i.copy() for i in ids]
    bad[2][1, 0] = tables[2].num_clusters
    with pytest.raises(ValueError, match=f"cluster id {tables[2].num_clusters} is out of "
                                         f"range; accepted: 0 to {tables[2].num_clusters - 1}"):
        call(bad)
    with pytest.raises(RuntimeError,
                       match="store 1's ids are \\[1, 3\\]; every store has store 0's 2 heads"):
        call([ids[0], ids[1][:1]], tables=tables[:2])
    with pytest.raises(RuntimeError, match="the gather plan has room for 10 runs, the batch "
                                           "needs room for 2400"):
        call(plan=plan[:10])
    # stores 1 and 2 overflow the buffer: the error is store 1's, as a loop's would be
    col0 = [0, 395, 399]
    with pytest.raises(RuntimeError, match="the execution buffer has 400 slots") as first:
        tables[1].lookup_into(mod, ids[1], pb, plan, 0, 2, col0[1], 400)
    with pytest.raises(RuntimeError, match=re.escape(str(first.value).splitlines()[0])):
        ClusterMappingTable.lookup_batch_into(mod, tables, ids, pb, plan, col0, 400, threads)
    with pytest.raises(RuntimeError, match="buffer: threads 0; accepted: >= 1"):
        call(threads=0)
    assert call([], tables=[]) == []
    mgr.close()


def test_bad_ids_and_a_cluster_outside_the_pool_are_clear_errors(rng):
    h, m, c = 2, 300, 30
    mgr, buf, _, _ = _stores(RetroConfig(page_size=4), h, m, c, 16, rng)
    buf.sync()
    pages = buf.host.capacity_pages
    bad = np.array([[0, 30], [1, 2]])
    plan = np.zeros((400, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup_into(buf.compiled, bad, pages, plan, 0, 0, 0, 200)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup(bad)
    ids = _ids(c, 3, h, rng).numpy()
    need = int(buf.table.lookup(ids).totals.max())
    mod = buf.compiled
    for compiled in (mod, None):  # the same errors either way
        buf.compiled = compiled
        with pytest.raises(RuntimeError, match=f"the execution buffer has {need + 1} slots, "
                                               f"the step's tokens need {need + 2}"):
            buf.lookup_into(ids, plan, 0, 0, 2, need + 1)
        with pytest.raises(RuntimeError, match="the gather plan has room for 1 runs"):
            buf.lookup_into(ids, plan[:1], 0, 0, 0, need)
    with pytest.raises(RuntimeError, match="lies outside the host pool"):
        buf.table.lookup_into(mod, ids, 0, plan, 0, 0, 0, 400)
    mgr.close()
