"""Cluster scoring for retrieval: the GQA group's summed softmax over centroid logits.

For KV row ``r`` (one (request, KV head)) with query heads ``g = 0..G-1`` and centroids
``C[r, c]``::

    logit[g, c] = scale * q[r, g] . C[r, c]
    score[r, c] = log( sum_g softmax_c(logit[g, :])[c] )

Scores are returned in log space so that ranking never ties through underflow; ranking by
them equals ranking by the group's summed softmax probability (for G == 1, by the logit).
Clusters with size 0 (empty, or padding) get ``-inf``.
"""

from __future__ import annotations

import torch

from vllm_retro.kernels._common import block_size, check_float, tl, triton
from vllm_retro.kernels.step_plan import flat_meta, plan_rows


def group_scores_from_logits(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Log of the group's summed softmax. logits: [R, G, C]; valid: [R, C] bool.

    Returns [R, C] fp32: ``log(sum_g softmax_c(logits[r, g])[c])``, ``-inf`` where invalid.
    """
    logits = logits.float().masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=2, keepdim=True)
    logp = logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.logsumexp(logp, dim=1).masked_fill(~valid, float("-inf"))


def top_clusters(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best columns of each row of ``scores`` [R, C] (fp32), ranked by (score
    descending, column ascending): [R, k] int64, best first. The tie-break is the fused CPU
    kernel's (``retro_cpu.cpp``: its radix select admits tied clusters in id order), so every
    route and every reference chooses the same clusters when two scores are exactly equal
    (``torch.topk`` breaks ties as its implementation happens to). NaN ranks above +inf, as
    in ``torch.topk`` and the CPU kernel's order keys. Sync-free: one ``topk`` over int64 keys
    that order as (score, -column) and are all distinct."""
    if scores.dtype != torch.float32:
        raise ValueError(f"top_clusters: scores dtype {scores.dtype}; accepted: torch.float32")
    c = scores.shape[1]
    if not 0 <= k <= c:
        raise ValueError(f"top_clusters: k={k}; accepted: 0..{c} (the columns)")
    return torch.topk(ranking_keys(scores), k, dim=1, sorted=True).indices


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys [R, C] of fp32 ``scores`` [R, C] that order as (score, -column):
    the float's bits made order-preserving (negative floats' magnitude bits flipped) in the
    high half, the column reversed in the low half. Three int32 passes and two in-place int64
    ones (3.4x faster on CPU than the where/or form at 64 x 8192)."""
    bits = scores.contiguous().view(torch.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # sign-extended shift
    low = 0xFFFFFFFF - torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return keys.bitwise_left_shift_(32).add_(low)


def cluster_scores_ref(
    query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, scale: float
) -> torch.Tensor:
    """query: [R, G, D]; centroids: [R, C, D]; sizes: [R, C] (0 = masked); scale: float.

    Returns [R, C] fp32 log summed-softmax scores, ``-inf`` where ``sizes == 0``.
    """
    logits = torch.bmm(query.float(), centroids.float().transpose(1, 2)) * scale  # [R, G, C]
    return group_scores_from_logits(logits, sizes > 0)


def page_bound_scores_ref(query: torch.Tensor, bounds: torch.Tensor, sizes: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Quest's page scores. query: [R, G, D]; bounds: [R, P, 2D] each page's per-dimension
    key max, then min; sizes: [R, P] (0 = masked). A query head's logit is the upper bound
    ``scale * sum_d max(q_d max_d, q_d min_d)``: ``q_d max_d`` where ``q_d >= 0``, else
    ``q_d min_d``, so one product of ``[q+, q-]`` with ``[max, min]`` (fp32, no
    [R, G, P, D] temporary). Returns [R, P] fp32 log summed-softmax scores, as
    :func:`cluster_scores_ref`."""
    split = torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=2)
    return cluster_scores_ref(split, bounds, sizes, scale)


