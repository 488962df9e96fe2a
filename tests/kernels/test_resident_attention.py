"""kernels.resident_attention: tripartite decode read in place from a layer's pools, Triton
vs the torch reference (which packs an execution buffer), on ragged random rows."""

import pytest
import torch

from tests.helpers import as_meta_pool, slot_meta
from vllm_retro.kernels.resident_attention import (
    RETRIEVAL_MAPS,
    LayerPools,
    resident_attention_torch,
    resident_attention_triton,
    retrieval_runs,
)
from vllm_retro.kernels.step_plan import PLAN_FIELDS, plan_rows
from vllm_retro.kernels.tripartite_attention import tripartite_decode_ref


def _case(gen, dtype, g=4, d=64, h=2, slots=3, n_cap=300, c_cap=40, sink_cap=4, ring=24,
          rank=3):
    """Random pools and a step over every slot: clusters of ragged sizes (some empty) per
    pool row, a window wrapping the ring, a request with no clusters, steady slots in
    another order than the pools' slots. Returns (query, pools, plan, top, width, r_max,
    e_max)."""
    p = slots * h
    sizes = torch.zeros(p, c_cap, dtype=torch.int32)
    starts = torch.zeros(p, c_cap, dtype=torch.int64)
    counts = [c_cap, 17, 0]  # clusters per slot
    for row in range(p):
        c = counts[row // h]
        sz = torch.randint(0, 12, (c,), generator=gen).to(torch.int32)
        sizes[row, :c] = sz
        starts[row, :c] = sz.long().cumsum(0) - sz.long()
    f = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    pools = LayerPools(
        keys=f(p, n_cap, d).to(dtype), values=f(p, n_cap, d).to(dtype),
        centroids=f(p, c_cap, d).to(dtype), value_sums=(3 * f(p, c_cap, d)).to(dtype),
        sizes=sizes, starts=starts, spreads=f(p, c_cap).abs(),
        deviates=0.5 + f(p, c_cap).abs(), profile=f(p, d).abs() / d,
        key_factor=f(p, d, rank) / d ** 0.5, value_factor=f(p, d, rank) / d ** 0.5,
        steady_k=f(slots, sink_cap + ring, h, d).to(dtype),
        steady_v=f(slots, sink_cap + ring, h, d).to(dtype), sink_cap=sink_cap)
    order = [2, 0, 1]  # request b -> its slot
    k_top, r_max = 12, 3
    n_cl = torch.tensor(counts)[order]
    n_ret = torch.minimum(n_cl, torch.tensor(r_max))
    fields = {"slot": order, "steady_slot": [1, 2, 0], "clusters": n_cl,
              "retrieval": n_ret, "estimation": torch.minimum(n_cl - n_ret,
                                                              torch.tensor(k_top - r_max)),
              "sinks": [4, 2, 0], "ring_start": [17, 0, 22],  # the first wraps the ring
              "window": [20, 24, 5], "step": [1, 1, 1]}
    fields["meta_row"], fields["meta_stride"] = slot_meta(torch.tensor(order), h, c_cap)
    plan = torch.stack([torch.as_tensor(fields[k]) for k in PLAN_FIELDS]).long()
    rows = plan_rows(plan, h)
    scores = torch.rand(len(rows.pool_row), c_cap, generator=gen)
    scores = scores.masked_fill(torch.arange(c_cap)[None, :] >= rows.clusters[:, None], -1.0)
    top = scores.topk(k_top, dim=1).indices
    ends, _ = retrieval_runs(sizes, starts, rows, top, r_max)
    width = sink_cap + ring + int(ends[:, -1].max()) + 5  # the steady rows, then retrieval
    q = f(len(rows.pool_row), g, d).to(dtype)
    return q, pools, plan, top, width, r_max, k_top - r_max


def _all_retrieval(pools, plan, gen, r_max):
    """The step of ``plan`` with retrieval zones only: each row's first ``r_max`` clusters of
    a fresh ranking (as many as it has), nothing estimated. Returns (plan, top, width,
    e_max)."""
    i = PLAN_FIELDS.index
    plan = plan.clone()
    plan[i("retrieval")] = plan[i("clusters")].clamp_max(r_max)
    plan[i("estimation")] = 0
    rows = plan_rows(plan, pools.steady_k.shape[2])
    c_cap = pools.sizes.shape[1]
    scores = torch.rand(len(rows.pool_row), c_cap, generator=gen)
    scores = scores.masked_fill(torch.arange(c_cap)[None, :] >= rows.clusters[:, None], -1.0)
    top = scores.topk(r_max, dim=1).indices
    ends, _ = retrieval_runs(pools.sizes, pools.starts, rows, top, r_max)
    return plan, top, pools.steady_k.shape[1] + int(ends[:, -1].max()) + 5, 0


def test_torch_path_reads_the_tokens_the_module_describes():
    """The reference against a hand-assembled token list per row."""
    gen = torch.Generator().manual_seed(0)
    q, pools, plan, top, width, r_max, e_max = _case(gen, torch.float64)
    got = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125,
                                   tilted=False)
    ring = pools.steady_k.shape[1] - pools.sink_cap
    rows = plan_rows(plan, pools.steady_k.shape[2])
    for r in range(q.shape[0]):
        slot, head, prow = int(rows.steady_slot[r]), int(rows.head[r]), int(rows.pool_row[r])
        sinks, nst = int(rows.sinks[r]), int(rows.n_steady[r])
        zr = list(range(sinks)) + [pools.sink_cap + (int(rows.ring_start[r]) + i) % ring
                                   for i in range(nst - sinks)]
        ks = [pools.steady_k[slot, z, head] for z in zr]
        vs = [pools.steady_v[slot, z, head] for z in zr]
        for c in top[r, :int(rows.n_ret[r])].tolist():
            s0, n = int(pools.starts[prow, c]), int(pools.sizes[prow, c])
            ks += list(pools.keys[prow, s0:s0 + n])
            vs += list(pools.values[prow, s0:s0 + n])
        est = top[r, int(rows.n_ret[r]):int(rows.n_ret[r] + rows.n_est[r])]
        k = torch.stack(ks)[None]
        v = torch.stack(vs)[None]
        want, _ = tripartite_decode_ref(
            q[r:r + 1], k, v, torch.tensor([k.shape[1]]), pools.centroids[prow:prow + 1],
            pools.value_sums[prow:prow + 1], pools.sizes[prow:prow + 1], est[None],
            torch.tensor([est.numel()]), 0.125)
        torch.testing.assert_close(got[r], want[0], rtol=1e-5, atol=1e-5)  # both in fp32


