"""kernels.scoring: GQA summed-softmax centroid scores, Triton vs torch reference."""

import math

import pytest
import torch

from tests.helpers import as_meta_pool, slot_meta
from vllm_retro.kernels.scoring import (
    cluster_scores_ref,
    cluster_scores_triton,
    pool_scores_ref,
    pool_scores_triton,
    top_clusters,
)
from vllm_retro.kernels.step_plan import PLAN_FIELDS


def test_ref_matches_naive(rng):
    r, g, c, d = 2, 3, 11, 32
    q, cen = torch.randn(r, g, d, generator=rng), torch.randn(r, c, d, generator=rng)
    sizes = torch.randint(0, 3, (r, c), generator=rng)
    scale = 0.3
    got = cluster_scores_ref(q, cen, sizes, scale)
    for i in range(r):
        valid = [m for m in range(c) if sizes[i, m] > 0]
        total = [0.0] * c
        for h in range(g):
            logits = {m: float(q[i, h] @ cen[i, m]) * scale for m in valid}
            z = sum(math.exp(v) for v in logits.values())
            for m in valid:
                total[m] += math.exp(logits[m]) / z
        for m in range(c):
            if m in valid:
                assert abs(float(got[i, m]) - math.log(total[m])) < 1e-5
            else:
                assert got[i, m] == float("-inf")


@pytest.mark.parametrize("r,g,c,d", [(1, 1, 1, 32), (2, 7, 50, 64), (3, 8, 130, 80),
                                     (2, 2, 64, 128), (1, 4, 33, 256), (4, 16, 70, 64)])
@pytest.mark.parametrize("dtype,q_dtype", [
    (torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
    (torch.bfloat16, torch.float32),  # an fp32 query over 16-bit centroids
])
def test_triton_matches_ref(r, g, c, d, dtype, q_dtype, rng, triton_device):
    q = torch.randn(r, g, d, generator=rng).to(q_dtype or dtype)
    cen = torch.randn(r, c, d, generator=rng).to(dtype)
    sizes = torch.randint(0, 4, (r, c), generator=rng)
    sizes[:, 0] = 5
    ref = cluster_scores_ref(q, cen, sizes, d ** -0.5)
    got = cluster_scores_triton(q.to(triton_device), cen.to(triton_device),
                                sizes.to(triton_device), d ** -0.5).cpu()
    assert not got.isnan().any()
    assert (torch.isinf(got) == torch.isinf(ref)).all()
    fin = torch.isfinite(ref)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # 16-bit: the order of sums differs
    torch.testing.assert_close(got[fin], ref[fin], rtol=tol, atol=tol)


def test_all_empty_row_is_minus_inf(triton_device):
    q = torch.randn(2, 3, 32)
    cen = torch.randn(2, 5, 32)
    sizes = torch.zeros(2, 5, dtype=torch.int32)
    sizes[1, 2] = 1
    for fn in (cluster_scores_ref, cluster_scores_triton):
        dev = triton_device if fn is cluster_scores_triton else "cpu"
        out = fn(q.to(dev), cen.to(dev), sizes.to(dev), 0.2).cpu()
        assert torch.isinf(out[0]).all() and torch.isfinite(out[1, 2])
        assert torch.isinf(out[1, [0, 1, 3, 4]]).all()


def _pool(rng, p, cap, d, dtype, counts):
    """A meta pool of ``p`` rows: row i has counts[i] clusters (some empty), zeros after."""
    cen = torch.zeros(p, cap, d)
    sizes = torch.zeros(p, cap, dtype=torch.int32)
    for i, n in enumerate(counts):
        cen[i, :n] = torch.randn(n, d, generator=rng)
        sizes[i, :n] = torch.randint(0, 4, (n,), generator=rng)
        sizes[i, 0] = 3
    return cen.to(dtype), sizes


def _plan(slots, clusters, heads, cap):
    """A step plan (kernels.step_plan) of requests in ``slots`` with ``clusters`` each, the
    meta rows in a pool of ``cap`` columns per (slot, head)."""
    plan = torch.zeros(len(PLAN_FIELDS), len(slots), dtype=torch.int64)
    plan[PLAN_FIELDS.index("slot")] = torch.tensor(slots)
    plan[PLAN_FIELDS.index("clusters")] = torch.tensor(clusters)
    where = slot_meta(torch.tensor(slots), heads, cap)
    plan[PLAN_FIELDS.index("meta_row")], plan[PLAN_FIELDS.index("meta_stride")] = where
    return plan


@pytest.mark.parametrize("g,d,width", [(1, 32, 64), (4, 128, 300), (7, 64, 129), (8, 256, 70)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-3),
                                       (torch.float16, 2e-3)])