@triton.jit
def _block_logits(q, CEN, SZ, r, c0, C, sc_r, sc_c, ssz_r, offs_d, dmask,
                  BLOCK_C: tl.constexpr):
    """Scaled logits [G, BLOCK_C] of centroids c0.. of row r (-inf where invalid)."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    sz = tl.load(SZ + r * ssz_r + offs_c, mask=cmask, other=0)
    valid = cmask & (sz > 0)
    cen = tl.load(
        CEN + r * sc_r + offs_c[:, None] * sc_c + offs_d[None, :],
        mask=valid[:, None] & dmask[None, :], other=0.0,
    ).to(tl.float32)
    logit = tl.dot(q, tl.trans(cen), input_precision="ieee")
    return tl.where(valid[None, :], logit, float("-inf")), valid, offs_c, cmask


@triton.jit
def _cluster_scores_kernel(
    Q, CEN, SZ, OUT,
    G, C, D, scale,
    sq_r, sq_g, sc_r, sc_c, ssz_r, so_r,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(
        Q + r * sq_r + offs_g[:, None] * sq_g + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    ).to(tl.float32) * scale
    # pass 1: per-head log-sum-exp over all valid centroids (online)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_G], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        logit, valid, offs_c, cmask = _block_logits(q, CEN, SZ, r, c0, C, sc_r, sc_c, ssz_r,
                                                    offs_d, dmask, BLOCK_C)
        m_new = tl.maximum(m, tl.max(logit, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        ssum = ssum * tl.exp(m - m_safe) + tl.sum(tl.exp(logit - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(ssum > 0, m + tl.log(tl.maximum(ssum, 1e-30)), float("inf"))
    lse = tl.where(gmask, lse, float("inf"))  # padding heads contribute exp(-inf) = 0
    # pass 2: log of the group's summed probabilities
    for c0 in range(0, C, BLOCK_C):
        logit, valid, offs_c, cmask = _block_logits(q, CEN, SZ, r, c0, C, sc_r, sc_c, ssz_r,
                                                    offs_d, dmask, BLOCK_C)
        logp = logit - lse[:, None]
        mx = tl.max(logp, axis=0)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        # >= 1 for a valid column (its max term is exp(0)); the clamp only spares log(0)
        score = mx_safe + tl.log(tl.maximum(tl.sum(tl.exp(logp - mx_safe[None, :]), axis=0), 1e-30))
        score = tl.where(valid, score, float("-inf"))
        tl.store(OUT + r * so_r + offs_c, score, mask=cmask)


def cluster_scores_triton(
    query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton version of :func:`cluster_scores_ref` (same arguments and result)."""
    check_float("query", query)
    check_float("centroids", centroids)
    query = query.contiguous()
    centroids = centroids.contiguous()
    sizes = sizes.contiguous()
    r, g, d = query.shape
    c = centroids.shape[1]
    out = torch.empty(r, c, dtype=torch.float32, device=query.device)
    if r == 0 or c == 0:
        return out
    block_d = block_size(d)
    _cluster_scores_kernel[(r,)](
        query, centroids, sizes, out,
        g, c, d, float(scale),
        query.stride(0), query.stride(1), centroids.stride(0), centroids.stride(1),
        sizes.stride(0), out.stride(0),
        BLOCK_G=block_size(g), BLOCK_C=64 if block_d <= 128 else 32, BLOCK_D=block_d,
    )
    return out


