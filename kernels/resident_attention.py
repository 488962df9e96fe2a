"""Tripartite decode attention read in place from a layer's pools (device-resident KV).

The attention half of the device decode step (:mod:`vllm_retro.index.device_layer`): for
each row ``r`` (one (request, KV head)) with its zones ``top[r]`` of cluster ids (the
retrieval zone, then the estimation zone: :mod:`kernels.zone_select`), the exact tokens are

- its steady zone: ``n_sinks`` sinks, then ``n_steady - n_sinks`` window tokens in a ring
  (window token ``i`` at ring row ``(ring_start + i) % ring``), rows of the layer's steady
  pool ``[S, sink_cap + ring, H, D]`` at its slot and head;
- its retrieval zone: the tokens of clusters ``top[r, :n_ret]``, cluster-contiguous rows of
  the layer's cluster pool ``[P, N, D]`` (cluster c of pool row p at ``starts[p, c]`` of
  p's region, ``sizes[p, c]`` tokens) or, read in place, one pool ``[M, D]`` that every row
  shares (``starts`` absolute);

and the estimated clusters are ``top[r, n_ret:n_ret + n_est]``, each a pseudo-token with its
centroid as key, its mean value, log-weight ``log(size)`` and, with the tilted estimator,
the spread correction of :mod:`kernels.tripartite_attention`. The result is that module's
``tripartite_decode_ref`` over the same tokens: :func:`resident_attention_torch` gathers
the steady zone's and the retrieval zone's tokens as two blocks and attends to both (the
reference), :func:`resident_attention_triton` reads every key and value where it lies — no
execution buffer — split along the tokens over many programs, in two launches (attention,
merge).

The batch comes as the step's plan, one int64 tensor ``[len(PLAN_FIELDS), B]`` (request b's
slot, steady slot, clusters, zone sizes, sinks and window), and row ``r`` is request
``r // H``'s KV head ``r % H``: the kernels derive every per-row integer themselves.
Retrieval tokens are addressed through the zone's runs (:func:`retrieval_runs`):
``ends[j]``, the zone's token count through cluster ``j``, and ``offs[j]``, the pool row of
the zone's token 0 were it in cluster ``j`` (its start minus the tokens before it), so
retrieval token ``u`` lies at pool row ``offs[j] + u`` for ``j`` the number of ends
``<= u``; the Triton kernel builds them per program in registers.

Read in place through a cluster cache (:mod:`kernels.cluster_cache`, the step's ``runs`` from
its lookup), a retrieved cluster's first ``T`` tokens come from the cache where it hits, and
an admitted miss's are written there as they are read; the result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_retro.kernels._common import block_size, tensor_cores_16bit, tl, triton
from vllm_retro.kernels.cluster_cache import ClusterCache
from vllm_retro.kernels.step_plan import PlanRows, flat_meta, plan_rows
from vllm_retro.kernels.tripartite_attention import (
    TiltTerms,
    log_tilt_tl,
    merge_splits,
    online_softmax_step,
    residual_query_terms,
    store_partials,
    tripartite_decode_blocks,
)

RETRIEVAL_MAPS = ("onehot", "search")
"""How the Triton kernel finds a retrieval token's cluster (its run, see the module
docstring): 'onehot' compares the tile's tokens with every run end and picks the run's
offsets by one-hot sums in registers ([BLOCK_N, BLOCK_R] per tile and value picked); 'search'
writes the runs to a scratch row per program and binary-searches them per token (log2
BLOCK_R loads from L1 per tile, no 2-D temporaries). The same result."""

RETRIEVAL_MAP = "onehot"
"""The default of :data:`RETRIEVAL_MAPS` (the one measured on an H100/H200 so far; 'search'
waits for its first GPU measurement: ``bench/device_step.py --kernels`` times both)."""


@dataclass(frozen=True)
class LayerPools:
    """A layer's tensors as the decode step reads them (rows ``P = slots x H``), all
    contiguous."""

    keys: torch.Tensor
    """Indexed keys, cluster-contiguous: [P, N, D], a region of N rows per pool row (``starts``
    relative to it), or [M, D], one pool all rows share (``starts`` absolute: a wave buffer's
    host tier read in place, pinned on CUDA so the kernels read it over the bus; its row 0
    must be finite: the torch path reads it for masked tokens)."""
    values: torch.Tensor
    """Laid out as ``keys``."""
    centroids: torch.Tensor
    """[..., D] the meta rows' centroids (read flat: a step row's cluster c at its plan's
    ``meta_row + head * meta_stride + c``, :data:`~kernels.step_plan.PLAN_FIELDS`): a
    layer's meta pool [H, capacity, D], or [P, C, D] per pool row."""
    value_sums: torch.Tensor
    """[..., D], laid out as ``centroids``."""
    sizes: torch.Tensor
    """[...] int32 (0: empty), laid out as ``centroids``."""
    starts: torch.Tensor
    """[P, C] int64 first row of each cluster in ``keys`` (by pool row)."""
    spreads: torch.Tensor
    """[...] fp32, laid out as ``centroids``."""
    deviates: torch.Tensor
    """[...] fp32, laid out as ``centroids``."""
    profile: torch.Tensor
    """[P, D] fp32 residual profile (the tilted estimator's)."""
    key_factor: torch.Tensor
    """[P, D, rank] fp32."""
    value_factor: torch.Tensor
    """[P, D, rank] fp32."""
    steady_k: torch.Tensor
    """[S, sink_cap + ring, H, D] the steady pool's keys."""
    steady_v: torch.Tensor
    """[S, sink_cap + ring, H, D]."""
    sink_cap: int

    @property
    def row_tokens(self) -> int:
        """Rows of ``keys`` per pool row: N, or 0 for one shared pool (absolute starts)."""
        return self.keys.shape[1] if self.keys.dim() == 3 else 0


