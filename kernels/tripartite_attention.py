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

With :class:`TiltTerms` the estimated clusters are corrected for the spread of their keys
(the *tilted* estimator). For query head ``g`` and cluster ``i`` with spread ``sp_i`` and
finite-sample deviate ``a_i``::

    w_i   = size_i * exp(scale * q.C_i) * exp(log_tilt(qvar_g * sp_i, a_i))
    value = VS_i / size_i + sp_i * vshift_g

where ``log_tilt(v, a) = log E[exp(sqrt(v) Y)]`` for ``Y`` a normal truncated to ``[-a, a]``
standard deviations and rescaled to unit variance: the expected ``exp(scale * q.(k - C_i))``
over the cluster's keys when ``scale * q.(k - C_i)`` has variance ``v`` across them, and no key
lies beyond the extremes of a sample of ``size_i`` (see :mod:`vllm_retro.index.estimator`). It
is >= 0, so the corrected weight never falls below the paper's Jensen bound; it is ``v / 2``
(the log-normal correction) for small ``v`` but grows like ``sqrt(v)``, not ``v / 2``, so it
cannot overshoot the way the plain log-normal correction does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_retro.kernels._common import block_size, check_float, take_rows, tl, triton

_SQRT1_2 = 0.7071067811865476


@dataclass(frozen=True)
class TiltTerms:
    """Inputs of the tilted estimator (see the module docstring); all fp32."""

    spreads: torch.Tensor
    """[R, C] each cluster's mean squared distance of its keys from the centroid."""
    deviates: torch.Tensor
    """[R, C] expected largest standard-normal deviate among ``size`` samples: 0 (no
    correction, size <= 1) or >= 0.5 (fp32 keeps the truncated variance accurate there)."""
    qvar: torch.Tensor
    """[R, G] variance of ``scale * q.(k - C)`` per unit of spread, per query head."""
    vshift: torch.Tensor
    """[R, G, D] shift of an estimated cluster's value per unit of spread, per query head."""


def residual_query_terms(query: torch.Tensor, profile: torch.Tensor, key_factor: torch.Tensor,
                         value_factor: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tilted estimator's per-query terms for rows of queries (see
    :meth:`vllm_retro.index.estimator.ResidualModel.query_terms`): query [R, G, D];
    profile [R, D]; key_factor,
    value_factor [R, D, rank] (fp32), one row per (request, KV head). Returns ``qvar`` [R, G]
    and ``vshift`` [R, G, D], fp32."""
    q = query.float()
    qvar = (q * q) @ profile[..., None] * (scale * scale)
    vshift = (q @ key_factor) @ value_factor.transpose(1, 2) * scale
    return qvar[..., 0], vshift


def truncated_variance_ref(a: torch.Tensor) -> torch.Tensor:
    """Variance of ``N(0, 1)`` truncated to ``[-a, a]``: ``1 - 2 a phi(a) / erf(a / sqrt 2)``
    (fp64; ``a > 0``)."""
    a = a.double()
    return 1 - 2 * a * torch.exp(-a * a / 2) / (2 * torch.pi) ** 0.5 / torch.erf(a * _SQRT1_2)


def log_tilt_ref(v: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``log E[exp(sqrt(v) * Y)]`` for ``Y`` a standard normal truncated to ``[-a, a]`` and
    rescaled to unit variance (any shapes that broadcast; computed in fp64, returned as fp32).
    With ``u = v / truncated_variance_ref(a)``: ``u / 2 + log(Phi(a - sqrt u) -
    Phi(-a - sqrt u)) - log(Phi(a) - Phi(-a))``; 0 where ``a <= 0`` or ``v <= 0``."""
    a64 = a.double()
    a_safe = a64.clamp_min(1e-3)
    v64 = v.double().clamp_min(0) / truncated_variance_ref(a_safe)
    sv = v64.sqrt()
    l1 = torch.special.log_ndtr(a_safe - sv)
    l2 = torch.special.log_ndtr(-a_safe - sv)
    num = l1 + torch.log1p(-torch.exp(l2 - l1))
    den = torch.log(torch.erf(a_safe * _SQRT1_2))
    out = (v64 / 2 + num - den).clamp_min(0)
    return torch.where((a64 > 0) & (v64 > 0), out, torch.zeros_like(out)).float()


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