def pool_scores_ref(query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor,
                    plan: torch.Tensor, width: int, scale: float) -> torch.Tensor:
    """Cluster scores of a step's rows read from a layer's meta pool, for ranking.

    query: [R, G, D] (R = B x H: request ``r // H``'s KV head ``r % H``); centroids:
    [..., Dc] and sizes: [...] int32, the meta rows seen flat (row ``meta_row + head *
    meta_stride + c`` is the row's cluster c: :data:`~kernels.step_plan.PLAN_FIELDS`);
    plan: the step's [len(PLAN_FIELDS), B] int64; ``width`` >= every row's clusters
    columns scored (nothing past a row's clusters is read). Returns [R, width] fp32:
    :func:`cluster_scores_ref` of the row's first ``width`` centroids, ``-inf`` past its
    clusters, except that a row's empty clusters (size 0, index < its clusters) score the
    lowest finite fp32 instead of ``-inf`` — they rank above the padding past the row's
    clusters, so a top-k of at most its clusters never reaches the padding."""
    rows = plan_rows(plan, query.shape[0] // plan.shape[1])
    r, dc = query.shape[0], centroids.shape[-1]
    if sizes.numel() == 0:  # no meta rows at all: every column is padding
        return torch.full((r, width), float("-inf"), device=query.device)
    col = torch.arange(width, device=query.device)
    inside = col[None, :] < rows.clusters[:, None]
    flat = torch.where(inside, rows.meta_row[:, None] + col, 0)
    sz = torch.take(sizes, flat) * inside
    cen = centroids.reshape(-1, dc).index_select(0, flat.view(-1)).view(r, width, dc)
    scores = cluster_scores_ref(query, cen, sz, scale)
    return scores.masked_fill((sz == 0) & inside, torch.finfo(torch.float32).min)


@triton.jit
def _pool_logits_kernel(
    Q, CEN, SZ, PLAN, LOGITS, PART,
    B, G, W, D, H, scale,
    sq_r, sq_g, sc_c, sl_r, sl_g, sp_r, sp_b,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    # one program per (row, block of BLOCK_C clusters): its logits [G, BLOCK_C] stored, and
    # per query head the block's max and sum of exp (the softmax's partial terms)
    r = tl.program_id(0)
    blk = tl.program_id(1)
    b = r // H
    # the row's cluster 0 in the flat meta rows (PLAN_FIELDS: meta_row, meta_stride)
    mrow = tl.load(PLAN + 9 * B + b) + (r % H) * tl.load(PLAN + 10 * B + b)
    ncl = tl.load(PLAN + 2 * B + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    gmask = offs_g < G
    dmask = offs_d < D
    cmask = offs_c < W
    q = tl.load(Q + r * sq_r + offs_g[:, None] * sq_g + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    sz = tl.load(SZ + mrow + offs_c, mask=cmask & (offs_c < ncl), other=0)
    valid = cmask & (sz > 0)
    cen = tl.load(CEN + (mrow + offs_c)[:, None] * sc_c + offs_d[None, :],
                  mask=valid[:, None] & dmask[None, :], other=0.0)
    if IEEE:
        logit = tl.dot(q.to(tl.float32), tl.trans(cen.to(tl.float32)), input_precision="ieee")
    else:  # 16-bit operands are exact in tf32: tensor-core products, fp32 sums
        logit = tl.dot(q.to(tl.float32), tl.trans(cen.to(tl.float32)), input_precision="tf32")
    logit = tl.where(valid[None, :], logit * scale, float("-inf"))
    tl.store(LOGITS + r * sl_r + offs_g[:, None] * sl_g + offs_c[None, :], logit,
             mask=gmask[:, None] & cmask[None, :])
    m = tl.max(logit, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(logit - m_safe[:, None]), axis=1)
    tl.store(PART + r * sp_r + blk * sp_b + offs_g, m, mask=gmask)
    tl.store(PART + r * sp_r + blk * sp_b + G + offs_g, s, mask=gmask)


@triton.jit
def _pool_scores_kernel(
    LOGITS, PART, SZ, PLAN, OUT,
    B, G, W, H, NB,
    sl_r, sl_g, sp_r, sp_b, so_r,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # one program per (row, block): each head's log-sum-exp from every block's partial
    # terms, then the block's group scores log(sum_g exp(logit_g - lse_g))
    r = tl.program_id(0)
    blk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    offs_b = tl.arange(0, BLOCK_B)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_G], tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        bmask = (b0 + offs_b) < NB
        pm = tl.load(PART + r * sp_r + (b0 + offs_b)[:, None] * sp_b + offs_g[None, :],
                     mask=bmask[:, None] & gmask[None, :], other=float("-inf"))
        ps = tl.load(PART + r * sp_r + (b0 + offs_b)[:, None] * sp_b + G + offs_g[None, :],
                     mask=bmask[:, None] & gmask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        ssum = ssum * tl.exp(m - m_safe) + tl.sum(ps * tl.exp(pm - m_safe[None, :]), axis=0)
        m = m_new
    lse = tl.where(ssum > 0, m + tl.log(tl.maximum(ssum, 1e-30)), float("inf"))
    lse = tl.where(gmask, lse, float("inf"))  # padding heads contribute exp(-inf) = 0
    offs_c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = offs_c < W
    logit = tl.load(LOGITS + r * sl_r + offs_g[:, None] * sl_g + offs_c[None, :],
                    mask=gmask[:, None] & cmask[None, :], other=float("-inf"))
    logp = logit - lse[:, None]
    mx = tl.max(logp, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    score = mx_safe + tl.log(tl.maximum(tl.sum(tl.exp(logp - mx_safe[None, :]), axis=0), 1e-30))
    b = r // H
    mrow = tl.load(PLAN + 9 * B + b) + (r % H) * tl.load(PLAN + 10 * B + b)
    ncl = tl.load(PLAN + 2 * B + b)  # the request's clusters
    sz = tl.load(SZ + mrow + offs_c, mask=cmask & (offs_c < ncl), other=0)
    score = tl.where(sz > 0, score, tl.where(offs_c < ncl, -3.4028234663852886e38,
                                             float("-inf")))
    tl.store(OUT + r * so_r + offs_c, score, mask=cmask)


def pool_scores_triton(query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor,
                       plan: torch.Tensor, width: int, scale: float) -> torch.Tensor:
    """Triton version of :func:`pool_scores_ref` (same arguments and result; 16-bit
    centroids multiply on tensor cores as tf32, which holds them exactly, with fp32 sums;
    fp32 ones in IEEE fp32): two
    launches, each over (rows x blocks of clusters), so a batch of one still spreads over
    the whole GPU; the centroids are read once, in place (no copy of the batch's rows)."""
    check_float("query", query)
    check_float("centroids", centroids)
    r, g, d = query.shape
    if sizes.numel() == 0 or r == 0 or width == 0:
        return torch.full((r, width), float("-inf"), device=query.device)
    centroids, sizes = flat_meta(centroids), flat_meta(sizes, 0)
    block_d = block_size(d)
    block_c = 128 if block_d <= 128 else 64
    nb = triton.cdiv(width, block_c)
    ieee = centroids.dtype == torch.float32
    q = query.contiguous() if ieee else query.to(centroids.dtype).contiguous()
    logits = torch.empty(r, g, width, dtype=torch.float32, device=query.device)
    part = torch.empty(r, nb, 2 * g, dtype=torch.float32, device=query.device)
    b = plan.shape[1]
    out = torch.empty(r, width, dtype=torch.float32, device=query.device)
    _pool_logits_kernel[(r, nb)](
        q, centroids, sizes, plan, logits, part,
        b, g, width, d, r // b, float(scale),
        q.stride(0), q.stride(1), centroids.stride(0),
        logits.stride(0), logits.stride(1), part.stride(0), part.stride(1),
        BLOCK_G=block_size(g), BLOCK_C=block_c, BLOCK_D=block_d, IEEE=ieee,
    )
    _pool_scores_kernel[(r, nb)](
        logits, part, sizes, plan, out,
        b, g, width, r // b, nb,
        logits.stride(0), logits.stride(1), part.stride(0), part.stride(1), out.stride(0),
        BLOCK_G=block_size(g), BLOCK_C=block_c, BLOCK_B=min(64, block_size(nb)),
    )
    return out