def retrieval_runs(sizes: torch.Tensor, starts: torch.Tensor, rows: PlanRows,
                   top: torch.Tensor, r_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ends, offs) [R, r_max] of the retrieval zones ``top[:, :n_ret]`` (see the module
    docstring); clusters past a row's ``n_ret`` count 0 tokens. ``sizes``: the meta rows
    (flat, by ``rows.meta_row``); ``starts``: [P, C_cap] (by ``rows.pool_row``)."""
    ids = top[:, :r_max]
    keep = torch.arange(r_max, device=top.device)[None, :] < rows.n_ret[:, None]
    lengths = torch.take(sizes, torch.where(keep, rows.meta_row[:, None] + ids, 0))
    lengths = lengths.long() * keep
    ends = lengths.cumsum(1)
    flat = rows.pool_row[:, None] * starts.shape[1] + ids
    return ends, torch.take(starts, flat) - (ends - lengths)


def resident_attention_torch(query: torch.Tensor, pools: LayerPools, plan: torch.Tensor,
                             top: torch.Tensor, width: int, r_max: int, e_max: int,
                             scale: float, tilted: bool = True,
                             cache: ClusterCache | None = None,
                             runs: torch.Tensor | None = None) -> torch.Tensor:
    """The reference (torch operations): two blocks of exact tokens gathered from the pools
    — the slot's steady-pool rows at the row's head ([R, sink_cap + ring, D], the sinks and
    window tokens read, in ring order), and the retrieval zone's tokens from the cluster pool
    ([R, width - sink_cap - ring, D]) — then :func:`tripartite_decode_blocks`. query
    [R, G, D]; plan [len(PLAN_FIELDS), B] int64; top [R, K] int64 cluster ids (the retrieval
    zone, then the estimation zone; ``r_max`` and ``e_max`` bound the rows' zone sizes);
    ``width``: the steady pool's rows per slot plus a bound on every row's retrieval tokens;
    ``tilted``: the tilted estimator (its query terms from the pools' residual model), else
    the paper's. Returns [R, G, D] in the query's dtype."""
    r, _, d = query.shape
    dev = query.device
    h = pools.steady_k.shape[2]
    rows = plan_rows(plan, h)
    z = pools.steady_k.shape[1]
    ring = z - pools.sink_cap
    # the steady zone in pool order: sink i at row i, window token i at ring row
    # (ring_start + i) % ring
    q = torch.arange(z, device=dev)[None, :]
    age = (q - pools.sink_cap - rows.ring_start[:, None]) % ring
    steady_read = (q < rows.sinks[:, None]) | (
        (q >= pools.sink_cap) & (age < (rows.n_steady - rows.sinks)[:, None]))
    src = ((rows.steady_slot[:, None] * z + q) * h + rows.head[:, None]).reshape(-1)
    steady_k = pools.steady_k.view(-1, d).index_select(0, src).view(r, z, d)
    steady_v = pools.steady_v.view(-1, d).index_select(0, src).view(r, z, d)
    blocks = [(steady_k, steady_v, steady_read)]
    t_ret = width - z
    if r_max and t_ret > 0:
        ends, offs = retrieval_runs(pools.sizes, pools.starts, rows, top, r_max)
        u = torch.arange(t_ret, device=dev).repeat(r, 1)
        run = torch.searchsorted(ends, u, right=True).clamp_max(r_max - 1)
        read = u < ends[:, -1:]
        tok = torch.where(read, torch.gather(offs, 1, run) + u, 0)  # row 0: finite, unread
        src = (rows.pool_row[:, None] * pools.row_tokens + tok).reshape(-1)
        ret_k = pools.keys.view(-1, d).index_select(0, src).view(r, t_ret, d)
        ret_v = pools.values.view(-1, d).index_select(0, src).view(r, t_ret, d)
        if cache is not None:
            _through_cache(cache, runs, ends, run, u, read, ret_k, ret_v)
        blocks.append((ret_k, ret_v, read))
    k_top = top.shape[1]
    est_slots = (rows.n_ret[:, None] + torch.arange(e_max, device=dev)[None, :]).clamp_max(
        max(k_top - 1, 0))
    est = torch.arange(e_max, device=dev)[None, :] < rows.n_est[:, None]
    flat_est = torch.where(est, rows.meta_row[:, None] + torch.gather(top, 1, est_slots), 0)
    # past a row's zone: zeros (a meta pool's free rows hold whatever was there)
    cen = flat_meta(pools.centroids)  # Quest's page bounds, [.., 2D]: nothing estimated
    cen_e = cen.index_select(0, flat_est.reshape(-1)).view(r, e_max, cen.shape[1])[..., :d]
    cen_e = torch.where(est[..., None], cen_e, 0)
    vs_e = flat_meta(pools.value_sums).index_select(0, flat_est.reshape(-1)).view(r, e_max, d)
    vs_e = torch.where(est[..., None], vs_e, 0)
    terms = None
    if tilted and e_max:
        qvar, vshift = residual_query_terms(
            query, pools.profile.index_select(0, rows.pool_row),
            pools.key_factor.index_select(0, rows.pool_row),
            pools.value_factor.index_select(0, rows.pool_row), scale)
        terms = TiltTerms(torch.where(est, torch.take(pools.spreads, flat_est), 0),
                          torch.where(est, torch.take(pools.deviates, flat_est), 0), qvar,
                          vshift)
    local = torch.arange(e_max, device=dev)[None, :].expand(r, e_max)
    out, _ = tripartite_decode_blocks(query, tuple(blocks), cen_e, vs_e,
                                      torch.take(pools.sizes, flat_est), local, rows.n_est,
                                      scale, terms)
    return out


def _through_cache(cache: ClusterCache, runs: torch.Tensor, ends: torch.Tensor,
                   run: torch.Tensor, u: torch.Tensor, retrieved: torch.Tensor,
                   exec_k: torch.Tensor, exec_v: torch.Tensor) -> None:
    """The torch path's cache: retrieval tokens (``retrieved`` [R, W] of the execution
    buffer, zone token ``u`` in run ``run``) of hits replaced in ``exec_k`` / ``exec_v`` by
    the cache's rows; those of admitted misses written to the cache."""
    d = exec_k.shape[2]
    begin = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
    i = u - torch.gather(begin, 1, run)  # the token's place in its cluster
    row0 = torch.gather(runs[0], 1, run)
    hit = torch.gather(runs[1], 1, run).bool()
    in_cache = retrieved & (row0 >= 0) & (i < cache.block_tokens)
    sink = cache.keys.shape[0] - 1
    rows = torch.where(in_cache, row0 + i, sink).reshape(-1)
    read = (in_cache & hit).reshape(-1, 1)
    flat_k, flat_v = exec_k.view(-1, d), exec_v.view(-1, d)
    flat_k.copy_(torch.where(read, cache.keys.index_select(0, rows), flat_k))
    flat_v.copy_(torch.where(read, cache.values.index_select(0, rows), flat_v))
    fill = torch.where((in_cache & ~hit).reshape(-1), rows, sink)
    cache.keys.index_copy_(0, fill, flat_k)
    cache.values.index_copy_(0, fill, flat_v)


@triton.jit
def _logits(q, k, scale, DOT16: tl.constexpr):
    """Scaled logits [G, N] of query heads q [G, D] against keys k [N, D]: 16-bit operands
    multiply on tensor cores (exact products, fp32 sums), fp32 ones in IEEE fp32."""
    if DOT16:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return s * scale


@triton.jit
def _exact_tile(m, ssum, racc, acc, q, K, V, rows, valid, D, offs_d, dmask, scale, no_spread,
                TILT: tl.constexpr, DOT16: tl.constexpr):
    """A tile of exact tokens, rows ``rows`` [N] of K / V ([*, D] rows; ``valid`` [N] of them
    real), into the online softmax state; p @ v in the values' 16-bit type on tensor cores
    (p rounded as flash attention does), or IEEE fp32. Returns the new state."""
    mk = valid[:, None] & dmask[None, :]
    k = tl.load(K + rows[:, None] * D + offs_d[None, :], mask=mk, other=0.0)
    v = tl.load(V + rows[:, None] * D + offs_d[None, :], mask=mk, other=0.0)
    return _exact_kv(m, ssum, racc, acc, q, k, v, valid, scale, no_spread, TILT, DOT16)


@triton.jit
def _exact_kv(m, ssum, racc, acc, q, k, v, valid, scale, no_spread, TILT: tl.constexpr,
              DOT16: tl.constexpr):
    """Exact tokens ``k``, ``v`` [N, D] (``valid`` [N] of them real) into the online softmax
    state (see :func:`_exact_tile`)."""
    s = tl.where(valid[None, :], _logits(q, k, scale, DOT16), float("-inf"))
    if not DOT16:
        v = v.to(tl.float32)
    PV: tl.constexpr = "native" if DOT16 else "ieee"
    return online_softmax_step(m, ssum, racc, acc, s, v, no_spread, TILT, PV)


@triton.jit
def _cached_tile(m, ssum, racc, acc, q, K, V, CK, CV, rows, crows, valid, read, fill, D,
                 offs_d, dmask, scale, no_spread, TILT: tl.constexpr, DOT16: tl.constexpr):
    """:func:`_exact_tile` of retrieval tokens with a cluster cache: those ``read`` from the
    cache at its rows ``crows``, the others at ``rows`` of K / V, and those to ``fill``
    written to the cache as they are read."""
    here = read[:, None] & dmask[None, :]
    there = (valid & ~read)[:, None] & dmask[None, :]
    k = tl.load(K + rows[:, None] * D + offs_d[None, :], mask=there, other=0.0)
    v = tl.load(V + rows[:, None] * D + offs_d[None, :], mask=there, other=0.0)
    k = tl.where(here, tl.load(CK + crows[:, None] * D + offs_d[None, :], mask=here,
                               other=0.0), k)
    v = tl.where(here, tl.load(CV + crows[:, None] * D + offs_d[None, :], mask=here,
                               other=0.0), v)
    into = fill[:, None] & dmask[None, :]
    tl.store(CK + crows[:, None] * D + offs_d[None, :], k, mask=into)
    tl.store(CV + crows[:, None] * D + offs_d[None, :], v, mask=into)
    return _exact_kv(m, ssum, racc, acc, q, k, v, valid, scale, no_spread, TILT, DOT16)


@triton.jit
def _resident_split_kernel(
    Q, PLAN, TOP, KP, VP, SKP, SVP, CEN, VS, SZ, ST, SP, DV, PRF, KF, VF,
    CK, CV, RUNS, ACC, MX, LS, RA, VSH, SCR,
    B, G, D, H, N_CAP, C_CAP, SINK_CAP, RING, R_MAX, K_TOP, RANK, T_CACHE, chunk, scale,
    sq_r, sq_g, s_top, s_runp, s_run, sacc_r, sacc_s, sacc_g, sm_r, sm_s, svs_r, svs_g,
    sscr_r, sscr_s,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILT: tl.constexpr, DOT16: tl.constexpr,
    CACHE: tl.constexpr, SEARCH: tl.constexpr, LOG_R: tl.constexpr,
):
    # one program per (row, split of the row's virtual tokens: steady, retrieved, estimated);
    # a split walks its share of each zone in a loop of its own, so a tile loads only its
    # zone's rows and the tilted correction runs on estimated tiles only
    r = tl.program_id(0)
    sp = tl.program_id(1)
    b = r // H
    head = r % H
    prow = tl.load(PLAN + b) * H + head  # the plan's rows: see PLAN_FIELDS
    mrow = tl.load(PLAN + 9 * B + b) + head * tl.load(PLAN + 10 * B + b)  # its meta rows
    sslot = tl.load(PLAN + B + b)
    nret = tl.load(PLAN + 3 * B + b)
    ne = tl.load(PLAN + 4 * B + b)
    sinks = tl.load(PLAN + 5 * B + b)
    rstart = tl.load(PLAN + 6 * B + b)
    nst = sinks + tl.load(PLAN + 7 * B + b)
    # the retrieval zone's runs, in registers: ends (tokens through cluster j), offs
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < nret
    cid_r = tl.load(TOP + r * s_top + offs_r, mask=rmask, other=0)
    len_r = tl.load(SZ + mrow + cid_r, mask=rmask, other=0).to(tl.int64)
    ends = tl.cumsum(len_r, axis=0)
    offs_run = tl.load(ST + prow * C_CAP + cid_r, mask=rmask, other=0) - (ends - len_r)
    if CACHE:  # the cluster cache's row of zone token u is coff[j] + u while u < cend[j]
        row0 = tl.load(RUNS + r * s_run + offs_r, mask=rmask, other=-1)
        hit_r = tl.load(RUNS + s_runp + r * s_run + offs_r, mask=rmask, other=0)
        coff_r = row0 - (ends - len_r)
        cend_r = tl.where(row0 >= 0, ends - len_r + T_CACHE, 0)
    ends = tl.where(rmask, ends, 9223372036854775807)
    if SEARCH:  # the runs to this program's scratch rows, searched per token below
        scr = SCR + r * sscr_r + sp * sscr_s
        tl.store(scr + offs_r, ends)
        tl.store(scr + BLOCK_R + offs_r, offs_run)
        if CACHE:
            tl.store(scr + 2 * BLOCK_R + offs_r, coff_r)
            tl.store(scr + 3 * BLOCK_R + offs_r, cend_r)
            tl.store(scr + 4 * BLOCK_R + offs_r, hit_r.to(tl.int64))
        tl.debug_barrier()  # stored by some threads, read by others
    nx = nst + tl.sum(len_r, axis=0)
    total = nx + ne
    start = sp * chunk
    end = tl.minimum(start + chunk, total)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(Q + r * sq_r + offs_g[:, None] * sq_g + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_G], tl.float32)
    racc = tl.zeros([BLOCK_G], tl.float32)
    no_spread = tl.zeros([BLOCK_N], tl.float32)  # exact tokens: no tilted correction
    # p @ v of estimated tokens (fp32 mean values): tf32, or IEEE fp32 for fp32 runs
    PV_EST: tl.constexpr = "tf32" if DOT16 else "ieee"
    if TILT:  # variance of scale * q.(k - C) per unit of spread
        qs = q.to(tl.float32) * scale
        prf = tl.load(PRF + prow * D + offs_d, mask=dmask, other=0.0)
        qv = tl.sum(qs * qs * prf[None, :], axis=1)
        if sp == 0:  # the value shift per unit of spread, scale * (q KF) VF^T, for the merge
            offs_k = tl.arange(0, BLOCK_K)
            fmask = dmask[:, None] & (offs_k < RANK)[None, :]
            kf = tl.load(KF + (prow * D + offs_d[:, None]) * RANK + offs_k[None, :],
                         mask=fmask, other=0.0)
            vf = tl.load(VF + (prow * D + offs_d[:, None]) * RANK + offs_k[None, :],
                         mask=fmask, other=0.0)
            qk = tl.sum(qs[:, :, None] * kf[None, :, :], axis=1)  # [G, rank]
            vsh = tl.sum(qk[:, None, :] * vf[None, :, :], axis=2)  # [G, D]
            tl.store(VSH + r * svs_r + offs_g[:, None] * svs_g + offs_d[None, :], vsh,
                     mask=gmask[:, None] & dmask[None, :])
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    z = SINK_CAP + RING
    # steady zone: sinks, then the window's ring
    s_end = tl.minimum(end, nst)
    for off in range(start, s_end, BLOCK_N):
        pos = off + offs_n
        valid = pos < s_end
        zrow = tl.where(pos < sinks, pos, SINK_CAP + (rstart + pos - sinks) % RING)
        srow = ((sslot * z + zrow) * H + head).to(tl.int64)
        m, ssum, racc, acc = _exact_tile(m, ssum, racc, acc, q, SKP, SVP, srow, valid, D,
                                         offs_d, dmask, scale, no_spread, TILT, DOT16)
    # retrieval zone: token u in run j = the number of ends <= u, at pool row offs[j] + u;
    # j by a binary search of the scratch rows (SEARCH: LOG_R loads per token) or by a
    # [BLOCK_N, BLOCK_R] compare and one-hot picks in registers
    c_end = tl.minimum(end, nx)
    for off in range(tl.maximum(start, nst), c_end, BLOCK_N):
        pos = off + offs_n
        valid = pos < c_end
        u = pos - nst
        if SEARCH:
            run = tl.zeros([BLOCK_N], tl.int32)
            for k in tl.static_range(LOG_R):  # upper bound of u in ends (< BLOCK_R: see above)
                probe = tl.load(scr + run + ((BLOCK_R >> (k + 1)) - 1))
                run = tl.where(probe <= u, run + (BLOCK_R >> (k + 1)), run)
            off_run = tl.load(scr + BLOCK_R + run)
        else:
            run = tl.sum((u[:, None] >= ends[None, :]).to(tl.int32), axis=1)
            onehot = offs_r[None, :] == run[:, None]
            off_run = tl.sum(tl.where(onehot, offs_run[None, :], 0), axis=1)
        crow = prow * N_CAP + off_run + u
        if CACHE:
            if SEARCH:
                in_cache = valid & (u < tl.load(scr + 3 * BLOCK_R + run))
                hit = tl.load(scr + 4 * BLOCK_R + run) > 0
                ccrow = tl.load(scr + 2 * BLOCK_R + run) + u
            else:
                in_cache = valid & (u < tl.sum(tl.where(onehot, cend_r[None, :], 0), axis=1))
                hit = tl.sum(tl.where(onehot, hit_r[None, :], 0), axis=1) > 0
                ccrow = tl.sum(tl.where(onehot, coff_r[None, :], 0), axis=1) + u
            m, ssum, racc, acc = _cached_tile(m, ssum, racc, acc, q, KP, VP, CK, CV, crow,
                                              ccrow, valid, in_cache & hit, in_cache & ~hit,
                                              D, offs_d, dmask, scale, no_spread, TILT, DOT16)
        else:
            m, ssum, racc, acc = _exact_tile(m, ssum, racc, acc, q, KP, VP, crow, valid, D,
                                             offs_d, dmask, scale, no_spread, TILT, DOT16)
    # estimation zone: ranking slots n_ret .. n_ret + n_est, each cluster a pseudo-token
    # (centroid key, mean value, log-weight log(size))
    for off in range(tl.maximum(start, nx), end, BLOCK_N):
        pos = off + offs_n
        slot = tl.minimum(nret + pos - nx, K_TOP - 1)
        cid = tl.load(TOP + r * s_top + slot, mask=pos < end, other=0)
        sz = tl.load(SZ + mrow + cid, mask=pos < end, other=0).to(tl.float32)
        valid = (pos < end) & (sz > 0)
        crow_e = (mrow + cid).to(tl.int64)
        me = valid[:, None] & dmask[None, :]
        k = tl.load(CEN + crow_e[:, None] * D + offs_d[None, :], mask=me, other=0.0)
        v = tl.load(VS + crow_e[:, None] * D + offs_d[None, :], mask=me, other=0.0)
        v = v.to(tl.float32) / tl.maximum(sz, 1.0)[:, None]
        s = _logits(q, k, scale, DOT16) + tl.log(tl.maximum(sz, 1.0))[None, :]
        if TILT:
            spr = tl.load(SP + crow_e, mask=valid, other=0.0)
            dv = tl.load(DV + crow_e, mask=valid, other=0.0)
            s += log_tilt_tl(qv[:, None] * spr[None, :], dv[None, :])
        else:
            spr = no_spread
        s = tl.where(valid[None, :], s, float("-inf"))
        m, ssum, racc, acc = online_softmax_step(m, ssum, racc, acc, s, v, spr, TILT, PV_EST)
    store_partials(ACC, MX, LS, RA, r * sacc_r + sp * sacc_s, r * sm_r + sp * sm_s, sacc_g,
                   offs_g, offs_d, gmask, dmask, acc, m, ssum, racc, TILT)