def _on(dev, pools):
    return LayerPools(**{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                         for k, v in vars(pools).items()})


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tilted", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("retrieval_map", RETRIEVAL_MAPS)
@pytest.mark.parametrize("r_max", [3, 16])
def test_triton_matches_torch(dtype, tol, tilted, splits, retrieval_map, r_max,
                              triton_device):
    """Both ways of finding a retrieval token's cluster, with zones of 3 ranking slots and
    of 16 (every slot of a power-of-two search width used: the search's upper bound)."""
    gen = torch.Generator().manual_seed(1)
    q, pools, plan, top, width, _, e_max = _case(gen, dtype)
    if r_max != 3:  # every row's ranking slots all retrieval, as many as the rows have
        plan, top, width, e_max = _all_retrieval(pools, plan, gen, r_max)
    ref = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125, tilted)
    dev = triton_device
    got = resident_attention_triton(q.to(dev), _on(dev, pools), plan.to(dev), top.to(dev),
                                    width, r_max, e_max, 0.125, tilted,
                                    num_splits=splits, retrieval_map=retrieval_map).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_nan_query_row_stays_in_its_row(triton_device):
    gen = torch.Generator().manual_seed(2)
    q, pools, plan, top, width, r_max, e_max = _case(gen, torch.float32)
    q[1, 2, 7] = float("nan")
    dev = triton_device
    clean = resident_attention_torch(q.nan_to_num(), pools, plan, top, width, r_max, e_max,
                                     0.125)
    others = [i for i in range(q.shape[0]) if i != 1]
    for fn, d in ((resident_attention_torch, "cpu"), (resident_attention_triton, dev)):
        got = fn(q.to(d), _on(d, pools), plan.to(d), top.to(d), width, r_max, e_max,
                 0.125).cpu()
        torch.testing.assert_close(got[others], clean[others], rtol=1e-5, atol=1e-5)