def test_pool_scores_triton_matches_ref(g, d, width, dtype, tol, rng, triton_device):
    """Rows read from a pool through the plan's slots (permuted, one repeated; 2 KV heads
    per request), ragged clusters with empty ones (lowest finite score) and padding (-inf),
    widths across block edges."""
    counts = [width, width // 2, 1, width - 3, 7, 2]  # per pool row (slot * 2 + head)
    cen, sizes = _pool(rng, 6, width + 16, d, dtype, counts)
    slots = [2, 0, 1, 0]
    plan = _plan(slots, [max(counts[2 * s], counts[2 * s + 1]) for s in slots], 2, width + 16)
    q = torch.randn(2 * len(slots), g, d, generator=rng).to(dtype)
    ref = pool_scores_ref(q, cen, sizes, plan, width, d ** -0.5)
    dev = triton_device
    got = pool_scores_triton(q.to(dev), cen.to(dev), sizes.to(dev), plan.to(dev), width,
                             d ** -0.5).cpu()
    assert not got.isnan().any()
    assert torch.equal(got == float("-inf"), ref == float("-inf"))
    lowest = torch.finfo(torch.float32).min
    assert torch.equal(got == lowest, ref == lowest) and (ref == lowest).any()
    fin = torch.isfinite(ref) & (ref > lowest)
    # 16-bit operands: the products are exact, only their order of summation differs
    torch.testing.assert_close(got[fin], ref[fin], rtol=tol, atol=tol)
    k = 5  # the ranking the step takes from them
    agree = (got.topk(k, dim=1).indices == ref.topk(k, dim=1).indices).float().mean()
    assert agree >= (1.0 if dtype == torch.float32 else 0.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_scores_read_a_layer_meta_pool_in_place(dtype, rng, triton_device):
    """The same rows in a layer meta pool's layout ([H, capacity, D], each request's extent
    at its own start, NaN and nonzero sizes around them) score exactly as from per-slot
    rows: nothing outside a row's clusters is read, even where the step's width reaches
    past its extent (the last one ends the pool)."""
    counts = [50, 50, 3, 3, 70, 70]  # per (slot, head): 3 slots of 2 heads
    cen, sizes = _pool(rng, 6, 80, 64, dtype, counts)
    pool, starts, cap = as_meta_pool({"centroids": cen, "sizes": sizes}, 2, [50, 3, 70], rng)
    slots = [2, 0, 1]
    plan = _plan(slots, [counts[2 * s] for s in slots], 2, 80)
    shared = plan.clone()
    shared[PLAN_FIELDS.index("meta_row")] = torch.tensor([starts[s] for s in slots])
    shared[PLAN_FIELDS.index("meta_stride")] = cap
    q = torch.randn(6, 4, 64, generator=rng).to(dtype)
    want = pool_scores_ref(q, cen, sizes, plan, 80, 0.125)
    got = pool_scores_ref(q, pool["centroids"], pool["sizes"], shared, 80, 0.125)
    assert torch.equal(got, want)
    dev = triton_device
    tri = pool_scores_triton(q.to(dev), pool["centroids"].to(dev), pool["sizes"].to(dev),
                             shared.to(dev), 80, 0.125).cpu()
    assert not tri.isnan().any()
    assert torch.equal(tri == float("-inf"), want == float("-inf"))
    fin = torch.isfinite(want)
    torch.testing.assert_close(tri[fin], want[fin], rtol=2e-3, atol=2e-3)


def test_pool_scores_nan_query_row_stays_in_its_row(rng, triton_device):
    cen, sizes = _pool(rng, 4, 80, 64, torch.float32, [80, 40, 60, 10])
    plan = _plan([0, 1], [80, 60], 2, 80)
    q = torch.randn(4, 4, 64, generator=rng)
    q[1, 2, 5] = float("nan")
    dev = triton_device
    clean = pool_scores_ref(q.nan_to_num(), cen, sizes, plan, 80, 0.125)
    for fn, d in ((pool_scores_ref, "cpu"), (pool_scores_triton, dev)):
        out = fn(q.to(d), cen.to(d), sizes.to(d), plan.to(d), 80, 0.125).cpu()
        torch.testing.assert_close(out[[0, 2, 3]], clean[[0, 2, 3]], rtol=1e-5, atol=1e-5)


def test_top_clusters_ranks_ties_by_column_like_the_cpu_kernel(rng):
    # exact ties (columns copied), NaN, +-inf and both signs: the ranking is (score desc,
    # column asc), NaN first, as a stable descending sort gives it
    scores = torch.randn(6, 300, generator=rng)
    scores[:, ::7] = scores[:, 3:4]
    scores[1, 10] = float("nan")
    scores[2, :5] = float("inf")
    scores[3, -20:] = float("-inf")
    scores[4] = -scores[4].abs()
    for k in (0, 1, 40, 300):
        got = top_clusters(scores, k)
        want = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(got, want), k
    assert top_clusters(torch.tensor([[-0.5, 2.0, -0.5, 2.0]]), 3).tolist() == [[1, 3, 0]]
    with pytest.raises(ValueError, match="k=5; accepted: 0..4"):
        top_clusters(torch.zeros(1, 4), 5)
    with pytest.raises(ValueError, match="dtype"):
        top_clusters(torch.zeros(1, 4, dtype=torch.float64), 2)