def _tilt_of_estimated(tilt: TiltTerms, est_ids: torch.Tensor, num_clusters: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimated clusters' spreads [R, E] and log mass corrections [R, G, E] (fp32)."""
    ids = est_ids.long().clamp(0, max(num_clusters - 1, 0))
    spread = torch.gather(tilt.spreads.float(), 1, ids)
    deviate = torch.gather(tilt.deviates.float(), 1, ids)
    return spread, log_tilt_ref(tilt.qvar.float()[..., None] * spread[:, None, :],
                                deviate[:, None, :])


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
    tilt: TiltTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch weighted decode attention.

    query: [R, G, D]; k_exact, v_exact: [R, T, D] exact tokens (steady + retrieval zones),
    valid up to n_exact[r] ([R] ints); centroids, value_sums: [R, C, D]; sizes: [R, C];
    est_ids: [R, E] cluster ids of the estimation zone, valid up to n_est[r] ([R] ints);
    ``tilt``: the tilted estimator's terms (None: the paper's estimator).
    Returns (out [R, G, D] in query's dtype, lse [R, G] fp32 natural-log softmax denominator).
    """
    t = k_exact.shape[1]
    xmask = torch.arange(t, device=query.device)[None, :] < n_exact[:, None].to(query.device)
    kc, vmean, bias_e = _estimation_terms(centroids, value_sums, sizes, est_ids, n_est)
    bias_x = torch.zeros(xmask.shape, dtype=torch.float32, device=query.device)
    bias_x = bias_x.masked_fill(~xmask, float("-inf"))
    bias = torch.cat([bias_x, bias_e], dim=1)  # [R, T + E]
    # what a row does not read is zero here, so that nothing it holds (a stale execution
    # buffer's NaN) reaches the result: 0 * NaN is NaN
    unread = (bias == float("-inf"))[..., None]
    keys = torch.cat([k_exact.float(), kc], dim=1).masked_fill_(unread, 0.0)
    vals = torch.cat([v_exact.float(), vmean], dim=1).masked_fill_(unread, 0.0)
    logits = torch.bmm(query.float(), keys.transpose(1, 2)) * scale + bias[:, None, :]
    spread = None
    if tilt is not None:
        spread, lt = _tilt_of_estimated(tilt, est_ids, centroids.shape[1])
        logits[..., t:] = logits[..., t:] + lt  # -inf (padding, empty) stays -inf
    lse = torch.logsumexp(logits, dim=2)  # [R, G]
    finite = torch.isfinite(lse)
    p = torch.exp(logits - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.bmm(p, vals)
    if spread is not None:
        # sum_i p_i * sp_i * vshift: the value correction, weighted by the corrected mass
        out = out + (p[..., t:] * spread[:, None, :]).sum(2, keepdim=True) * tilt.vshift.float()
    out = torch.where(finite[..., None], out, torch.zeros_like(out))
    return out.to(query.dtype), lse


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """``x.amax(2)`` ([R, G, N] -> [R, G]), ``-inf`` when N == 0."""
    if x.shape[2] == 0:
        return x.new_full(x.shape[:2], float("-inf"))
    return x.amax(2)


def tripartite_decode_torch(
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
    tilt: TiltTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tripartite_decode_ref`'s function (same arguments and result, fp32 1e-5),
    built for speed with torch ops (:func:`tripartite_decode_blocks` with one exact block,
    its first ``n_exact`` tokens read)."""
    t = k_exact.shape[1]
    read = torch.arange(t, device=query.device)[None, :] < n_exact.to(query.device)[:, None]
    return tripartite_decode_blocks(query, ((k_exact, v_exact, read),), centroids, value_sums,
                                    sizes, est_ids, n_est, scale, tilt)


def tripartite_decode_blocks(
    query: torch.Tensor,
    exact: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...],
    centroids: torch.Tensor,
    value_sums: torch.Tensor,
    sizes: torch.Tensor,
    est_ids: torch.Tensor,
    n_est: torch.Tensor,
    scale: float,
    tilt: TiltTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tripartite decode over exact tokens given as blocks ``(keys [R, T_i, D], values
    [R, T_i, D], read [R, T_i] bool)`` — a row attends to the tokens its ``read`` marks, in
    any order (softmax attention does not depend on it) — and the estimated clusters, as in
    :func:`tripartite_decode_ref`. Each block and the estimated clusters are a block of
    logits, merged through their maxima, so the keys are never concatenated into one fresh
    fp32 tensor (that copy, page faults included, was 40% of the reference's time at 128K
    context on CPU), and the softmax is normalised once at the end. Returns (out [R, G, D]
    in the query's dtype, lse [R, G] fp32)."""
    qf = query.float()
    logits = []
    for k, _, read in exact:
        lx = torch.bmm(qf, k.float().transpose(1, 2)).mul_(scale)  # [R, G, T_i]
        logits.append(lx.masked_fill_(~read[:, None], float("-inf")))
    kc, vmean, bias_e = _estimation_terms(centroids, value_sums, sizes, est_ids, n_est)
    le = torch.bmm(qf, kc.transpose(1, 2)).mul_(scale).add_(bias_e[:, None, :])  # [R, G, E]
    spread = None
    if tilt is not None and le.shape[2]:
        spread, lt = _tilt_of_estimated(tilt, est_ids, centroids.shape[1])
        le = le + lt  # -inf (padding, empty) stays -inf
    m = _row_max(le)  # [R, G]
    for lx in logits:
        m = torch.maximum(_row_max(lx), m)
    finite = torch.isfinite(m)
    shift = torch.where(finite, m, torch.zeros_like(m))[..., None]
    total = out = None
    for lx, (_, v, _) in zip(logits, exact, strict=True):
        px = torch.exp(lx.sub_(shift))
        total = px.sum(2) if total is None else total + px.sum(2)
        out = torch.bmm(px, v.float()) if out is None else out.add_(torch.bmm(px, v.float()))
    pe = torch.exp(le.sub_(shift))
    total = pe.sum(2) if total is None else total + pe.sum(2)  # >= 1 where finite
    out = torch.bmm(pe, vmean) if out is None else out.add_(torch.bmm(pe, vmean))
    if spread is not None:
        out.add_((pe * spread[:, None, :]).sum(2, keepdim=True) * tilt.vshift.float())
    out = out / total.clamp_min(1e-30)[..., None]
    lse = torch.where(finite, m + torch.log(total), torch.full_like(m, float("-inf")))
    out = torch.where(finite[..., None], out, torch.zeros_like(out))
    return out.to(query.dtype), lse


@triton.jit
def _log_erfcx(z):
    # log(erfc(z) * exp(z^2)) for z >= 0: Numerical Recipes' erfcc (Chebyshev fit, fractional
    # error < 1.2e-7 everywhere) with the exp(-z^2) factor left out, so nothing underflows
    t = 1.0 / (1.0 + 0.5 * z)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    return tl.log(t) + p


@triton.jit
def log_tilt_tl(v, a):
    # Triton version of log_tilt_ref. With A1 = v/2 + log Phi(a - sqrt v) and
    # A2 = v/2 + log Phi(-a - sqrt v), the result is A1 + log(1 - exp(A2 - A1)) - log erf(a/sqrt2).
    # log Phi(-x) = log(1/2) + log erfcx(x/sqrt2) - x^2/2 (x >= 0), and the v/2 - x^2/2 terms
    # are folded analytically: no cancellation for large v.
    a_safe = tl.maximum(a, 1e-3)
    erf_a = tl.erf(a_safe * 0.7071067811865476)
    # rescale to unit variance: divide by the variance of N(0,1) truncated to [-a, a]
    tvar = 1.0 - 0.7978845608028654 * a_safe * tl.exp(-0.5 * a_safe * a_safe) / erf_a
    v = tl.maximum(v, 0.0) / tvar
    sv = tl.sqrt(v)
    x1 = a_safe - sv
    z1 = tl.abs(x1) * 0.7071067811865476
    lx1 = _log_erfcx(z1)
    a1_neg = -0.6931471805599453 + lx1 + a_safe * sv - 0.5 * a_safe * a_safe
    a1_pos = 0.5 * v + tl.log(1.0 - 0.5 * tl.exp(lx1 - z1 * z1))
    a1 = tl.where(x1 <= 0.0, a1_neg, a1_pos)
    z2 = (a_safe + sv) * 0.7071067811865476
    a2 = -0.6931471805599453 + _log_erfcx(z2) - a_safe * sv - 0.5 * a_safe * a_safe
    den = tl.log(erf_a)
    out = tl.maximum(a1 + tl.log(1.0 - tl.exp(a2 - a1)) - den, 0.0)
    return tl.where((a > 0.0) & (v > 0.0), out, 0.0)


@triton.jit
def online_softmax_step(m, ssum, racc, acc, s, v, spr, TILT: tl.constexpr,
                        PRECISION: tl.constexpr):
    """One block of an online (log-sum-exp) softmax: state (m [G] running max, ssum [G],
    racc [G] the sum of p * spread under the tilted estimator, acc [G, D]) updated with the
    block's logits s [G, N] and values v [N, D] (spreads spr [N]); ``PRECISION`` of the
    p @ v product: "ieee" or "tf32" (fp32 v), or "native" (16-bit v, p rounded to its type,
    as flash attention does). It has no default: Triton 3.6 passes a device function's
    default constexpr as a plain str, which fails to compile. Returns the new state."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    ssum = ssum * alpha + tl.sum(p, axis=1)
    if TILT:
        racc = racc * alpha + tl.sum(p * spr[None, :], axis=1)
    if PRECISION == "native":  # p in v's (16-bit) type: tensor cores, fp32 sums
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p, v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, ssum, racc, acc


@triton.jit
def store_partials(ACC, MX, LS, RA, acc_base, m_base, sacc_g, offs_g, offs_d, gmask, dmask,
                   acc, m, ssum, racc, TILT: tl.constexpr):
    """A split's partial softmax state stored for :func:`merge_partials` (or a merge
    kernel): acc at ``ACC + acc_base`` ([G, D], rows ``sacc_g`` apart), m / ssum / racc
    at ``m_base`` of MX / LS / RA."""
    tl.store(ACC + acc_base + offs_g[:, None] * sacc_g + offs_d[None, :], acc,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(MX + m_base + offs_g, m, mask=gmask)
    tl.store(LS + m_base + offs_g, ssum, mask=gmask)
    if TILT:
        tl.store(RA + m_base + offs_g, racc, mask=gmask)


@triton.jit
def _tripartite_split_kernel(
    Q, KX, VX, NX, CEN, VS, SZ, EID, NE, SP, DV, QV,
    ACC, MX, LS, RA,
    G, D, C, E, chunk, scale,
    sq_r, sq_g, skx_r, skx_t, svx_r, svx_t,
    sc_r, sc_c, svs_r, svs_c, ssz_r, se_r, ssp_r, sdv_r, sqv_r,
    sacc_r, sacc_s, sacc_g, sm_r, sm_s,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILT: tl.constexpr,
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
    racc = tl.zeros([BLOCK_G], tl.float32)  # sum of p * spread (tilted estimator only)
    if TILT:
        qv = tl.load(QV + r * sqv_r + offs_g, mask=gmask, other=0.0)
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
        if TILT:
            spr = tl.load(SP + r * ssp_r + cid, mask=is_e, other=0.0)
            dv = tl.load(DV + r * sdv_r + cid, mask=is_e, other=0.0)
            s += log_tilt_tl(qv[:, None] * spr[None, :], dv[None, :])
        else:
            spr = ssum  # unused without TILT
        m, ssum, racc, acc = online_softmax_step(m, ssum, racc, acc, s, v, spr, TILT, "ieee")
    store_partials(ACC, MX, LS, RA, r * sacc_r + sp * sacc_s, r * sm_r + sp * sm_s, sacc_g,
                   offs_g, offs_d, gmask, dmask, acc, m, ssum, racc, TILT)


@triton.jit
def _merge_splits_kernel(
    ACC, MX, LS, RA, VSH, OUT,
    S, D,
    sacc_r, sacc_s, sacc_g, sm_r, sm_s, svs_r, svs_g, so_r, so_g,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, TILT: tl.constexpr,
):
    # one program per (row, query head): the splits' partial softmax states merged exactly
    r = tl.program_id(0)
    g = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < S
    dmask = offs_d < D
    m = tl.load(MX + r * sm_r + offs_s * sm_s + g, mask=smask, other=float("-inf"))
    ls = tl.load(LS + r * sm_r + offs_s * sm_s + g, mask=smask, other=0.0)
    mmax = tl.max(m, axis=0)
    mmax = tl.where(mmax == float("-inf"), 0.0, mmax)
    w = tl.where(smask, tl.exp(m - mmax), 0.0)
    lsum = tl.sum(ls * w, axis=0)
    acc = tl.load(ACC + r * sacc_r + offs_s[:, None] * sacc_s + g * sacc_g + offs_d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    if TILT:
        ra = tl.load(RA + r * sm_r + offs_s * sm_s + g, mask=smask, other=0.0)
        vsh = tl.load(VSH + r * svs_r + g * svs_g + offs_d, mask=dmask, other=0.0)
        num += tl.sum(ra * w, axis=0) * vsh
    out = tl.where(lsum > 0, num / tl.maximum(lsum, 1.1754943508222875e-38), 0.0)
    tl.store(OUT + r * so_r + g * so_g + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def merge_splits(acc: torch.Tensor, m: torch.Tensor, lsum_parts: torch.Tensor,
                 spread_parts: torch.Tensor | None, vshift: torch.Tensor | None,
                 out: torch.Tensor) -> torch.Tensor:
    """:func:`merge_partials`'s output in one Triton launch, written into ``out``
    ([R, G, D], any float dtype; zeros where nothing was attended); ``spread_parts`` and
    ``vshift`` ([R, G, D] fp32) both given for the tilted estimator, else both None."""
    r, s, g, d = acc.shape
    tilt = spread_parts is not None
    ra = spread_parts if tilt else lsum_parts
    vsh = vshift if tilt else acc
    _merge_splits_kernel[(r, g)](
        acc, m, lsum_parts, ra, vsh, out,
        s, d,
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        vsh.stride(0), vsh.stride(1), out.stride(0), out.stride(1),
        BLOCK_S=block_size(s, 2), BLOCK_D=block_size(d), TILT=tilt,
    )
    return out


def merge_partials(
    acc: torch.Tensor, m: torch.Tensor, lsum_parts: torch.Tensor,
    spread_parts: torch.Tensor | None = None, vshift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split partial softmax states exactly.

    acc: [R, S, G, D] unnormalised outputs; m: [R, S, G] running maxima; lsum_parts:
    [R, S, G] softmax sums (relative to m); for the tilted estimator, spread_parts [R, S, G]
    the sums of ``p * spread`` (relative to m) and vshift [R, G, D] the value shift per unit
    of spread. Returns (out [R, G, D] fp32, lse [R, G] fp32).
    """
    mmax = m.amax(dim=1, keepdim=True)  # [R, 1, G]
    mmax_safe = torch.where(torch.isfinite(mmax), mmax, torch.zeros_like(mmax))
    w = torch.exp(m - mmax_safe)  # exp(-inf) = 0 for empty splits
    lsum = (lsum_parts * w).sum(dim=1)  # [R, G]
    tiny = torch.finfo(torch.float32).tiny
    num = (acc * w[..., None]).sum(dim=1)
    if spread_parts is not None and vshift is not None:
        num = num + (spread_parts * w).sum(dim=1)[..., None] * vshift.float()
    out = num / lsum.clamp_min(tiny)[..., None]
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
    tilt: TiltTerms | None = None,
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
        tilt = None
    if tilt is not None:
        spreads = tilt.spreads.to(dev, torch.float32).contiguous()
        deviates = tilt.deviates.to(dev, torch.float32).contiguous()
        qvar = tilt.qvar.to(dev, torch.float32).contiguous()
    else:  # never read (TILT=False): any fp32 pointer will do
        spreads = deviates = qvar = torch.zeros(r, 1, dtype=torch.float32, device=dev)
    block_d = block_size(d)
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    # the grid from the operands' widths (a bound on n_exact + n_est the host knows), not
    # from the lengths: reading them would wait for the device
    total = k_exact.shape[1] + est_ids.shape[1] if r else 0
    splits = num_splits or _default_splits(r, total, block_n)
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(total, 1), splits), block_n) * block_n)
    splits = max(1, triton.cdiv(max(total, 1), chunk))
    acc = torch.empty(r, splits, g, d, dtype=torch.float32, device=dev)
    mx = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    ls = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    ra = torch.empty_like(ls) if tilt is not None else ls
    if r == 0:
        return torch.empty_like(query), torch.empty(0, g, dtype=torch.float32, device=dev)
    _tripartite_split_kernel[(r, splits)](
        query, k_exact, v_exact, n_exact, centroids, value_sums, sizes, est_ids, n_est,
        spreads, deviates, qvar,
        acc, mx, ls, ra,
        g, d, centroids.shape[1], est_ids.shape[1], chunk, float(scale),
        query.stride(0), query.stride(1), k_exact.stride(0), k_exact.stride(1),
        v_exact.stride(0), v_exact.stride(1), centroids.stride(0), centroids.stride(1),
        value_sums.stride(0), value_sums.stride(1), sizes.stride(0), est_ids.stride(0),
        spreads.stride(0), deviates.stride(0), qvar.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), mx.stride(0), mx.stride(1),
        BLOCK_G=block_size(g), BLOCK_N=block_n, BLOCK_D=block_d, TILT=tilt is not None,
    )
    if tilt is not None:
        out, lse = merge_partials(acc, mx, ls, ra, tilt.vshift.to(dev))
    else:
        out, lse = merge_partials(acc, mx, ls)
    return out.to(query.dtype), lse
