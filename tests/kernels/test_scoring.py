"""kernels.scoring: GQA summed-softmax centroid scores, Triton vs torch reference."""

import math

import pytest
import torch

from vllm_retro.kernels.scoring import cluster_scores_ref, cluster_scores_triton


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(r, g, c, d, dtype, rng, triton_device):
    q = torch.randn(r, g, d, generator=rng).to(dtype)
    cen = torch.randn(r, c, d, generator=rng).to(dtype)
    sizes = torch.randint(0, 4, (r, c), generator=rng)
    sizes[:, 0] = 5
    ref = cluster_scores_ref(q, cen, sizes, d ** -0.5)
    got = cluster_scores_triton(q.to(triton_device), cen.to(triton_device),
                                sizes.to(triton_device), d ** -0.5).cpu()
    assert not got.isnan().any()
    assert (torch.isinf(got) == torch.isinf(ref)).all()
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


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