def _shared_pool(pools: LayerPools, gen: torch.Generator) -> LayerPools:
    """The same tokens in one pool [M, D] every row shares (as a wave buffer's host tier
    keeps them): the pool rows' regions in a shuffled order, with gaps, starts absolute."""
    p, n, d = pools.keys.shape
    gap = 5
    order = torch.randperm(p, generator=gen)
    base = torch.empty(p, dtype=torch.int64)
    base[order] = torch.arange(p) * (n + gap) + gap
    keys = torch.full((p * (n + gap) + gap, d), float("nan"), dtype=pools.keys.dtype)
    keys[0] = 0  # the torch path's placeholder for masked reads (a finite row)
    values = keys.clone()
    for row in range(p):
        keys[base[row]:base[row] + n] = pools.keys[row]
        values[base[row]:base[row] + n] = pools.values[row]
    starts = pools.starts + base[:, None]
    fields = {**vars(pools), "keys": keys, "values": values, "starts": starts}
    return LayerPools(**fields)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("retrieval_map", RETRIEVAL_MAPS)
def test_a_shared_pool_read_in_place_gives_the_same_attention(dtype, tol, retrieval_map,
                                                              triton_device):
    """Tokens read in place from one shared pool ([M, D], absolute starts; the rows between
    regions NaN but row 0, which masked reads use, so a misplaced read shows) equal those
    read from per-row regions, in both paths."""
    gen = torch.Generator().manual_seed(3)
    q, pools, plan, top, width, r_max, e_max = _case(gen, dtype)
    shared = _shared_pool(pools, gen)
    assert shared.row_tokens == 0 and pools.row_tokens == pools.keys.shape[1]
    ref = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125)
    got = resident_attention_torch(q, shared, plan, top, width, r_max, e_max, 0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    dev = triton_device
    got = resident_attention_triton(q.to(dev), _on(dev, shared), plan.to(dev), top.to(dev),
                                    width, r_max, e_max, 0.125,
                                    retrieval_map=retrieval_map).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tilted", [True, False])
def test_meta_rows_read_in_a_layer_meta_pool_give_the_same_attention(dtype, tol, tilted,
                                                                     triton_device):
    """The meta rows in a layer meta pool's layout ([H, capacity, ...], each request's
    extent at its own start, NaN and nonzero sizes around them: any read outside a row's
    zones shows) give exactly the attention of per-slot rows, in both paths."""
    gen = torch.Generator().manual_seed(5)
    q, pools, plan, top, width, r_max, e_max = _case(gen, dtype)
    names = ("centroids", "value_sums", "sizes", "spreads", "deviates")
    clusters = [40, 17, 1]  # the case's per-slot clusters (a slot with none: one row)
    moved, starts, cap = as_meta_pool({n: getattr(pools, n) for n in names},
                                      pools.steady_k.shape[2], clusters, gen)
    shared = LayerPools(**{**vars(pools), **moved})
    splan = plan.clone()
    slots = plan[PLAN_FIELDS.index("slot")].tolist()
    splan[PLAN_FIELDS.index("meta_row")] = torch.tensor([starts[s] for s in slots])
    splan[PLAN_FIELDS.index("meta_stride")] = cap
    ref = resident_attention_torch(q, pools, plan, top, width, r_max, e_max, 0.125, tilted)
    got = resident_attention_torch(q, shared, splan, top, width, r_max, e_max, 0.125, tilted)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    dev = triton_device
    got = resident_attention_triton(q.to(dev), _on(dev, shared), splan.to(dev), top.to(dev),
                                    width, r_max, e_max, 0.125, tilted).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_an_unknown_retrieval_map_is_refused():
    gen = torch.Generator().manual_seed(4)
    q, pools, plan, top, width, r_max, e_max = _case(gen, torch.float32)
    with pytest.raises(ValueError, match="retrieval_map 'bisect'; accepted: onehot, search"):
        resident_attention_triton(q, pools, plan, top, width, r_max, e_max, 0.125,
                                  retrieval_map="bisect")
