"""Segmented spherical k-means over post-RoPE keys (RetroInfer §4.2).

Each (KV head, segment) is clustered independently: keys are mean-centred per segment and
normalised, centroids start from an evenly strided choice of the segment's keys, and
``iters`` rounds of assignment / renormalised-mean update follow (an emptied cluster keeps its
previous centroid). The meta index then stores, per cluster, the arithmetic mean of its *raw*
keys (the Jensen lower bound of eq. 3 needs exactly that mean), the sum of its values, its
size and its *spread* (mean squared distance of its keys from that mean); clusters that end
empty get size 0 and are masked everywhere downstream. The block's residual moments (per
dimension key variance, key-value cross-covariance), summed over clusters, feed the tilted
estimator (:mod:`vllm_retro.index.estimator`).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

from vllm_retro import kernels
from vllm_retro.kernels import take_rows, upload


@dataclass(frozen=True)
class Clusters:
    """The clustering of one block of tokens for every KV head (cluster-contiguous layout).

    Cluster ids are local to this block: ``0 .. num_clusters - 1``, numbered segment by
    segment, identical across heads in count (not in membership).
    """

    centroids: torch.Tensor
    """[H, C, D] mean of each cluster's raw keys (zeros for empty clusters), KV dtype."""
    value_sums: torch.Tensor
    """[H, C, D] sum of each cluster's values, KV dtype (accumulated in fp32)."""
    sizes: torch.Tensor
    """[H, C] int32 tokens per cluster (0 = empty, masked)."""
    spreads: torch.Tensor
    """[H, C] fp32 mean of ``|k - centroid|^2`` over each cluster's keys (0 for empty ones)."""
    key_sq: torch.Tensor
    """[H, D] fp32 sum over the block's tokens of ``(k - centroid)^2``, per dimension."""
    cross: torch.Tensor
    """[H, D, D] fp32 sum over the block's tokens of ``(v - mean v) (k - centroid)^T``
    (centroid and mean value of the token's cluster)."""
    order: torch.Tensor
    """[H, M] int64 token offsets within the block, sorted by cluster (cluster-contiguous)."""
    offsets: torch.Tensor
    """[H, C + 1] int64 start of each cluster's run in ``order``."""
    iterations: int = 0
    """k-means rounds run; fewer than asked when it stopped early (with the stop decided on
    the device, as on CUDA, the rounds queued until the host heard of it: see
    :func:`kmeans_rounds`)."""

    @property
    def num_clusters(self) -> int:
        """Clusters per head, empty ones included."""
        return int(self.sizes.shape[1])


