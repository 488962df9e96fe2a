"""K-means building blocks: nearest-centroid assignment and per-cluster scatter sums.

Both work on a batch of independent problems ``S`` (one per (KV head, segment)), each with
its own number of valid points ``n_valid[s]`` and valid centroids ``k_valid[s]``; padding
beyond those is ignored. Similarity is the inner product (spherical k-means passes unit
vectors). Sums are fp32 whatever the input dtype; the Triton assignment multiplies 16-bit
operands on tensor cores (exact products) and fp32 ones in IEEE fp32.
"""

from __future__ import annotations

import torch

from vllm_retro.kernels._common import block_size, check_float, tensor_cores_16bit, tl, triton


def _valid_masks(
    n: int, k: int, n_valid: torch.Tensor, k_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = n_valid.device
    pmask = torch.arange(n, device=dev)[None, :] < n_valid[:, None].to(dev)
    cmask = torch.arange(k, device=dev)[None, :] < k_valid[:, None].to(dev)
    return pmask, cmask


def kmeans_assign_ref(
    x: torch.Tensor, centroids: torch.Tensor, n_valid: torch.Tensor, k_valid: torch.Tensor
) -> torch.Tensor:
    """Nearest centroid by inner product.

    x: [S, N, D] points; centroids: [S, K, D]; n_valid, k_valid: [S] integer counts.
    Returns [S, N] int64 cluster ids in [0, k_valid[s]), -1 for padding points. Ties go to the
    lowest id.
    """
    sims = torch.bmm(x.float(), centroids.float().transpose(1, 2))  # [S, N, K]
    pmask, cmask = _valid_masks(x.shape[1], centroids.shape[1], n_valid, k_valid)
    sims = sims.masked_fill(~cmask[:, None, :], float("-inf"))
    assign = sims.argmax(dim=2)
    return torch.where(pmask, assign, torch.full_like(assign, -1))


def scatter_sum_ref(
    x: torch.Tensor, assign: torch.Tensor, num_clusters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums of features and member counts.

    x: [S, N, F] features; assign: [S, N] cluster ids (-1 = ignore); num_clusters: K.
    Returns (sums [S, K, F] fp32, counts [S, K] fp32).
    """
    s, n, f = x.shape
    valid = assign >= 0
    idx = torch.where(valid, assign, torch.zeros_like(assign))
    sums = torch.zeros(s, num_clusters, f, dtype=torch.float32, device=x.device)
    # ignored points add exact zeros (a product with 0 would carry their NaNs in)
    xv = torch.where(valid[..., None], x.float(), 0.0)
    sums.scatter_add_(1, idx[..., None].expand(s, n, f), xv)
    counts = torch.zeros(s, num_clusters, dtype=torch.float32, device=x.device)
    counts.scatter_add_(1, idx, valid.float())
    return sums, counts


def kmeans_assign_torch(
    x: torch.Tensor, centroids: torch.Tensor, n_valid: torch.Tensor, k_valid: torch.Tensor
) -> torch.Tensor:
    """:func:`kmeans_assign_ref`'s result (bit for bit), built for speed with torch ops: one
    batched GEMM and an argmax, with the cluster mask applied in place and only when some set
    has fewer valid clusters than the widest (the last, shorter segment), and the point mask
    only when some set has padding."""
    s, n, _ = x.shape
    k = centroids.shape[1]
    sims = torch.bmm(x.float(), centroids.float().transpose(1, 2))  # [S, N, K]
    dev = x.device
    k_valid = k_valid.to(dev)
    n_valid = n_valid.to(dev)
    if k and _some_below(k_valid, k):
        cmask = torch.arange(k, device=dev)[None, :] >= k_valid[:, None]
        sims.masked_fill_(cmask[:, None, :], float("-inf"))
    assign = sims.argmax(dim=2)
    if n and _some_below(n_valid, n):
        assign.masked_fill_(torch.arange(n, device=dev)[None, :] >= n_valid[:, None], -1)
    return assign


def _some_below(counts: torch.Tensor, width: int) -> bool:
    """Whether some set has fewer than ``width`` valid entries, so a mask is needed: read
    on the CPU; on a GPU assumed (reading it would make the host wait for the device)."""
    return counts.device.type == "cuda" or bool((counts < width).any())


def kmeans_assign_cpu(
    x: torch.Tensor, centroids: torch.Tensor, n_valid: torch.Tensor, k_valid: torch.Tensor
) -> torch.Tensor:
    """:func:`kmeans_assign_ref` on CPU through the C++ extension
    (``kernels/csrc/kmeans_cpu.cpp``): the similarity GEMM and the argmax fused, so the
    [S, N, K] similarity matrix is never materialised. Same arguments and result, up to
    rounding: each similarity is one fp32 multiply-add chain, so a choice can differ from the
    reference only where two clusters tie to ~1e-6. Raises RuntimeError when the extension
    is unavailable (see :func:`available_cpu`)."""
    from vllm_retro.kernels import cpu_ext

    mod = cpu_ext.load()
    if mod is None:
        raise RuntimeError(f"the CPU k-means kernel is unavailable: {cpu_ext.load_error()}")
    s, n, _ = x.shape
    out = torch.empty(s, n, dtype=torch.int64)
    mod.kmeans_assign(x.float().contiguous(), centroids.float().contiguous(),
                      n_valid.to(torch.int64).contiguous(), k_valid.to(torch.int64).contiguous(),
                      out)
    return out


def available_cpu() -> bool:
    """True when :func:`kmeans_assign_cpu` can run (the C++ extension is built or buildable)."""
    from vllm_retro.kernels import cpu_ext

    return cpu_ext.available()


def scatter_sum_torch(
    x: torch.Tensor, assign: torch.Tensor, num_clusters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scatter_sum_ref`'s result (bit for bit: each sum adds its members in token
    order), built for speed: one row-wise ``index_add_`` over all sets (padding goes to a
    dump row) and one for the counts, instead of an element-wise scatter (no ``bincount``,
    which reads its largest value back on a GPU)."""
    s, n, f = x.shape
    k = num_clusters
    base = torch.arange(s, device=x.device)[:, None] * k
    dump = s * k
    idx = torch.where(assign >= 0, assign + base, torch.full_like(assign, dump)).reshape(-1)
    sums = torch.zeros(dump + 1, f, dtype=torch.float32, device=x.device)
    sums.index_add_(0, idx, x.reshape(s * n, f).float())
    counts = torch.zeros(dump + 1, dtype=torch.float32, device=x.device)
    counts.index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float32, device=x.device))
    counts = counts[:dump]
    return sums[:dump].reshape(s, k, f), counts.reshape(s, k)


