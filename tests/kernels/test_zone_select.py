"""kernels.zone_select: the device step's zones — torch against the rule written out row by row
(top_clusters over the row's own clusters), Triton against torch, with ties, empty clusters,
NaN and infinities, rows of different sizes and zone widths."""

import pytest
import torch

from vllm_retro.kernels.scoring import top_clusters
from vllm_retro.kernels.step_plan import PLAN_FIELDS
from vllm_retro.kernels.zone_select import select_zones_torch, select_zones_triton

EMPTY = -3.4028234663852886e38  # pool_scores' score of an empty cluster in a row's range


def _plan(clusters, n_ret, n_est):
    fields = {"clusters": clusters, "retrieval": n_ret, "estimation": n_est}
    return torch.stack([torch.as_tensor(fields.get(k, [0] * len(clusters)))
                        for k in PLAN_FIELDS]).long()


def _by_rule(scores, plan, heads, r_max, e_max):
    """The zones written out per row: the row's top n_ret + n_est of its own clusters by
    (score desc, id asc), each zone then in id order, zeros after."""
    k = min(r_max + e_max, scores.shape[1])
    out = torch.zeros(scores.shape[0], k, dtype=torch.int64)
    for r in range(scores.shape[0]):
        c, nr, ne = (int(plan[PLAN_FIELDS.index(f), r // heads])
                     for f in ("clusters", "retrieval", "estimation"))
        ranked = top_clusters(scores[r:r + 1, :c].contiguous(), nr + ne)[0]
        out[r, :nr + ne] = torch.cat([ranked[:nr].sort().values, ranked[nr:].sort().values])
    return out


def _scores(rng, rows, width, clusters, heads):
    s = torch.randn(rows, width, generator=rng) * 3
    for r in range(rows):
        c = clusters[r // heads]
        s[r, c:] = float("-inf")  # past the row's clusters (pool_scores' padding)
        s[r, :c:5] = s[r, 1]  # exact ties
        s[r, 2:c:11] = EMPTY
    return s


CASES = [  # (clusters per request, n_ret, n_est, heads, r_max, e_max)
    ([40], [3], [10], 2, 3, 10),
    ([300, 77, 5], [6, 16, 5], [60, 20, 0], 2, 16, 60),
    ([1000, 2044], [18, 37], [230, 475], 4, 37, 475),
    ([64, 64], [0, 64], [64, 0], 1, 64, 64),  # no retrieval zone; one zone is everything
]


@pytest.mark.parametrize("clusters,n_ret,n_est,heads,r_max,e_max", CASES)
def test_torch_zones_follow_the_rule(clusters, n_ret, n_est, heads, r_max, e_max, rng):
    plan = _plan(clusters, n_ret, n_est)
    s = _scores(rng, len(clusters) * heads, max(clusters), clusters, heads)
    got = select_zones_torch(s, plan, r_max, e_max)
    assert torch.equal(got, _by_rule(s, plan, heads, r_max, e_max))


@pytest.mark.parametrize("clusters,n_ret,n_est,heads,r_max,e_max", CASES)
def test_triton_equals_torch(clusters, n_ret, n_est, heads, r_max, e_max, rng, triton_device):
    plan = _plan(clusters, n_ret, n_est)
    s = _scores(rng, len(clusters) * heads, max(clusters), clusters, heads)
    want = select_zones_torch(s, plan, r_max, e_max)
    got = select_zones_triton(s.to(triton_device), plan.to(triton_device), r_max, e_max)
    assert torch.equal(got.cpu(), want)


def test_all_tied_nan_and_infinities(rng, triton_device):
    # a zero query ties every cluster: zones in id order; NaN ranks first, then +inf
    s = torch.zeros(3, 50)
    s[1, 7] = float("nan")
    s[1, 20] = float("inf")
    s[1, 30] = float("-inf")
    s[2] = torch.randn(50, generator=rng).abs().neg()  # all negative, -0.0 never
    plan = _plan([50, 50, 50], [4, 4, 4], [6, 6, 6])
    want = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    torch_zones = select_zones_torch(s, plan, 4, 6)
    assert torch.equal(torch_zones[0:1], want)
    # NaN and +inf, then the first two tied zeros, listed in id order
    assert torch_zones[1, :4].tolist() == [0, 1, 7, 20] and 30 not in torch_zones[1].tolist()
    assert torch.equal(torch_zones, _by_rule(s, plan, 1, 4, 6))
    got = select_zones_triton(s.to(triton_device), plan.to(triton_device), 4, 6)
    assert torch.equal(got.cpu(), torch_zones)


def test_bad_arguments_name_the_value():
    plan = _plan([4], [1], [1])
    with pytest.raises(ValueError, match="float32"):
        select_zones_torch(torch.zeros(1, 4, dtype=torch.float64), plan, 1, 1)
    with pytest.raises(ValueError, match="r_max=-1"):
        select_zones_torch(torch.zeros(1, 4), plan, -1, 1)
    with pytest.raises(ValueError, match="3 score rows for a plan of 2"):
        select_zones_torch(torch.zeros(3, 4), _plan([4, 4], [1, 1], [1, 1]), 1, 1)
