"""The wave buffer's compiled table work (``buffer_lookup`` / ``buffer_update`` in
kernels/csrc/buffer_cpu.cpp) against the numpy reference (ClusterMappingTable.lookup,
WaveBufferStore._update): lookups, tables, block pools and admission plans bit for bit."""

import numpy as np
import pytest
import torch

from tests.buffer.test_store import _ids, _stores
from vllm_retro.config import RetroConfig
from vllm_retro.kernels import cpu_decode

TABLE = ("page_start", "n_pages", "size", "cached", "last_access", "reads")


def _state(buf) -> dict:
    """Copies of everything a cache update may change."""
    out = {f: getattr(buf.table, f).copy() for f in TABLE}
    out.update(capacity=buf.capacity.copy(), page_block=buf.host.page_block.copy(),
               free=np.array(buf.blocks.free_blocks), clock=buf._clock,
               stats=buf.manager.stats.snapshot())
    return out


def _restore(buf, state: dict) -> None:
    for f in TABLE:
        getattr(buf.table, f)[...] = state[f]
    buf.host.page_block[...] = state["page_block"]
    n = state["free"].size
    buf.blocks.free_stack[:n] = state["free"]
    buf.blocks.n_free[0] = n
    buf._clock = state["clock"]


def _assert_same(before: dict, a: dict, b: dict, msg: str) -> None:
    """The states ``a`` and ``b`` two updates from ``before`` left are the same (the
    statistics by what each added: they are cumulative)."""
    for key in a:
        if key == "stats":
            for s in ("pages_admitted", "pages_evicted"):
                assert a[key][s] - before[key][s] == b[key][s] - a[key][s], f"{msg}: {s}"
        else:
            assert np.array_equal(a[key], b[key]), f"{msg}: {key}"


def test_the_extension_builds():
    """The compiled path is what serving uses: it must build here (CI), not fall back."""
    assert cpu_decode.load() is not None, cpu_decode._error


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cache", [dict(cache_pages=0), dict(cache_pages=2),
                                   dict(cache_pages=9), dict(cache_pages=40),
                                   dict(cache_fraction=0.1)])
def test_lookup_and_update_equal_the_reference(policy, cache, rng):
    """Random steps of 1-15 clusters per head over a store whose cache ranges from none to
    room for most reads (so admissions are skipped as too big, admitted greedily, and made
    after evictions by the policy's order): each step's lookup and update equal numpy's."""
    h, m, c = 3, 900, 60
    cfg = RetroConfig(page_size=4, cache_policy=policy, **cache)
    mgr, buf, _, _ = _stores(cfg, h, m, c, 16, rng)
    mod = buf.compiled
    assert mod is not None
    admitted = evicted = 0
    for step in range(60):
        ids = _ids(c, int(torch.randint(1, 16, (1,), generator=rng)), h, rng).numpy()
        ns = int(torch.randint(0, 5, (1,), generator=rng))
        buf._sync()
        ref = buf.table.lookup(ids, buf.host.page_block)
        w = ref.kind.shape[1]
        # a plan reused from an earlier step: the lookup owns rows 1 .. h and writes their
        # kind whole (0 where no token goes), their src at the tokens only
        kind = np.full((h + 2, ns + w + 3), 7, dtype=np.int32)
        src = np.full((h + 2, ns + w + 3), 7, dtype=np.int64)
        got = buf.table.lookup_into(mod, ids, buf.host.page_block, kind, src, 1, ns)
        want_kind = np.full_like(kind, 7)
        want_src = np.where(ref.kind > 0, ref.src_row, 7)
        want_src = np.pad(want_src, ((1, 1), (ns, 3)), constant_values=7)
        want_kind[1:1 + h] = 0
        want_kind[1:1 + h, ns:ns + w] = ref.kind
        assert np.array_equal(kind, want_kind) and np.array_equal(src, want_src)
        for f in ("cached", "begins", "totals"):
            assert np.array_equal(getattr(got, f), getattr(ref, f)), f"step {step}: {f}"
        pages = int(np.take_along_axis(buf.table.n_pages, ids, 1)[~ref.cached].sum())
        assert got.counts.tolist() == [int((ref.kind == 1).sum()), int((ref.kind == 2).sum()),
                                       int(ref.cached.sum()), pages]
        before = _state(buf)
        plan = buf._update(ids, got, ns)
        compiled = _state(buf)
        _restore(buf, before)
        buf.compiled = None
        want = buf._update(ids, ref, ns)
        buf.compiled = mod
        _assert_same(before, compiled, _state(buf), f"step {step}")
        for p, q in zip(plan, want, strict=True):
            assert np.array_equal(p, q), f"step {step}: plan"
        buf.check_invariants()
        admitted += plan[0].size
        evicted += compiled["stats"]["pages_evicted"] - before["stats"]["pages_evicted"]
    if cache.get("cache_pages", 1) > 0:
        assert admitted > 0
    if cache.get("cache_pages") in (2, 9):
        assert evicted > 0
    mgr.close()


def test_bad_ids_and_an_overcommitted_pool_are_clear_errors(rng):
    h, m, c = 2, 300, 30
    mgr, buf, _, _ = _stores(RetroConfig(page_size=4, cache_pages=8), h, m, c, 16, rng)
    buf._sync()
    bad = np.array([[0, 30], [1, 2]])
    kind = np.zeros((h, 200), dtype=np.int32)
    src = np.zeros((h, 200), dtype=np.int64)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup_into(buf.compiled, bad, buf.host.page_block, kind, src, 0, 0)
    with pytest.raises(ValueError, match="cluster id 30 is out of range; accepted: 0 to 29"):
        buf.table.lookup(bad, buf.host.page_block)
    ids = _ids(c, 3, h, rng).numpy()
    lk = buf.table.lookup(ids, buf.host.page_block)
    buf.blocks.n_free[0] = 0  # as if another store had taken every block past its budget
    for compiled in (buf.compiled, None):
        buf.compiled = compiled
        with pytest.raises(RuntimeError, match="blocks asked, 0 free .budgets overcommitted"):
            buf._update(ids, lk, 0)
