"""Weighted decode attention: exact tokens plus size-weighted centroids, merged exactly.

The wave index's modified FlashAttention (RetroInfer §4.6). For KV row ``r`` (one
(request, KV head)) and each of its ``G`` query heads ``q``::

    exact token j  (j < n_exact[r]):   w_j = exp(scale * q.k_j),            contributes w_j * v_j
    estimated cluster i (est_ids[r]):  w_i = size_i * exp(scale * q.C_i),   contributes
                                       exp(scale * q.C_i) * VS_i  (= w_i * VS_i / size_i)
    out = sum(contributions) / sum(w),   lse = log(sum(w))

i.e. softmax attention with a log-weight bias ``log(size_i)`` on each centroid and the mean
value ``VS_i / size_i`` as its value (paper eq. 2-4). Everything accumulates in fp32 through
an online (log-sum-exp) softmax, so the zones merge exactly. Empty clusters (size 0) and
padding contribute nothing; a row with nothing to attend returns zeros and ``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import block_size, check_float, take_rows


def _estimation_terms(
    centroids: torch.Tensor,
    value_sums: torch.Tensor,
    sizes: torch.Tensor,
    est_ids: torch.Tensor,
    n_est: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the estimated clusters as pseudo-tokens: keys, mean values, log-weight bias."""
    e = est_ids.shape[1]
    valid = torch.arange(e, device=est_ids.device)[None, :] < n_est[:, None].to(est_ids.device)
    ids = torch.where(valid, est_ids, torch.zeros_like(est_ids)).long()
    # select first, convert after: only the estimated rows are read
    kc = take_rows(centroids, ids).float()
    vs = take_rows(value_sums, ids).float()
    sz = torch.gather(sizes, 1, ids).float()
    valid = valid & (sz > 0)
    vmean = vs / sz.clamp_min(1.0)[..., None]
    bias = torch.where(valid, torch.log(sz.clamp_min(1.0)), torch.full_like(sz, float("-inf")))
    return kc, vmean, bias