def resident_attention_triton(query: torch.Tensor, pools: LayerPools, plan: torch.Tensor,
                              top: torch.Tensor, width: int, r_max: int, e_max: int,
                              scale: float, tilted: bool = True,
                              cache: ClusterCache | None = None,
                              runs: torch.Tensor | None = None,
                              num_splits: int | None = None,
                              retrieval_map: str = RETRIEVAL_MAP) -> torch.Tensor:
    """Triton version of :func:`resident_attention_torch` (same arguments and result): two
    launches, every key and value read in place, the row's integers and retrieval runs
    derived in the kernel, the row's tokens split over ``num_splits`` programs (default:
    enough to fill a large GPU) sized from ``width + e_max`` — bounds the host knows, so
    nothing waits for the device. 16-bit queries and pools multiply on tensor cores (q.k
    exact products with fp32 sums; p @ v with p rounded to the values' type, as flash
    attention does); fp32 ones in IEEE fp32. ``retrieval_map``: how a retrieval token finds
    its cluster (one of :data:`RETRIEVAL_MAPS`; the same result)."""
    if retrieval_map not in RETRIEVAL_MAPS:
        raise ValueError(f"retrieval_map {retrieval_map!r}; accepted: "
                         + ", ".join(RETRIEVAL_MAPS))
    r, g, d = query.shape
    dev = query.device
    out = torch.empty_like(query)
    if r == 0:
        return out
    h = pools.steady_k.shape[2]
    tilt = tilted and e_max > 0
    block_d = block_size(d)
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    total = max(width + e_max, 1)
    # ~4 programs per SM of a 132-SM GPU (the first H100 run, at 2 per SM, was latency-bound)
    splits = num_splits or max(1, min(triton.cdiv(528, r), triton.cdiv(total, block_n)))
    chunk = max(block_n, triton.cdiv(triton.cdiv(total, splits), block_n) * block_n)
    splits = triton.cdiv(total, chunk)
    acc = torch.empty(r, splits, g, d, dtype=torch.float32, device=dev)
    mx = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    ls = torch.empty(r, splits, g, dtype=torch.float32, device=dev)
    ra = torch.empty_like(ls) if tilt else ls
    vsh = torch.empty(r, g, d, dtype=torch.float32, device=dev) if tilt else acc
    query = query.contiguous()
    top = top.contiguous()
    rank = pools.key_factor.shape[2]
    dot16 = tensor_cores_16bit(query, pools.keys, pools.values, pools.steady_k,
                               pools.steady_v, pools.centroids)
    cached = cache is not None and r_max > 0
    if cached:
        ck, cv, t_cache = cache.keys, cache.values, cache.block_tokens
        runs = runs.contiguous()
    else:
        ck, cv, t_cache, runs = pools.keys, pools.values, 0, top
    block_r = block_size(max(r_max, 1))
    search = retrieval_map == "search" and r_max > 0
    scr = (torch.empty(r, splits, 5 if cached else 2, block_r, dtype=torch.int64, device=dev)
           if search else top)
    _resident_split_kernel[(r, splits)](
        query, plan, top, pools.keys, pools.values, pools.steady_k, pools.steady_v,
        flat_meta(pools.centroids), flat_meta(pools.value_sums), flat_meta(pools.sizes, 0),
        pools.starts, flat_meta(pools.spreads, 0), flat_meta(pools.deviates, 0),
        pools.profile, pools.key_factor, pools.value_factor,
        ck, cv, runs, acc, mx, ls, ra, vsh, scr,
        plan.shape[1], g, d, h, pools.row_tokens, pools.starts.shape[1], pools.sink_cap,
        pools.steady_k.shape[1] - pools.sink_cap, max(r_max, 1), max(top.shape[1], 1), rank,
        t_cache, chunk, float(scale),
        query.stride(0), query.stride(1), top.stride(0),
        runs.stride(0) if cached else 0, runs.stride(1) if cached else 0,
        acc.stride(0), acc.stride(1), acc.stride(2), mx.stride(0), mx.stride(1),
        vsh.stride(0), vsh.stride(1),
        scr.stride(0) if search else 0, scr.stride(1) if search else 0,
        BLOCK_G=block_size(g), BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_R=block_r, BLOCK_K=block_size(rank, 2), TILT=tilt,
        DOT16=dot16, CACHE=cached, SEARCH=search, LOG_R=block_r.bit_length() - 1,
    )
    merge_splits(acc, mx, ls, ra if tilt else None, vsh if tilt else None, out)
    return out
