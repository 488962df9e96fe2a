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


def group_scores_from_logits(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Log of the group's summed softmax. logits: [R, G, C]; valid: [R, C] bool.

    Returns [R, C] fp32: ``log(sum_g softmax_c(logits[r, g])[c])``, ``-inf`` where invalid.
    """
    logits = logits.float().masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=2, keepdim=True)
    logp = logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.logsumexp(logp, dim=1).masked_fill(~valid, float("-inf"))


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