def tripartite_decode_ref(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    n_exact: torch.Tensor,
    centroids: torch.Tensor,
    value_sums: torch.Tensor,
    sizes: torch.Tensor,
    est_ids: torch.Tensor,
    n_est: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch weighted decode attention.

    query: [R, G, D]; k_exact, v_exact: [R, T, D] exact tokens (steady + retrieval zones),
    valid up to n_exact[r] ([R] ints); centroids, value_sums: [R, C, D]; sizes: [R, C];
    est_ids: [R, E] cluster ids of the estimation zone, valid up to n_est[r] ([R] ints).
    Returns (out [R, G, D] in query's dtype, lse [R, G] fp32 natural-log softmax denominator).
    """
    t = k_exact.shape[1]
    xmask = torch.arange(t, device=query.device)[None, :] < n_exact[:, None].to(query.device)
    kc, vmean, bias_e = _estimation_terms(centroids, value_sums, sizes, est_ids, n_est)
    bias_x = torch.zeros(xmask.shape, dtype=torch.float32, device=query.device)
    bias_x = bias_x.masked_fill(~xmask, float("-inf"))
    keys = torch.cat([k_exact.float(), kc], dim=1)
    vals = torch.cat([v_exact.float(), vmean], dim=1)
    bias = torch.cat([bias_x, bias_e], dim=1)  # [R, T + E]
    logits = torch.bmm(query.float(), keys.transpose(1, 2)) * scale + bias[:, None, :]
    lse = torch.logsumexp(logits, dim=2)  # [R, G]
    finite = torch.isfinite(lse)
    p = torch.exp(logits - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.bmm(p, vals)
    out = torch.where(finite[..., None], out, torch.zeros_like(out))
    return out.to(query.dtype), lse


@triton.jit
def _tripartite_split_kernel(
    Q, KX, VX, NX, CEN, VS, SZ, EID, NE,
    ACC, MX, LS,
    G, D, C, E, chunk, scale,
    sq_r, sq_g, skx_r, skx_t, svx_r, svx_t,
    sc_r, sc_c, svs_r, svs_c, ssz_r, se_r,
    sacc_r, sacc_s, sacc_g, sm_r, sm_s,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    sp = tl.program_id(1)
    nx = tl.load(NX + r)
    ne = tl.load(NE + r)
    total = nx + ne
    start = sp * chunk
    end = tl.minimum(start + chunk, total)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(
        Q + r * sq_r + offs_g[:, None] * sq_g + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    ).to(tl.float32) * scale
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for off in range(start, end, BLOCK_N):
        pos = off + tl.arange(0, BLOCK_N)
        valid = pos < end
        is_x = valid & (pos < nx)
        is_e = valid & (pos >= nx)
        mx2 = is_x[:, None] & dmask[None, :]
        kx = tl.load(KX + r * skx_r + pos[:, None] * skx_t + offs_d[None, :], mask=mx2, other=0.0)
        vx = tl.load(VX + r * svx_r + pos[:, None] * svx_t + offs_d[None, :], mask=mx2, other=0.0)
        cid = tl.load(EID + r * se_r + (pos - nx), mask=is_e, other=0)
        sz = tl.load(SZ + r * ssz_r + cid, mask=is_e, other=0).to(tl.float32)
        is_e = is_e & (sz > 0)
        me2 = is_e[:, None] & dmask[None, :]
        kc = tl.load(CEN + r * sc_r + cid[:, None] * sc_c + offs_d[None, :], mask=me2, other=0.0)
        vs = tl.load(VS + r * svs_r + cid[:, None] * svs_c + offs_d[None, :], mask=me2, other=0.0)
        k = tl.where(is_x[:, None], kx.to(tl.float32), kc.to(tl.float32))
        vmean = vs.to(tl.float32) / tl.maximum(sz, 1.0)[:, None]
        v = tl.where(is_x[:, None], vx.to(tl.float32), vmean)
        bias = tl.where(is_x, 0.0, tl.log(tl.maximum(sz, 1.0)))
        bias = tl.where(is_x | is_e, bias, float("-inf"))
        s = tl.dot(q, tl.trans(k), input_precision="ieee") + bias[None, :]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        ssum = ssum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    base = r * sacc_r + sp * sacc_s
    tl.store(
        ACC + base + offs_g[:, None] * sacc_g + offs_d[None, :], acc,
        mask=gmask[:, None] & dmask[None, :],
    )
    tl.store(MX + r * sm_r + sp * sm_s + offs_g, m, mask=gmask)
    tl.store(LS + r * sm_r + sp * sm_s + offs_g, ssum, mask=gmask)


def merge_partials(
    acc: torch.Tensor, m: torch.Tensor, lsum_parts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split partial softmax states exactly.

    acc: [R, S, G, D] unnormalised outputs; m: [R, S, G] running maxima; lsum_parts:
    [R, S, G] softmax sums (relative to m). Returns (out [R, G, D] fp32, lse [R, G] fp32).
    """
    mmax = m.amax(dim=1, keepdim=True)  # [R, 1, G]
    mmax_safe = torch.where(torch.isfinite(mmax), mmax, torch.zeros_like(mmax))
    w = torch.exp(m - mmax_safe)  # exp(-inf) = 0 for empty splits
    lsum = (lsum_parts * w).sum(dim=1)  # [R, G]
    tiny = torch.finfo(torch.float32).tiny
    out = (acc * w[..., None]).sum(dim=1) / lsum.clamp_min(tiny)[..., None]
    out = torch.where((lsum > 0)[..., None], out, torch.zeros_like(out))
    lse = torch.where(lsum > 0, mmax_safe[:, 0] + torch.log(lsum.clamp_min(tiny)),
                      torch.full_like(lsum, -torch.inf))
    return out, lse


def _default_splits(rows: int, total: int, block_n: int) -> int:
    # enough programs to fill a large GPU (~132 SMs x 2) without splitting below one block
    want = max(1, triton.cdiv(264, max(rows, 1)))
    return max(1, min(want, triton.cdiv(max(total, 1), block_n)))


def tripartite_decode_triton(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    n_exact: torch.Tensor,
    centroids: torch.Tensor,
    value_sums: torch.Tensor,
    sizes: torch.Tensor,
    est_ids: torch.Tensor,
    n_est: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`tripartite_decode_ref` (same arguments and result), split
    along the sequence (flash-decoding) into ``num_splits`` partials merged exactly."""
    for name, t in (("query", query), ("k_exact", k_exact), ("v_exact", v_exact),
                    ("centroids", centroids), ("value_sums", value_sums)):
        check_float(name, t)
    dev = query.device
    r, g, d = query.shape
    n_exact = n_exact.to(dev, torch.int32).contiguous()
    n_est = n_est.to(dev, torch.int32).contiguous()
    est_ids = est_ids.to(dev, torch.int32).contiguous()
    sizes = sizes.to(dev, torch.int32).contiguous()
    query = query.contiguous()
    k_exact, v_exact = k_exact.contiguous(), v_exact.contiguous()
    centroids, value_sums = centroids.contiguous(), value_sums.contiguous()
    # zero-sized operands have no storage to point at: give the kernel a masked-off dummy
    if k_exact.shape[1] == 0:
        k_exact = v_exact = query.new_zeros(r, 1, d)
    if centroids.shape[1] == 0 or est_ids.shape[1] == 0:
        centroids = value_sums = query.new_zeros(r, 1, d)
        sizes = torch.zeros(r, 1, dtype=torch.int32, device=dev)
        est_ids = torch.zeros(r, 1, dtype=torch.int32, device=dev)
        n_est = torch.zeros_like(n_est)
    block_d = block_size(d)
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    total = int((n_exact + n_est).max().item()) if r else 0
    splits = num_splits or _default_splits(r, total, block_n)
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(total, 1), splits), block_n) * block_n)
    splits = max(1, triton.cdiv(max(total, 1), chunk))
    acc = torch.empty(r, splits, g, d, dtype=torch.float32, device=dev)
    mx = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    ls = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    if r == 0:
        return torch.empty_like(query), torch.empty(0, g, dtype=torch.float32, device=dev)
    _tripartite_split_kernel[(r, splits)](
        query, k_exact, v_exact, n_exact, centroids, value_sums, sizes, est_ids, n_est,
        acc, mx, ls,
        g, d, centroids.shape[1], est_ids.shape[1], chunk, float(scale),
        query.stride(0), query.stride(1), k_exact.stride(0), k_exact.stride(1),
        v_exact.stride(0), v_exact.stride(1), centroids.stride(0), centroids.stride(1),
        value_sums.stride(0), value_sums.stride(1), sizes.stride(0), est_ids.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), mx.stride(0), mx.stride(1),
        BLOCK_G=block_size(g), BLOCK_N=block_n, BLOCK_D=block_d,
    )
    out, lse = merge_partials(acc, mx, ls)
    return out.to(query.dtype), lse
