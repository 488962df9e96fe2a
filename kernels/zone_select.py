"""The device step's zones from its cluster scores: one launch, no sort, ties by cluster id.

Row ``r`` of a step (request ``r // H``'s KV head ``r % H``) has scores over the first
``clusters`` columns of ``scores[r]`` and zone sizes ``n_ret``, ``n_est`` from the step plan
(:mod:`kernels.step_plan`). Its zones are the top ``n_ret`` clusters by (score descending,
cluster id ascending), then the next ``n_est``: the fused CPU kernel's rule
(``retro_cpu.cpp``) and :func:`~vllm_retro.kernels.scoring.top_clusters`'s, so every route
chooses the same clusters, exact ties included. The result ``zones`` [R, K] int64 holds the
retrieval zone in ``zones[r, :n_ret]`` and the estimation zone in
``zones[r, n_ret:n_ret + n_est]``, each in ascending cluster id (memory order); slots past
``n_ret + n_est`` hold 0.

The Triton kernel (one program per row) finds the two thresholds — the ``n_ret``-th and the
``(n_ret + n_est)``-th largest score — by a radix select over order-preserving integer keys
(4 passes of 8-bit digits, each a masked 256-bin histogram of the survivors), then writes
each zone in one pass of exclusive prefix sums: clusters above a threshold, and in id order
as many tied at it as the zone has room for. It replaces ``torch.topk`` over the scores,
which took 36-68 us on an H200 at 32K-128K x batch 1 (``k`` = 512-2048 of 2K-8K clusters,
two to six launches; ``bench/results/gpu_check_h200_2026-11-28``).
"""

from __future__ import annotations

import torch

from vllm_retro.kernels._common import block_size, tl, triton
from vllm_retro.kernels.scoring import ranking_keys
from vllm_retro.kernels.step_plan import plan_rows