@triton.jit
def _kmeans_assign_kernel(
    X, CEN, NV, KV, OUT, STOP,
    N, D,
    sx_s, sx_n, sc_s, sc_k, so_s,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT16: tl.constexpr,
    HAS_STOP: tl.constexpr,
):
    s = tl.program_id(0)
    nb = tl.program_id(1)
    nv = tl.load(NV + s)
    kv = tl.load(KV + s)
    if HAS_STOP:  # a stopped k-means: no loads, no products, -1 written
        live = tl.load(STOP) == 0
        nv = tl.where(live, nv, 0)
        kv = tl.where(live, kv, 0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    nmask = offs_n < nv
    x = tl.load(
        X + s * sx_s + offs_n[:, None] * sx_n + offs_d[None, :],
        mask=nmask[:, None] & dmask[None, :], other=0.0,
    )
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, kv, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < kv
        c = tl.load(
            CEN + s * sc_s + offs_k[:, None] * sc_k + offs_d[None, :],
            mask=kmask[:, None] & dmask[None, :], other=0.0,
        )
        if DOT16:  # 16-bit operands: tensor-core products (exact in fp32), fp32 sums
            sim = tl.dot(x, tl.trans(c), out_dtype=tl.float32)
        else:
            sim = tl.dot(x.to(tl.float32), tl.trans(c.to(tl.float32)), input_precision="ieee")
        sim = tl.where(kmask[None, :], sim, float("-inf"))
        bmax = tl.max(sim, axis=1)
        barg = tl.argmax(sim, axis=1).to(tl.int32) + k0
        upd = bmax > best
        best = tl.where(upd, bmax, best)
        best_i = tl.where(upd, barg, best_i)
    out = tl.where(nmask, best_i, -1)
    tl.store(OUT + s * so_s + offs_n, out.to(tl.int64), mask=offs_n < N)


def kmeans_assign_triton(
    x: torch.Tensor, centroids: torch.Tensor, n_valid: torch.Tensor, k_valid: torch.Tensor,
    stop: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kmeans_assign_ref` (same arguments and result, up to ties
    within rounding). Points and centroids of one 16-bit dtype multiply on tensor cores with
    fp32 sums on CUDA (:func:`~vllm_retro.kernels._common.tensor_cores_16bit`), anything
    else in IEEE fp32. ``stop`` (a device scalar, read by the kernel): when nonzero the
    kernel does nothing and the result is unspecified (a k-means that stopped on the device
    skips its remaining rounds' work without the host knowing)."""
    check_float("x", x)
    check_float("centroids", centroids)
    x = x.contiguous()
    centroids = centroids.contiguous()
    s, n, d = x.shape
    out = torch.empty(s, n, dtype=torch.int64, device=x.device)
    if s == 0 or n == 0:
        return out
    block_d = block_size(d)
    block_n = 64 if block_d <= 128 else 32
    grid = (s, triton.cdiv(n, block_n))
    _kmeans_assign_kernel[grid](
        x, centroids, n_valid.to(x.device, torch.int32), k_valid.to(x.device, torch.int32), out,
        out if stop is None else stop, n, d,
        x.stride(0), x.stride(1), centroids.stride(0), centroids.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=32, BLOCK_D=block_d,
        DOT16=tensor_cores_16bit(x, centroids), HAS_STOP=stop is not None,
    )
    return out


@triton.jit
def _scatter_sum_kernel(
    X, A, SUMS, CNT, STOP,
    N, K, F,
    sx_s, sx_n, sa_s,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, HAS_STOP: tl.constexpr,
):
    s = tl.program_id(0)
    nb = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_STOP:  # a stopped k-means: nothing read or added
        N = tl.where(tl.load(STOP) == 0, N, 0)
    nmask = offs_n < N
    a = tl.load(A + s * sa_s + offs_n, mask=nmask, other=-1)
    valid = nmask & (a >= 0)
    a = tl.where(valid, a, 0)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        m2 = valid[:, None] & (offs_f < F)[None, :]
        xv = tl.load(X + s * sx_s + offs_n[:, None] * sx_n + offs_f[None, :], mask=m2, other=0.0)
        tl.atomic_add(SUMS + (s * K + a[:, None]) * F + offs_f[None, :], xv.to(tl.float32), mask=m2)
    ones = tl.full([BLOCK_N], 1.0, tl.float32)
    tl.atomic_add(CNT + s * K + a, ones, mask=valid)


def scatter_sum_triton(
    x: torch.Tensor, assign: torch.Tensor, num_clusters: int,
    stop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`scatter_sum_ref` (same arguments and result; fp32 atomics, so
    the summation order, and the last bits, may vary between runs on a GPU). ``stop``: as
    :func:`kmeans_assign_triton`'s (nonzero: nothing summed, zeros returned)."""
    check_float("x", x)
    x = x.contiguous()
    assign = assign.contiguous().to(torch.int64)
    s, n, f = x.shape
    sums = torch.zeros(s, num_clusters, f, dtype=torch.float32, device=x.device)
    counts = torch.zeros(s, num_clusters, dtype=torch.float32, device=x.device)
    if s == 0 or n == 0 or num_clusters == 0:
        return sums, counts
    block_n = 64
    grid = (s, triton.cdiv(n, block_n))
    _scatter_sum_kernel[grid](
        x, assign, sums, counts, counts if stop is None else stop, n, num_clusters, f,
        x.stride(0), x.stride(1), assign.stride(0),
        BLOCK_N=block_n, BLOCK_F=min(128, block_size(f)), HAS_STOP=stop is not None,
    )
    return sums, counts
