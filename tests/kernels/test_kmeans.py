"""kernels.kmeans: Triton vs torch reference, and the reference vs a naive loop."""

import pytest
import torch

from vllm_retro.kernels.kmeans import (
    kmeans_assign_cpu,
    kmeans_assign_ref,
    kmeans_assign_torch,
    kmeans_assign_triton,
    scatter_sum_ref,
    scatter_sum_torch,
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scatter_sum_triton_matches_ref(shape, dtype, rng, triton_device):
    s, n, k, d = shape
    x = torch.randn(s, n, 2 * d, generator=rng).to(dtype)
    a = torch.randint(-1, k, (s, n), generator=rng)
    ref_s, ref_c = scatter_sum_ref(x, a, k)
    got_s, got_c = scatter_sum_triton(x.to(triton_device), a.to(triton_device), k)
    torch.testing.assert_close(got_s.cpu(), ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_c.cpu(), ref_c, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [*SHAPES, (16, 512, 32, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ragged", [True, False])
def test_fast_torch_path_is_bit_identical_to_ref(shape, dtype, ragged, rng):
    """The torch backend's fast assignment and scatter sums give exactly the reference's
    result (same ids, same fp32 bits), with and without padding / short sets."""
    s, n, k, d = shape
    x = torch.randn(s, n, d, generator=rng).to(dtype)
    c = torch.randn(s, k, d, generator=rng).to(dtype)
    if ragged:
        n_valid, k_valid = _ragged(s, n, k, rng)
    else:
        n_valid, k_valid = torch.full((s,), n), torch.full((s,), k)
    assert torch.equal(kmeans_assign_torch(x, c, n_valid, k_valid),
                       kmeans_assign_ref(x, c, n_valid, k_valid))
    a = kmeans_assign_ref(x, c, n_valid, k_valid)
    if not ragged:
        a[0, : n // 3] = -1
    for got, ref in zip(scatter_sum_torch(x, a, k), scatter_sum_ref(x, a, k), strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("shape", [*SHAPES, (2, 4096, 256, 64), (3, 1000, 70, 128)])
@pytest.mark.parametrize("ragged", [True, False])
def test_fused_cpu_assign_matches_ref(shape, ragged, rng):
    """The C++ fused assignment (GEMM + argmax, no similarity matrix) chooses the reference's
    cluster for every point, except where two clusters tie within rounding; padding points
    get -1. Unit-norm inputs, as spherical k-means passes them."""
    s, n, k, d = shape
    x = torch.nn.functional.normalize(torch.randn(s, n, d, generator=rng), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(s, k, d, generator=rng), dim=-1)
    if ragged:
        n_valid, k_valid = _ragged(s, n, k, rng)
    else:
        n_valid, k_valid = torch.full((s,), n), torch.full((s,), k)
    ref = kmeans_assign_ref(x, c, n_valid, k_valid)
    got = kmeans_assign_cpu(x, c, n_valid, k_valid)
    assert got.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(got == -1, ref == -1)
    valid = ref >= 0
    assert ((got[valid] >= 0) & (got[valid] < k_valid[:, None].expand_as(ref)[valid])).all()
    sims = torch.bmm(x.double(), c.double().transpose(1, 2))
    best = sims.gather(2, ref.clamp_min(0)[..., None])[..., 0]
    chosen = sims.gather(2, got.clamp_min(0)[..., None])[..., 0]
    assert torch.allclose(chosen[valid], best[valid], rtol=0, atol=1e-6)
    assert (got[valid] == ref[valid]).float().mean() > 0.999


def test_fused_cpu_assign_exact_ties_take_the_first_cluster():
    """Duplicate centroids tie exactly: the lowest id wins, as argmax's first occurrence, also
    across the kernel's 16-wide column tiles and its lanes."""
    d = 32
    x = torch.nn.functional.normalize(torch.randn(1, 20, d), dim=-1)
    c = torch.randn(1, 40, d)
    c[0, 3] = c[0, 21] = c[0, 37] = x[0, 0] * 5  # the best for point 0, three times
    c[0, 9] = c[0, 25] = x[0, 1] * 5
    n_valid, k_valid = torch.tensor([20]), torch.tensor([40])
    got = kmeans_assign_cpu(x, c, n_valid, k_valid)
    assert got[0, 0] == 3 and got[0, 1] == 9
    assert torch.equal(got, kmeans_assign_ref(x, c, n_valid, k_valid))


def test_fused_cpu_assign_rejects_bad_counts():
    x, c = torch.randn(1, 8, 16), torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match=r"k_valid 5 \(accepted 0..4\)"):
        kmeans_assign_cpu(x, c, torch.tensor([8]), torch.tensor([5]))


def test_dispatch_runs_the_fused_kernel_on_cpu(rng, monkeypatch):
    """'auto' on CPU goes through the C++ kernel; the 'torch' backend stays bit-identical to
    the reference."""
    import vllm_retro.kernels as kernels

    calls = []
    real = kernels.kmeans_assign_cpu
    monkeypatch.setattr(kernels, "kmeans_assign_cpu", lambda *a: calls.append(1) or real(*a))
    x = torch.nn.functional.normalize(torch.randn(2, 64, 32, generator=rng), dim=-1)
    c = x[:, :8].clone()
    nv, kv = torch.tensor([64, 60]), torch.tensor([8, 5])
    kernels.kmeans_assign(x, c, nv, kv)
    assert calls == [1]
    assert torch.equal(kernels.kmeans_assign(x, c, nv, kv, backend="torch"),
                       kmeans_assign_ref(x, c, nv, kv))
    assert calls == [1]


@pytest.mark.parametrize("flag", [0, 1])
def test_triton_kernels_skip_their_work_once_stopped(flag, rng, triton_device):
    """A k-means stopped on the device hands its kernels the flag: unset they compute as
    without it; set the assignment writes -1 and the scatter adds nothing."""
    s, n, k, d = 3, 100, 13, 64
    x = torch.randn(s, n, d, generator=rng).to(triton_device)
    c = torch.randn(s, k, d, generator=rng).to(triton_device)
    n_valid, k_valid = _ragged(s, n, k, rng)
    stop = torch.tensor(flag, dtype=torch.int32, device=triton_device)
    plain = kmeans_assign_triton(x, c, n_valid, k_valid)
    got = kmeans_assign_triton(x, c, n_valid, k_valid, stop)
    sums, counts = scatter_sum_triton(x, plain, k, stop)
    if flag:
        assert (got == -1).all() and not sums.any() and not counts.any()
    else:
        assert torch.equal(got, plain)
        want_sums, want_counts = scatter_sum_ref(x.cpu(), plain.cpu(), k)
        torch.testing.assert_close(sums.cpu(), want_sums, rtol=1e-5, atol=1e-5)
        assert torch.equal(counts.cpu(), want_counts)


ASSIGNERS = {  # name -> assign(x, c, n_valid, k_valid, device the kernel runs on)
    "ref": lambda x, c, nv, kv, dev: kmeans_assign_ref(x, c, nv, kv),
    "torch": lambda x, c, nv, kv, dev: kmeans_assign_torch(x, c, nv, kv),
    "cpu": lambda x, c, nv, kv, dev: kmeans_assign_cpu(x, c, nv, kv),
    "triton": lambda x, c, nv, kv, dev: kmeans_assign_triton(x.to(dev), c.to(dev), nv,
                                                             kv).cpu(),
}


@pytest.mark.parametrize("impl", list(ASSIGNERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_point_gets_a_valid_cluster_and_leaves_the_others_alone(impl, dtype, rng,
                                                                      request):
    """A point whose key holds a NaN (a broken model's) still gets a cluster id in range —
    the id indexes the sums and the pools later, so an id out of range would write out of
    bounds — and every other point's choice is the one it makes without the NaN point
    (ties within rounding aside)."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    s, n, k, d = 2, 70, 11, 64
    x = torch.nn.functional.normalize(torch.randn(s, n, d, generator=rng), dim=-1).to(dtype)
    c = torch.nn.functional.normalize(torch.randn(s, k, d, generator=rng), dim=-1).to(dtype)
    n_valid, k_valid = torch.tensor([n, n - 9]), torch.tensor([k, k - 4])
    clean = ASSIGNERS[impl](x, c, n_valid, k_valid, device)
    bad = x.clone()
    bad[0, 5, 7] = float("nan")
    bad[1, 40] = float("nan")
    got = ASSIGNERS[impl](bad, c, n_valid, k_valid, device)
    for i, j in ((0, 5), (1, 40)):
        assert 0 <= int(got[i, j]) < int(k_valid[i]), (i, j, int(got[i, j]))
    others = torch.ones(s, n, dtype=torch.bool)
    others[0, 5] = others[1, 40] = False
    assert torch.equal(got[others], clean[others])
    assert torch.equal(got == -1, kmeans_assign_ref(x, c, n_valid, k_valid) == -1)


@pytest.mark.parametrize("impl", ["ref", "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_point_poisons_only_its_own_clusters_sum(impl, dtype, rng, request):
    """A NaN feature of a point reaches its own cluster's sum of that feature and nothing
    else: every other sum and every count is the clean one (bit for bit against the
    reference; the Triton kernel's atomics within rounding)."""
    s, n, k, f = 2, 90, 6, 80
    x = torch.randn(s, n, f, generator=rng).to(dtype)
    a = torch.randint(-1, k, (s, n), generator=rng)
    a[0, 3], a[1, 10] = 2, -1  # a NaN in a member of cluster 2, and in an ignored point
    bad = x.clone()
    bad[0, 3, 17] = float("nan")
    bad[1, 10] = float("nan")
    if impl == "triton":
        dev = request.getfixturevalue("triton_device")
        sums, counts = (t.cpu() for t in scatter_sum_triton(bad.to(dev), a.to(dev), k))
    else:
        sums, counts = (scatter_sum_ref if impl == "ref" else scatter_sum_torch)(bad, a, k)
    want_sums, want_counts = scatter_sum_ref(x, a, k)
    nan = torch.zeros(s, k, f, dtype=torch.bool)
    nan[0, 2, 17] = True
    assert torch.equal(sums.isnan(), nan)
    tol = 1e-5 if impl == "triton" else 0.0
    torch.testing.assert_close(sums[~nan], want_sums[~nan], rtol=tol, atol=tol)
    assert torch.equal(counts, want_counts)
