"""kernels.kmeans: Triton vs torch reference, and the reference vs a naive loop."""

import pytest
import torch
from vllm_retro.kernels.kmeans import (
    kmeans_assign_ref,
    kmeans_assign_triton,
    scatter_sum_ref,
    scatter_sum_triton,
)

SHAPES = [  # S, N, K, D
    (1, 1, 1, 32),
    (3, 100, 13, 64),
    (2, 257, 40, 80),
    (4, 64, 64, 128),
    (2, 96, 7, 256),
]


def _ragged(s, n, k, g):
    n_valid = torch.randint(1, n + 1, (s,), generator=g)
    n_valid[0] = n
    k_valid = torch.randint(1, k + 1, (s,), generator=g)
    k_valid[-1] = k
    return n_valid, k_valid


def test_assign_ref_matches_naive_loop(rng):
    s, n, k, d = 3, 50, 9, 32
    x, c = torch.randn(s, n, d, generator=rng), torch.randn(s, k, d, generator=rng)
    n_valid, k_valid = _ragged(s, n, k, rng)
    got = kmeans_assign_ref(x, c, n_valid, k_valid)
    for i in range(s):
        for j in range(n):
            if j >= n_valid[i]:
                assert got[i, j] == -1
            else:
                sims = [float(x[i, j] @ c[i, m]) for m in range(int(k_valid[i]))]
                assert got[i, j] == max(range(len(sims)), key=lambda m: (sims[m], -m))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_assign_triton_matches_ref(shape, dtype, rng, triton_device):
    s, n, k, d = shape
    x = torch.randn(s, n, d, generator=rng).to(dtype)
    c = torch.randn(s, k, d, generator=rng).to(dtype)
    n_valid, k_valid = _ragged(s, n, k, rng)
    ref = kmeans_assign_ref(x, c, n_valid, k_valid)
    got = kmeans_assign_triton(x.to(triton_device), c.to(triton_device), n_valid, k_valid).cpu()
    assert ((got == -1) == (ref == -1)).all()
    valid = ref >= 0
    assert ((got[valid] >= 0) & (got[valid] < k_valid[:, None].expand_as(ref)[valid])).all()
    # where the choice differs it must be a tie up to rounding
    sims = torch.bmm(x.float(), c.float().transpose(1, 2))
    best = sims.gather(2, ref.clamp_min(0)[..., None])[..., 0]
    chosen = sims.gather(2, got.clamp_min(0)[..., None])[..., 0]
    assert torch.allclose(chosen[valid], best[valid], rtol=1e-5, atol=1e-5)
    assert (got[valid] == ref[valid]).float().mean() > 0.99


def test_scatter_sum_ref_matches_naive(rng):
    s, n, k, f = 2, 40, 6, 5
    x = torch.randn(s, n, f, generator=rng)
    a = torch.randint(-1, k, (s, n), generator=rng)
    sums, counts = scatter_sum_ref(x, a, k)
    for i in range(s):
        for m in range(k):
            sel = a[i] == m
            torch.testing.assert_close(sums[i, m], x[i][sel].sum(0), rtol=1e-5, atol=1e-5)
            assert counts[i, m] == sel.sum()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scatter_sum_triton_matches_ref(shape, dtype, rng, triton_device):
    s, n, k, d = shape
    x = torch.randn(s, n, 2 * d, generator=rng).to(dtype)
    a = torch.randint(-1, k, (s, n), generator=rng)
    ref_s, ref_c = scatter_sum_ref(x, a, k)
    got_s, got_c = scatter_sum_triton(x.to(triton_device), a.to(triton_device), k)
    torch.testing.assert_close(got_s.cpu(), ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_c.cpu(), ref_c, rtol=0, atol=0)
