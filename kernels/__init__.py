"""Kernels of the wave index, each a Triton kernel with a plain-torch reference.

The functions here dispatch: the Triton path on CUDA tensors (or when forced), the torch
reference otherwise. Modules:

- :mod:`kernels.kmeans` — nearest-centroid assignment and per-cluster scatter sums;
- :mod:`kernels.scoring` — GQA-summed softmax scores of centroids;
- :mod:`kernels.gather` — execution-buffer assembly from a device pool and the host tier;
- :mod:`kernels.tripartite_attention` — weighted decode attention over exact tokens and
  size-weighted centroids (the paper's estimator, or the spread-corrected *tilted* one),
  merged through log-sum-exp.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from vllm_retro.kernels._common import take_rows, upload
from vllm_retro.kernels.cluster_cache import (
    ClusterCache,
    cache_lookup_torch,
    cache_lookup_triton,
)
from vllm_retro.kernels.gather import gather_runs_ref, gather_runs_triton
from vllm_retro.kernels.kmeans import (
    available_cpu,
    kmeans_assign_cpu,
    kmeans_assign_torch,
    kmeans_assign_triton,
    scatter_sum_torch,
    scatter_sum_triton,
)
from vllm_retro.kernels.resident_attention import (
    LayerPools,
    resident_attention_torch,
    resident_attention_triton,
)
from vllm_retro.kernels.scoring import (
    cluster_scores_ref,
    cluster_scores_triton,
    pool_scores_ref,
    pool_scores_triton,
    top_clusters,
)
from vllm_retro.kernels.tripartite_attention import (
    TiltTerms,
    tripartite_decode_torch,
    tripartite_decode_triton,
)
from vllm_retro.kernels.zone_select import select_zones_torch, select_zones_triton

__all__ = [
    "ClusterCache",
    "TiltTerms",
    "cache_lookup",
    "cluster_scores",
    "gather_runs",
    "kmeans_assign",
    "pool_scores",
    "resident_attention",
    "resolve_backend",
    "scatter_sum",
    "select_zones",
    "take_rows",
    "upload",
    "top_clusters",
    "tripartite_decode",
]


def resolve_backend(backend: str, device: torch.device) -> str:
    """'triton' or 'torch' for a requested backend ('auto'|'torch'|'triton') on ``device``.

    'auto' picks Triton on CUDA and the torch reference elsewhere. Forcing 'triton' on a
    non-CUDA device needs the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"kernel_backend='triton' needs CUDA tensors (got device {device}) or "
            "TRITON_INTERPRET=1; use 'auto' or 'torch' on CPU"
        )
    if backend not in ("torch", "triton"):
        raise ValueError(
            f"kernel backend {backend!r} is invalid; accepted: 'auto', 'torch', 'triton'"
        )
    return backend


def kmeans_assign(x: Tensor, centroids: Tensor, n_valid: Tensor, k_valid: Tensor,
                  backend: str = "auto", stop: Tensor | None = None) -> Tensor:
    """Dispatching :func:`kernels.kmeans.kmeans_assign_ref`: 'auto' on CPU runs the fused C++
    kernel (:func:`kernels.kmeans.kmeans_assign_cpu`, equal up to ties within rounding) when
    the extension is built; the torch backend runs the reference's faster, bit-identical
    :func:`kernels.kmeans.kmeans_assign_torch`. ``stop``: a device flag; when it is set the
    result is unspecified (the Triton kernel skips its work; the others compute anyway)."""
    if resolve_backend(backend, x.device) == "triton":
        return kmeans_assign_triton(x, centroids, n_valid, k_valid, stop)
    if backend == "auto" and x.device.type == "cpu" and available_cpu():
        return kmeans_assign_cpu(x, centroids, n_valid, k_valid)
    return kmeans_assign_torch(x, centroids, n_valid, k_valid)