def residual_moments(
    keys: torch.Tensor, values: torch.Tensor, assign: torch.Tensor,
    key_means: torch.Tensor, value_means: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Second moments of keys and values about their cluster's means, in fp32.

    keys, values: [S, N, D]; assign: [S, N] cluster of each token (-1 = padding);
    key_means, value_means: [S, K, D]. Returns (spread sums [S, K]: sum of ``|k - C|^2``
    per cluster; key_sq [S, D]: sum of ``(k - C)^2`` per dimension; cross [S, D, D]: sum of
    ``(v - mean v)(k - C)^T``).
    """
    valid = (assign >= 0)[..., None]
    a = assign.clamp_min(0)
    dk = (keys.float() - take_rows(key_means.float(), a)) * valid
    dv = (values.float() - take_rows(value_means.float(), a)) * valid
    sq = dk * dk
    spread = torch.zeros(key_means.shape[:2], dtype=torch.float32, device=keys.device)
    spread.scatter_add_(1, a, sq.sum(-1))
    return spread, sq.sum(1), torch.bmm(dv.transpose(1, 2), dk)


def clusters_per_segment(segment_lengths: list[int], tokens_per_cluster: int) -> list[int]:
    """About one centroid per ``tokens_per_cluster`` tokens (at least one) for each segment."""
    return [max(1, math.ceil(n / tokens_per_cluster)) for n in segment_lengths]


def spherical_kmeans(
    x: torch.Tensor,
    n_valid: torch.Tensor,
    k_valid: torch.Tensor,
    iters: int,
    backend: str = "auto",
    tol: float = 0.0,
) -> torch.Tensor:
    """Spherical k-means on a batch of independent point sets.

    x: [S, N, D] points (any float dtype); n_valid, k_valid: [S] valid points / clusters per set.
    Points are centred on their set's mean and normalised; centroids are initialised from
    points at strided positions ``floor(i * n_valid / k_valid)``. Returns [S, N] int64
    assignments (-1 for padding points). See :func:`kmeans_with_stop` for ``tol``.
    """
    return kmeans_with_stop(x, n_valid, k_valid, iters, backend, tol)[0]


def kmeans_with_stop(
    x: torch.Tensor,
    n_valid: torch.Tensor,
    k_valid: torch.Tensor,
    iters: int,
    backend: str = "auto",
    tol: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """:func:`spherical_kmeans`, stopping early once an assignment pass moves at most ``tol``
    of the valid points (a fraction in [0, 1)). Returns (assignments, centroid updates run).

    With ``tol == 0`` it stops only when no point moved: the centroids would then not change
    again, so the result is exactly that of all ``iters`` rounds, for less work. A negative
    ``tol`` never stops early.
    """
    return run_steps(kmeans_rounds(x, n_valid, k_valid, iters, backend, tol))


T = TypeVar("T")


def run_steps(steps: Generator[None, None, T]) -> T:
    """Run a stepwise computation (a generator that yields between steps) to its end and
    return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def kmeans_rounds(
    x: torch.Tensor,
    n_valid: torch.Tensor,
    k_valid: torch.Tensor,
    iters: int,
    backend: str = "auto",
    tol: float = 0.0,
    kmax: int | None = None,
    device_stop: bool | None = None,
) -> Generator[None, None, tuple[torch.Tensor, int]]:
    """:func:`kmeans_with_stop` as a generator that yields after every round, so a caller can
    spread the rounds over several decode steps; returns what it returns.

    ``kmax``: the largest of ``k_valid`` when the caller knows it (else it is read from the
    tensor: a host sync on a GPU). ``device_stop`` (default: on CUDA) decides the early stop
    on the device, without waiting for it: rounds after the stop leave the centroids as
    they were (their Triton kernels read the flag and skip their work), so the assignments
    are exactly the host-decided stop's. The host, which queues rounds ahead of the device,
    ends the loop once it hears of the stop (the flag is copied back without blocking,
    :class:`_LateStop`: between rounds spread over decode steps it has), else after all
    ``iters`` rounds. On CUDA, 16-bit points are assigned in their own dtype (tensor-core
    products, fp32 sums; :func:`assign_dtype`)."""
    s, n, d = x.shape
    dev = x.device
    if device_stop is None:
        device_stop = dev.type == "cuda"
    n_valid = n_valid.to(dev, torch.int64)
    k_valid = k_valid.to(dev, torch.int64)
    pmask = torch.arange(n, device=dev)[None, :] < n_valid[:, None]
    xf = x.float() * pmask[..., None]
    mean = xf.sum(1, keepdim=True) / n_valid.clamp_min(1)[:, None, None]
    xn = torch.nn.functional.normalize((xf - mean) * pmask[..., None], dim=2, eps=1e-12)
    if kmax is None:
        kmax = int(k_valid.max().item()) if s else 0
    i = torch.arange(kmax, device=dev)[None, :]
    init = (i * n_valid[:, None]) // k_valid.clamp_min(1)[:, None]
    init = torch.minimum(init, (n_valid - 1).clamp_min(0)[:, None])
    cen = take_rows(xn, init)
    points = xn.to(assign_dtype(x))
    n32, k32 = n_valid.to(torch.int32), k_valid.to(torch.int32)  # the kernels' (once)

    def assign_to(centroids: torch.Tensor, stop: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.kmeans_assign(points, centroids.to(points.dtype), n32, k32,
                                     backend=backend, stop=stop)

    if device_stop:
        allowed = tol * n_valid.sum()
        stopped = torch.zeros((), dtype=torch.int32, device=dev)  # the kernels' flag
        late = _LateStop(dev)
    else:
        allowed = tol * float(n_valid.sum().item()) if s else 0.0
    prev = None
    for it in range(iters):
        if device_stop and late.seen():
            return assign_to(cen), it
        assign = assign_to(cen, stopped if device_stop else None)
        keep = None
        if prev is not None:
            moved = (assign != prev).sum()
            if device_stop:
                stopped = stopped | (moved <= allowed)
                keep = stopped
                late.post(stopped)
            elif int(moved.item()) <= allowed:
                return assign, it
        sums, counts = kernels.scatter_sum(xn, assign, kmax, backend=backend,
                                           stop=keep)
        new = torch.nn.functional.normalize(sums, dim=2, eps=1e-12)
        update = (counts > 0)[..., None]
        cen = torch.where(update if keep is None else update & (keep == 0), new, cen)
        prev = assign
        yield
    return assign_to(cen), iters


class _LateStop:
    """A device-side stop flag the host reads without waiting: each :meth:`post` copies it
    into pinned memory behind the work that computed it; :meth:`seen` is True once such a
    copy has landed with the flag set. Never True off CUDA (nothing to read without a wait
    there is not a device's)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.int32, pin_memory=True)
            self.event = torch.cuda.Event()
            self.posted = False

    def post(self, flag: torch.Tensor) -> None:
        if self.cuda:
            self.host.copy_(flag, non_blocking=True)
            self.event.record()
            self.posted = True

    def seen(self) -> bool:
        return self.cuda and self.posted and self.event.query() and bool(self.host)


def assign_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype k-means assigns points of dtype ``x.dtype`` on ``x.device`` in: 16-bit
    points on CUDA in their own dtype (their products are exact in fp32: tensor cores, fp32
    sums, ~1e-3 relative off the fp32-normalised points' similarities), else fp32."""
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        return x.dtype
    return torch.float32


def cluster_block(
    keys: torch.Tensor,
    values: torch.Tensor,
    segment_size: int,
    clusters_for: list[int] | None,
    tokens_per_cluster: int,
    iters: int,
    backend: str = "auto",
    tol: float = 0.0,
    device_stop: bool | None = None,
) -> Clusters:
    """Cluster a block of tokens, per KV head, in independent segments.

    keys, values: [H, M, D] (post-RoPE keys). The block is cut into segments of
    ``segment_size`` tokens (the last may be shorter); segment j gets ``clusters_for[j]``
    clusters, or one per ``tokens_per_cluster`` tokens when ``clusters_for`` is None.
    At most ``iters`` k-means rounds, fewer once a round moves at most ``tol`` of the keys
    (:func:`kmeans_with_stop`; ``device_stop``: see :func:`kmeans_rounds`). Returns the
    block's :class:`Clusters`.
    """
    return run_steps(cluster_block_steps(keys, values, segment_size, clusters_for,
                                         tokens_per_cluster, iters, backend, tol, device_stop))


def cluster_block_steps(
    keys: torch.Tensor,
    values: torch.Tensor,
    segment_size: int,
    clusters_for: list[int] | None,
    tokens_per_cluster: int,
    iters: int,
    backend: str = "auto",
    tol: float = 0.0,
    device_stop: bool | None = None,
) -> Generator[None, None, Clusters]:
    """:func:`cluster_block` as a generator yielding after every k-means round (the same
    arithmetic, so the same clusters); returns the :class:`Clusters`. Nothing in it makes
    the host wait for the device (a GPU build never waits on its own work): it reads no
    device data back and uploads the integers the host knows (segment lengths, cluster
    counts) without waiting (:func:`~vllm_retro.kernels.upload`)."""
    h, m, d = keys.shape
    dev = keys.device
    seg = min(segment_size, m)
    n_seg = math.ceil(m / seg)
    seg_lens = [min(seg, m - j * seg) for j in range(n_seg)]
    ks = clusters_for or clusters_per_segment(seg_lens, tokens_per_cluster)
    if len(ks) != n_seg:
        raise ValueError(f"clusters_for has {len(ks)} entries for {n_seg} segments")
    ks = [min(k, n) for k, n in zip(ks, seg_lens, strict=False)]
    pad = n_seg * seg - m
    kp = torch.nn.functional.pad(keys, (0, 0, 0, pad)).reshape(h * n_seg, seg, d)
    n_valid = upload(seg_lens * h, dev)
    k_valid = upload(ks * h, dev)
    kmax = max(ks)
    assign, rounds = yield from kmeans_rounds(kp, n_valid, k_valid, iters, backend, tol, kmax,
                                              device_stop)
    vp = torch.nn.functional.pad(values, (0, 0, 0, pad)).reshape(h * n_seg, seg, d)
    sums, counts = kernels.scatter_sum(torch.cat([kp, vp], dim=2), assign, kmax, backend=backend)
    means = sums / counts.clamp_min(1.0)[..., None]
    spread, key_sq, cross = residual_moments(kp, vp, assign, means[..., :d], means[..., d:])
    # keep each segment's first k_j slots: [H, n_seg * kmax] -> [H, C]
    slot = upload([j * kmax + i for j, k in enumerate(ks) for i in range(k)], dev)
    c_total = sum(ks)
    counts = counts.reshape(h, n_seg * kmax).index_select(1, slot)
    sums = sums.reshape(h, n_seg * kmax, 2 * d).index_select(1, slot)
    spread = spread.reshape(h, n_seg * kmax).index_select(1, slot)
    centroids = sums[..., :d] / counts.clamp_min(1.0)[..., None]
    # global (block-local) cluster id of every token, then a stable sort gives the layout
    seg_base = upload([0] + ks[:-1], dev).cumsum(0)  # [n_seg]
    gid = assign.reshape(h, n_seg, seg) + seg_base[None, :, None]
    gid = gid.reshape(h, n_seg * seg)[:, :m]
    order = torch.argsort(gid, dim=1, stable=True)
    sizes = counts.round().to(torch.int32)
    offsets = torch.zeros(h, c_total + 1, dtype=torch.int64, device=dev)
    offsets[:, 1:] = sizes.to(torch.int64).cumsum(1)
    return Clusters(
        centroids=centroids.to(keys.dtype),
        value_sums=sums[..., d:].to(values.dtype),
        sizes=sizes,
        spreads=spread / counts.clamp_min(1.0),
        key_sq=key_sq.reshape(h, n_seg, d).sum(1),
        cross=cross.reshape(h, n_seg, d, d).sum(1),
        order=order,
        offsets=offsets,
        iterations=rounds,
    )