def _check(scores: torch.Tensor, plan: torch.Tensor, r_max: int, e_max: int) -> int:
    """The zones' width ``K = min(r_max + e_max, W)``, after checking the arguments."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"select_zones: scores {tuple(scores.shape)} {scores.dtype}; "
                         "accepted: [R, W] torch.float32")
    if plan.dtype != torch.int64 or plan.dim() != 2:
        raise ValueError(f"select_zones: plan {tuple(plan.shape)} {plan.dtype}; accepted: "
                         "[len(PLAN_FIELDS), B] torch.int64")
    if r_max < 0 or e_max < 0:
        raise ValueError(f"select_zones: r_max={r_max}, e_max={e_max}; accepted: >= 0")
    if plan.shape[1] == 0 or scores.shape[0] % plan.shape[1]:
        raise ValueError(f"select_zones: {scores.shape[0]} score rows for a plan of "
                         f"{plan.shape[1]} requests; accepted: a multiple (B x KV heads)")
    return min(r_max + e_max, scores.shape[1])


def select_zones_torch(scores: torch.Tensor, plan: torch.Tensor, r_max: int, e_max: int
                       ) -> torch.Tensor:
    """The zones of every row (see the module docstring) in torch ops, sync-free: one
    ``topk`` over distinct int64 keys ordered as (score, -cluster id), columns past a row's
    clusters below every score; then one sort that lists each zone in id order. scores
    [R, W] fp32; plan [len(PLAN_FIELDS), B] int64; each row's ``n_ret <= r_max``,
    ``n_est <= e_max`` and ``n_ret + n_est <= clusters <= W``. Returns [R, K] int64."""
    k = _check(scores, plan, r_max, e_max)
    r, w = scores.shape
    rows = plan_rows(plan, r // plan.shape[1])
    col = torch.arange(w, device=scores.device, dtype=torch.int64)
    keys = ranking_keys(scores).masked_fill(col[None, :] >= rows.clusters[:, None],
                                            torch.iinfo(torch.int64).min)
    ranked = torch.topk(keys, k, dim=1, sorted=True).indices  # best first
    slot = torch.arange(k, device=scores.device, dtype=torch.int64)[None, :]
    zone = (slot >= rows.n_ret[:, None]).long() + (slot >= (rows.n_ret + rows.n_est)[:, None])
    listed = torch.sort(zone * w + ranked, dim=1).values  # zone by zone, ids ascending
    return torch.where(zone < 2, listed % w, 0)


@triton.jit
def _kth_key(keys, surv, k, BINS: tl.constexpr):
    # the k-th largest (k >= 1) of keys (int64 in [0, 2^32)) where surv: 4 passes over
    # 8-bit digits, most significant first, each narrowing the survivors to the digit that
    # holds the k-th; k = 0 gives 2^32 - 1, which nothing above can tie with room to admit
    bins = tl.arange(0, BINS)
    prefix = tl.zeros([1], tl.int64)
    kk = k
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        digit = ((keys >> shift) & 255).to(tl.int32)
        hist = tl.histogram(digit, BINS, mask=surv)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        b = tl.max(tl.where(at_or_above >= kk, bins, -1), axis=0)
        kk = kk - tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix = prefix | (b.to(tl.int64) << shift)
        surv = surv & (digit == b)
    return tl.sum(prefix, axis=0)


@triton.jit
def _zone(keys, valid, thr, k):
    # which columns a zone of k takes: above thr, and in id order as many tied at thr as
    # there is room for
    above = valid & (keys > thr)
    tie = valid & (keys == thr)
    room = k - tl.sum(above.to(tl.int32), axis=0)
    tie_i = tie.to(tl.int32)
    return above | (tie & ((tl.cumsum(tie_i, axis=0) - tie_i) < room))


@triton.jit
def _select_zones_kernel(
    S, PLAN, OUT, B, W, H, K, ss_r, so_r,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0)
    b = r // H
    clusters = tl.load(PLAN + 2 * B + b)  # the plan's rows: see PLAN_FIELDS
    n_ret = tl.load(PLAN + 3 * B + b)
    n_est = tl.load(PLAN + 4 * B + b)
    offs = tl.arange(0, BLOCK_W)
    valid = (offs < W) & (offs < clusters)
    s = tl.load(S + r * ss_r + offs, mask=valid, other=0.0)
    bits = s.to(tl.int32, bitcast=True)
    # order-preserving: negative floats' magnitude bits flipped, then shifted to [0, 2^32)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
    n_all = n_ret + n_est
    in_all = _zone(keys, valid, _kth_key(keys, valid, n_all, 256), n_all)
    is_r = _zone(keys, valid, _kth_key(keys, valid, n_ret, 256), n_ret)
    is_e = in_all & ~is_r
    r_i = is_r.to(tl.int32)
    e_i = is_e.to(tl.int32)
    pos_r = tl.cumsum(r_i, axis=0) - r_i
    pos_e = n_ret + tl.cumsum(e_i, axis=0) - e_i
    tl.store(OUT + r * so_r + pos_r, offs.to(tl.int64), mask=is_r)
    tl.store(OUT + r * so_r + pos_e, offs.to(tl.int64), mask=is_e)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(OUT + r * so_r + offs_k, tl.zeros([BLOCK_K], tl.int64),
             mask=(offs_k >= n_all) & (offs_k < K))


def select_zones_triton(scores: torch.Tensor, plan: torch.Tensor, r_max: int, e_max: int
                        ) -> torch.Tensor:
    """Triton version of :func:`select_zones_torch` (same arguments and result): one
    launch, a program per row holding the row's scores in registers."""
    k = _check(scores, plan, r_max, e_max)
    r, w = scores.shape
    out = torch.empty(r, k, dtype=torch.int64, device=scores.device)
    if r == 0 or k == 0:
        return out
    block_w = max(256, block_size(w))  # at least the histogram's bins
    scores = scores.contiguous()
    _select_zones_kernel[(r,)](
        scores, plan, out, plan.shape[1], w, r // plan.shape[1], k,
        scores.stride(0), out.stride(0),
        BLOCK_W=block_w, BLOCK_K=block_size(k),
        num_warps=8 if block_w >= 4096 else 4,
    )
    return out