def scatter_sum(x: Tensor, assign: Tensor, num_clusters: int,
                backend: str = "auto", stop: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dispatching :func:`kernels.kmeans.scatter_sum_ref` (the torch backend runs its faster,
    bit-identical :func:`kernels.kmeans.scatter_sum_torch`). ``stop``: as
    :func:`kmeans_assign`'s."""
    if resolve_backend(backend, x.device) == "triton":
        return scatter_sum_triton(x, assign, num_clusters, stop)
    return scatter_sum_torch(x, assign, num_clusters)


def cluster_scores(query: Tensor, centroids: Tensor, sizes: Tensor, scale: float,
                   backend: str = "auto") -> Tensor:
    """Dispatching :func:`kernels.scoring.cluster_scores_ref`."""
    if resolve_backend(backend, query.device) == "triton":
        return cluster_scores_triton(query, centroids, sizes, scale)
    return cluster_scores_ref(query, centroids, sizes, scale)


def pool_scores(query: Tensor, centroids: Tensor, sizes: Tensor, plan: Tensor, width: int,
                scale: float, backend: str = "auto") -> Tensor:
    """Dispatching :func:`kernels.scoring.pool_scores_ref` (scores of a step's rows read
    from a layer's meta pool)."""
    args = (query, centroids, sizes, plan, width, scale)
    if resolve_backend(backend, query.device) == "triton":
        return pool_scores_triton(*args)
    return pool_scores_ref(*args)


def select_zones(scores: Tensor, plan: Tensor, r_max: int, e_max: int,
                 backend: str = "auto") -> Tensor:
    """Dispatching :func:`kernels.zone_select.select_zones_torch`: each row's retrieval and
    estimation zones from its scores [R, W] (ties by cluster id), [R, min(r_max + e_max, W)]
    int64."""
    if resolve_backend(backend, scores.device) == "triton":
        return select_zones_triton(scores, plan, r_max, e_max)
    return select_zones_torch(scores, plan, r_max, e_max)


def resident_attention(query: Tensor, pools: LayerPools, plan: Tensor, top: Tensor,
                       width: int, r_max: int, e_max: int, scale: float, tilted: bool = True,
                       cache: ClusterCache | None = None, runs: Tensor | None = None,
                       backend: str = "auto") -> Tensor:
    """Dispatching :func:`kernels.resident_attention.resident_attention_torch` (tripartite
    decode read in place from a layer's pools, through its cluster cache when given)."""
    args = (query, pools, plan, top, width, r_max, e_max, scale, tilted, cache, runs)
    if resolve_backend(backend, query.device) == "triton":
        return resident_attention_triton(*args)
    return resident_attention_torch(*args)


def cache_lookup(cache: ClusterCache, sizes: Tensor, plan: Tensor, top: Tensor, r_max: int,
                 backend: str = "auto") -> Tensor:
    """Dispatching :func:`kernels.cluster_cache.cache_lookup_torch` (a step's retrieval
    clusters looked up in and admitted to a layer's cluster cache)."""
    args = (cache, sizes, plan, top, r_max)
    if resolve_backend(backend, top.device) == "triton":
        return cache_lookup_triton(*args)
    return cache_lookup_torch(*args)


def tripartite_decode(
    query: Tensor, k_exact: Tensor, v_exact: Tensor, n_exact: Tensor, centroids: Tensor,
    value_sums: Tensor, sizes: Tensor, est_ids: Tensor, n_est: Tensor, scale: float,
    tilt: TiltTerms | None = None, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Dispatching :func:`kernels.tripartite_attention.tripartite_decode_ref` (the torch
    backend runs its faster equivalent,
    :func:`kernels.tripartite_attention.tripartite_decode_torch`)."""
    args = (query, k_exact, v_exact, n_exact, centroids, value_sums, sizes, est_ids, n_est, scale,
            tilt)
    if resolve_backend(backend, query.device) == "triton":
        return tripartite_decode_triton(*args)
    return tripartite_decode_torch(*args)


def gather_runs(dst_k: Tensor, dst_v: Tensor, dev_k: Tensor, dev_v: Tensor, host_k: Tensor,
                host_v: Tensor, runs: Tensor, backend: str = "auto") -> None:
    """Dispatching :func:`kernels.gather.gather_runs_ref` (in place, on ``dst_k``'s device;
    ``runs`` [N, 3] int64, see :mod:`kernels.gather`)."""
    args = (dst_k, dst_v, dev_k, dev_v, host_k, host_v, runs)
    if resolve_backend(backend, dst_k.device) == "triton":
        gather_runs_triton(*args)
    else:
        gather_runs_ref(*args)
