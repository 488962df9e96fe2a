"""vllm_retro.index.clustering: segmented spherical k-means, the cluster layout and the
residual moments (spreads, per-dimension key variance, value-key cross-covariance)."""

import dataclasses

import pytest
import torch

from vllm_retro.index.clustering import cluster_block, clusters_per_segment, spherical_kmeans


def _check_layout(cl, keys, values, segment_size):
    h, m, d = keys.shape
    c = cl.num_clusters
    key_sq = torch.zeros(h, d, dtype=torch.float64)
    cross = torch.zeros(h, d, d, dtype=torch.float64)
    assert cl.centroids.shape == (h, c, d) and cl.value_sums.shape == (h, c, d)
    assert cl.sizes.shape == (h, c) and cl.offsets.shape == (h, c + 1)
    for i in range(h):
        # every token exactly once, cluster-contiguous
        assert torch.equal(cl.order[i].sort().values, torch.arange(m))
        assert int(cl.sizes[i].sum()) == m and int(cl.offsets[i, -1]) == m
        for j in range(c):
            a, b = int(cl.offsets[i, j]), int(cl.offsets[i, j + 1])
            assert b - a == int(cl.sizes[i, j])
            members = cl.order[i, a:b]
            if b == a:
                continue
            # a cluster never spans two segments
            assert len(set((members // segment_size).tolist())) == 1
            torch.testing.assert_close(cl.centroids[i, j].float(),
                                       keys[i, members].float().mean(0), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(cl.value_sums[i, j].float(),
                                       values[i, members].float().sum(0), rtol=1e-4, atol=1e-4)
            dk = keys[i, members].double() - keys[i, members].double().mean(0)
            dv = values[i, members].double() - values[i, members].double().mean(0)
            assert float(cl.spreads[i, j]) == pytest.approx(float((dk * dk).sum(1).mean()),
                                                            rel=1e-4, abs=1e-5)
            key_sq[i] += (dk * dk).sum(0)
            cross[i] += dv.T @ dk
    assert cl.spreads.dtype == torch.float32 and (cl.spreads[cl.sizes == 0] == 0).all()
    torch.testing.assert_close(cl.key_sq.double(), key_sq, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(cl.cross.double(), cross, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("h,m,d,seg,tpc", [(2, 300, 32, 128, 16), (1, 1000, 64, 1000, 16),
                                           (3, 517, 128, 256, 8), (1, 40, 256, 16, 16)])
def test_layout_and_meta_index(h, m, d, seg, tpc, rng):
    keys = torch.randn(h, m, d, generator=rng)
    values = torch.randn(h, m, d, generator=rng)
    cl = cluster_block(keys, values, seg, None, tpc, iters=5, backend="torch")
    seg_lens = [min(seg, m - j * seg) for j in range(-(-m // seg))]
    assert cl.num_clusters == sum(clusters_per_segment(seg_lens, tpc))
    _check_layout(cl, keys, values, seg)


def test_deterministic(rng):
    keys, values = torch.randn(2, 600, 64, generator=rng), torch.randn(2, 600, 64, generator=rng)
    a = cluster_block(keys, values, 256, None, 16, 10, backend="torch")
    b = cluster_block(keys, values, 256, None, 16, 10, backend="torch")
    assert torch.equal(a.order, b.order) and torch.equal(a.centroids, b.centroids)


def test_triton_backend_matches_torch(rng, triton_device):
    keys, values = torch.randn(2, 700, 64, generator=rng), torch.randn(2, 700, 64, generator=rng)
    a = cluster_block(keys, values, 512, None, 16, 10, backend="torch")
    b = cluster_block(keys.to(triton_device), values.to(triton_device), 512, None, 16, 10,
                      backend="triton")
    # identical up to argmax ties from rounding: near-identical clusterings
    assert (a.sizes == b.sizes.cpu()).float().mean() > 0.95
    cpu = {f.name: getattr(b, f.name).cpu() for f in dataclasses.fields(b)
           if isinstance(getattr(b, f.name), torch.Tensor)}
    _check_layout(dataclasses.replace(b, **cpu), keys, values, 512)


def test_recovers_separated_directions(rng):
    """Keys in k runs, each around its own direction: the strided initialisation seeds one
    centroid per run and k-means recovers the runs exactly."""
    k, per, d = 8, 30, 64
    dirs = torch.nn.functional.normalize(torch.randn(k, d, generator=rng), dim=1)
    labels = torch.arange(k).repeat_interleave(per)
    x = dirs[labels] * 10 + 0.3 * torch.randn(k * per, d, generator=rng)
    assign = spherical_kmeans(x[None], torch.tensor([k * per]), torch.tensor([k]), 10, "torch")[0]
    assert assign.unique().numel() == k
    for c in assign.unique():
        assert labels[assign == c].unique().numel() == 1


def _objective(x, assign, k):
    xn = torch.nn.functional.normalize(x - x.mean(0), dim=1)
    total = 0.0
    for c in range(k):
        members = xn[assign == c]
        if len(members):
            total += float(members.sum(0).norm())  # = sum of cosines to the normalised mean
    return total


def test_iterations_improve_the_objective(rng):
    """Shuffled clustered data: each k-means round never lowers the spherical objective."""
    k, per, d = 8, 30, 32
    dirs = torch.nn.functional.normalize(torch.randn(k, d, generator=rng), dim=1)
    labels = torch.arange(k).repeat_interleave(per)[torch.randperm(k * per, generator=rng)]
    x = dirs[labels] * 3 + torch.randn(k * per, d, generator=rng)
    objs = [_objective(x, spherical_kmeans(x[None], torch.tensor([k * per]), torch.tensor([k]),
                                           it, "torch")[0], k) for it in range(6)]
    assert all(b >= a - 1e-4 for a, b in zip(objs, objs[1:], strict=False)), objs
    assert objs[-1] > objs[0]


def test_empty_clusters_are_masked():
    """Identical keys: one real cluster, the rest end up empty (size 0, zero centroid)."""
    keys = torch.ones(1, 64, 32)
    values = torch.randn(1, 64, 32)
    cl = cluster_block(keys, values, 64, [4], 16, 10, backend="torch")
    assert cl.num_clusters == 4
    assert int((cl.sizes > 0).sum()) >= 1 and int(cl.sizes.sum()) == 64
    assert (cl.centroids[cl.sizes == 0] == 0).all()
    _check_layout(cl, keys, values, 64)


def test_padding_points_never_assigned(rng):
    x = torch.randn(2, 50, 32, generator=rng)
    a = spherical_kmeans(x, torch.tensor([50, 20]), torch.tensor([5, 3]), 4, "torch")
    assert (a[1, 20:] == -1).all() and (a[1, :20] >= 0).all() and (a[1, :20] < 3).all()


def test_early_stop_at_zero_tolerance_is_exact(rng):
    """Stopping once no key moves gives exactly the clustering of all rounds (the centroids
    cannot change any more), in fewer rounds on data that converges."""
    from vllm_retro.index.clustering import kmeans_with_stop

    keys, values = torch.randn(2, 900, 64, generator=rng), torch.randn(2, 900, 64, generator=rng)
    full = cluster_block(keys, values, 512, None, 16, 30, backend="torch", tol=-1.0)
    fast = cluster_block(keys, values, 512, None, 16, 30, backend="torch")
    assert full.iterations == 30 and fast.iterations < 30
    for name in ("order", "sizes", "centroids", "value_sums", "spreads", "offsets"):
        assert torch.equal(getattr(full, name), getattr(fast, name)), name
    # a tolerance stops sooner, and reports it
    x = torch.randn(4, 300, 32, generator=rng)
    nv, kv = torch.full((4,), 300), torch.full((4,), 20)
    _, exact_rounds = kmeans_with_stop(x, nv, kv, 50, "torch", 0.0)
    _, loose_rounds = kmeans_with_stop(x, nv, kv, 50, "torch", 0.05)
    assert loose_rounds < exact_rounds <= 50


@pytest.mark.parametrize("tol", [0.0, 0.01, 0.3, -1.0])
def test_the_stop_decided_on_the_device_gives_the_same_clusters(tol, rng):
    """With the early stop decided on the device (as on CUDA: every round runs, rounds after
    the stop leave the centroids alone) the clusters are exactly the host-decided stop's."""
    keys, values = torch.randn(2, 1100, 64, generator=rng), torch.randn(2, 1100, 64, generator=rng)
    host = cluster_block(keys, values, 512, None, 16, 12, "torch", tol, device_stop=False)
    dev = cluster_block(keys, values, 512, None, 16, 12, "torch", tol, device_stop=True)
    assert dev.iterations == 12 and (host.iterations < 12) == (tol >= 0)
    for name in ("order", "sizes", "centroids", "value_sums", "spreads", "offsets", "key_sq",
                 "cross"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name


def test_a_device_build_never_waits_on_the_device(rng):
    """The block's clustering as a GPU runs it (Triton kernels), held on CPU tensors to the
    device contract: no operation that would make the host wait for the device (no scalar
    read back, no boolean-mask indexing, nothing copied to the host), with its launches per
    round counted; only integers the host knows are uploaded."""
    backend = "triton"
    from vllm_retro.kernels.sync_check import HostSyncError, SyncCheck

    keys, values = torch.randn(2, 1100, 64, generator=rng), torch.randn(2, 1100, 64, generator=rng)
    want = cluster_block(keys, values, 512, None, 16, 3, backend, 0.01, device_stop=False)
    launches = []
    for iters in (2, 3):
        with SyncCheck(uploads=True) as check:
            got = cluster_block(keys, values, 512, None, 16, iters, backend, 0.01,
                                device_stop=True)
        launches.append(check.launches)
    for name in ("order", "sizes", "centroids", "value_sums", "spreads", "offsets"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    per_round = launches[1] - launches[0]
    # the assignment and scatter-sum kernels, the moved count and stop flag, the update
    assert per_round <= 15, check.ops
    # the host-decided stop reads the moved count back
    with pytest.raises(HostSyncError, match="device scalar"), SyncCheck(uploads=True):
        cluster_block(keys, values, 512, None, 16, 3, backend, 0.01, device_stop=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_build_never_syncs_and_gives_the_host_stops_clusters():
    """On a GPU (bf16 keys, Triton kernels, tensor-core assignment): no host sync
    (``set_sync_debug_mode("error")``) and the clusters of the host-decided stop exactly."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(4, 20000, 128, generator=g).to("cuda", torch.bfloat16)
    values = torch.randn(4, 20000, 128, generator=g).to("cuda", torch.bfloat16)
    host = cluster_block(keys, values, 8192, None, 16, 30, "auto", 0.01, device_stop=False)
    cluster_block(keys, values, 8192, None, 16, 30, "auto", 0.01)  # compile, warm the pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = cluster_block(keys, values, 8192, None, 16, 30, "auto", 0.01)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name in ("order", "sizes", "centroids", "value_sums", "spreads", "offsets"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name
    assert host.iterations < 30 and host.iterations < dev.iterations <= 30
