"""Fused batched decode on CPU: scoring, selection and tripartite attention of every indexed
row of a layer in one call (a C++ extension, ``kernels/csrc/retro_cpu.cpp``).

The same extension holds the CPU k-means assignment (``kernels/csrc/kmeans_cpu.cpp``,
:func:`vllm_retro.kernels.kmeans.kmeans_assign_cpu`) and the graph index's build, insertion,
search and decode (``kernels/csrc/graph_cpu.cpp``, :mod:`vllm_retro.kernels.graph_cpu`);
this module builds and loads it.

Per row (one request at one layer) the inputs are its own tensors, referenced in place: the
meta index (centroids, value sums, sizes, the tilted estimator's spreads and deviates and
residual-model terms), its KV pool of cluster-contiguous rows with each cluster's first row,
and its steady zone (sinks and window). Nothing is copied into a padded batch, so rows may
differ in clusters, steady-zone length and budgets; the extension runs the (row, KV head)
pairs in parallel (ATen's OpenMP pool) with one online softmax per query head in fp32.
:func:`decode_plan` runs the same computation for a layer that holds its rows in pools
(:class:`~vllm_retro.index.device_layer.DeviceLayer`), each row addressed by the integers
of the layer's step plan.

:func:`decode_rows_ref` is the plain-torch reference of the same function, built from the
per-row kernels' references (:func:`~vllm_retro.kernels.scoring.cluster_scores_ref`,
:func:`~vllm_retro.kernels.scoring.top_clusters` with the kernel's tie-break,
:func:`~vllm_retro.kernels.tripartite_attention.tripartite_decode_ref`).

The extension is built and loaded by :mod:`vllm_retro.kernels.cpu_ext`; without it
(:func:`~vllm_retro.kernels.cpu_ext.load` returns None) callers fall back to the
per-row path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_retro.kernels import cpu_ext
from vllm_retro.kernels.resident_attention import LayerPools
from vllm_retro.kernels.scoring import cluster_scores_ref, page_bound_scores_ref, top_clusters
from vllm_retro.kernels.tripartite_attention import TiltTerms, tripartite_decode_ref


@dataclass(frozen=True)
class DecodeRow:
    """One row's inputs (all on the CPU, one storage dtype; H KV heads, C clusters)."""

    centroids: torch.Tensor
    """[H, C, D] cluster centroids (last dim contiguous), or [H, C, 2D] page bounds (each
    page's key max, then min), scored by Quest's bound ``sum_d max(q_d max_d, q_d min_d)``
    (then :attr:`n_estimation` must be 0)."""
    value_sums: torch.Tensor
    """[H, C, D] per-cluster sums of values."""
    sizes: torch.Tensor
    """[H, C] int32 tokens per cluster (0: empty, never selected for reading)."""
    spreads: torch.Tensor
    """[H, C] fp32 mean squared key distance from the centroid (tilted estimator)."""
    deviates: torch.Tensor
    """[H, C] fp32 expected largest deviate per cluster (tilted estimator)."""
    profile: torch.Tensor | None
    """[H, D] fp32 residual key-variance profile; None with the paper's estimator."""
    key_factor: torch.Tensor | None
    """[H, D, rank] fp32 (tilted estimator)."""
    value_factor: torch.Tensor | None
    """[H, D, rank] fp32 (tilted estimator)."""
    kv_keys: torch.Tensor
    """[rows, D] pool of indexed keys, cluster-contiguous."""
    kv_values: torch.Tensor
    """[rows, D] pool of indexed values, same layout."""
    cluster_starts: torch.Tensor
    """[H, >=C] int64: cluster c of head h starts at pool row
    ``head_rows * h + cluster_starts[h, c] * start_mult``."""
    head_rows: int
    start_mult: int
    sink_k: torch.Tensor
    """[H, s, D] steady-zone sinks."""
    sink_v: torch.Tensor
    win_k: torch.Tensor
    """[H, w, D] steady-zone window, or the ring it lives in (see :attr:`win_first`)."""
    win_v: torch.Tensor
    n_retrieval: int
    """Clusters read exactly (clamped to C)."""
    n_estimation: int
    """Clusters estimated after them (clamped to C - retrieval)."""
    win_first: int = 0
    """Ring row of the window's first token: the window is rows ``(win_first + i) % w``."""
    n_win: int | None = None
    """Window rows (of the ring, from :attr:`win_first` on); None: all ``w``."""


def fused_path(backend: str, device: torch.device) -> bool:
    """True when indexes with kernel ``backend`` on ``device`` decode through the fused CPU
    kernels (the CPU, the 'auto' backend, the extension built)."""
    from vllm_retro.kernels import resolve_backend  # the package imports this module

    return (device.type == "cpu" and backend == "auto"
            and resolve_backend("auto", device) == "torch" and cpu_ext.available())


@dataclass(slots=True, eq=False)
class PackedRow:
    """One row's argument lists for the extension, in :func:`decode_packed`'s order. Built
    by :func:`pack_row`; reusable for as long as the row's tensors stay the same objects
    (a caller can keep it across steps and pass the window's current length per call)."""

    meta: list[torch.Tensor]
    tilt: list[torch.Tensor]
    """Empty for the paper's estimator."""
    kv: list[torch.Tensor]
    steady: list[torch.Tensor]
    ints: list[int]
    """head_rows, start_mult, sinks, window rows, the window's first ring row, retrieval
    clusters, estimated clusters."""
    heads: int


_INTS_PER_ROW = 7
"""Entries of :attr:`PackedRow.ints`; the window's rows and first ring row are entries 3
and 4."""


@dataclass(slots=True)
class PackedBatch:
    """:func:`decode_packed`'s argument lists for a batch of packed rows, concatenated once
    (:func:`pack_batch`). A caller that decodes the same rows call after call (a layer's
    batch while no row's :class:`PackedRow` changes) keeps it: each call then only writes
    the rows' windows into :attr:`ints`."""

    rows: tuple[PackedRow, ...]
    meta: list[torch.Tensor]
    tilt: list[torch.Tensor]
    kv: list[torch.Tensor]
    steady: list[torch.Tensor]
    ints: list[int]
    """The rows' :attr:`PackedRow.ints` in order; every call rewrites the window entries."""


def pack_batch(rows: list[PackedRow], held: PackedBatch | None = None) -> PackedBatch:
    """The batch of ``rows``: ``held`` when it holds these very :class:`PackedRow` objects
    in this order (nothing rebuilt), else their lists concatenated anew."""
    if held is not None and held.rows == tuple(rows):  # the same objects (eq=False: identity)
        return held
    meta: list[torch.Tensor] = []
    tilt: list[torch.Tensor] = []
    kv: list[torch.Tensor] = []
    steady: list[torch.Tensor] = []
    ints: list[int] = []
    for r in rows:
        meta += r.meta
        tilt += r.tilt
        kv += r.kv
        steady += r.steady
        ints += r.ints
    return PackedBatch(tuple(rows), meta, tilt, kv, steady, ints)


def window_len(r: DecodeRow) -> int:
    """Window rows ``r`` attends."""
    return r.win_k.shape[1] if r.n_win is None else r.n_win


def pack_row(r: DecodeRow, tilted: bool) -> PackedRow:
    """``r``'s argument lists (``decode_packed(windows=...)`` can move its window within its
    ring per call)."""
    return PackedRow(
        meta=[r.centroids, r.value_sums, r.sizes, r.spreads, r.deviates],
        tilt=[r.profile, r.key_factor, r.value_factor] if tilted else [],
        kv=[r.kv_keys, r.kv_values, r.cluster_starts],
        steady=[r.sink_k, r.sink_v, r.win_k, r.win_v],
        ints=[r.head_rows, r.start_mult, r.sink_k.shape[1],
              window_len(r), r.win_first, r.n_retrieval,
              r.n_estimation],
        heads=r.centroids.shape[0])


def ring_rows(ring: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Rows ``(first + i) % ring.shape[1]``, ``i < n``, of a ring [H, cap, D] ([H, n, D])."""
    cap = ring.shape[1]
    if n == 0 or cap == 0:
        return ring[:, :0]
    return ring[:, (first + torch.arange(n)) % cap]


def decode_rows(query: torch.Tensor, rows: list[DecodeRow], scale: float, tilted: bool,
                selection_width: int = 0, out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused tripartite decode of ``len(rows)`` rows.

    query: [B, Hq, D] (B = len(rows), Hq a multiple of H; query head i of row b uses KV
    head ``i // (Hq // H)``), the rows' storage dtype. ``tilted``: the tilted estimator
    (needs each row's profile and factors) instead of the paper's. Returns (out [B, Hq, D]
    in query's dtype, lse [B, Hq] fp32, selection [B, H, selection_width] int64: each head's
    clusters in score order, retrieval first, -1 padding). ``out``, when given ([B, Hq, D],
    query's dtype, last dim contiguous), receives the output in place.
    """
    return decode_packed(query, [pack_row(r, tilted) for r in rows], scale, tilted,
                         selection_width, out)


PHASES = ("scoring", "selection", "lookup", "attention", "estimation")
"""The fused kernel's phases per (row, KV head): cluster scoring (logits and the group's
softmax), selection (top-k thresholds and zone lists), lookup (the exact rows' addresses:
steady zone and retrieved clusters, read in place), exact attention, estimation zone (with the
output write)."""

_NO_PHASES = torch.empty(0, dtype=torch.int64)


def decode_packed(query: torch.Tensor, rows: list[PackedRow] | PackedBatch, scale: float,
                  tilted: bool, selection_width: int = 0, out: torch.Tensor | None = None,
                  windows: list[tuple[int, int]] | None = None,
                  phases: dict[str, float] | None = None,
                  given: list[torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_rows` on packed rows (:func:`pack_row`), or on a batch of them kept
    across calls (:func:`pack_batch`); ``windows``, when given, each row's window this call
    as (first ring row, rows), overriding its packed ones. ``given``,
    when given, each row's retrieval clusters ([H, n] int64, chosen by the caller, e.g. a
    trained router): the kernel then attends the steady zone and those clusters exactly, with
    no scoring and no estimation zone (the rows' meta index needs only sizes). ``phases``, when
    given, accumulates the kernel's wall seconds split by :data:`PHASES` in proportion to the
    threads' time in each (summed over rows and heads), under ``"kernel " + phase``."""
    mod = cpu_ext.load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {cpu_ext.load_error()}")
    batch = rows if isinstance(rows, PackedBatch) else pack_batch(rows)
    b, hq, _ = query.shape
    if len(batch.rows) != b:
        raise ValueError(f"{len(batch.rows)} rows for a query batch of {b}")
    h = batch.rows[0].heads if b else 1
    if out is None:
        out = torch.empty_like(query)
    lse = torch.empty(b, hq, dtype=torch.float32)
    sel = torch.empty(b, h, selection_width, dtype=torch.int64)
    ints = batch.ints
    if windows is not None:
        if len(windows) != b:
            raise ValueError(f"{len(windows)} windows for a query batch of {b}")
        for i, (first, n) in enumerate(windows):
            ints[_INTS_PER_ROW * i + 3] = n
            ints[_INTS_PER_ROW * i + 4] = first
    elif batch is rows:  # a kept batch: its windows may be an earlier call's
        for i, r in enumerate(batch.rows):
            ints[_INTS_PER_ROW * i + 3] = r.ints[3]
            ints[_INTS_PER_ROW * i + 4] = r.ints[4]
    if tilted and len(batch.tilt) != 3 * b:
        raise ValueError("tilted decoding needs every row packed with its tilted terms")
    phase_ns = _NO_PHASES if phases is None else torch.zeros(b * h, len(PHASES),
                                                             dtype=torch.int64)
    t0 = time.perf_counter()
    mod.decode_rows(query, out, lse, sel, float(scale), batch.meta, batch.tilt, batch.kv,
                    batch.steady, ints, tilted, [] if given is None else given, phase_ns)
    if phases is not None:
        wall = time.perf_counter() - t0
        per = phase_ns.sum(0).double()
        share = per / per.sum().clamp_min(1)
        for name, f in zip(PHASES, share.tolist(), strict=True):
            phases["kernel " + name] = phases.get("kernel " + name, 0.0) + wall * f
    return out, lse, sel


def decode_plan(query: torch.Tensor, pools: LayerPools, plan: torch.Tensor, scale: float,
                tilted: bool, given: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The device step of a layer (:func:`vllm_retro.index.device_layer.decode_step`) on the
    CPU in one call: :func:`decode_rows`' computation for plan column ``b``'s request over
    the layer's pools, each row addressed by the plan's integers (``plan``: [len(PLAN_FIELDS),
    B] int64, :data:`~vllm_retro.kernels.step_plan.PLAN_FIELDS`) instead of tensors of its
    own. ``given`` ([B, H, W] int64): each head's retrieval clusters, the first ``retrieval``
    of column b (:func:`~vllm_retro.index.device_layer.decode_given_step`; nothing scored or
    estimated). query: [B, Hq, D] in the pools' dtype. Returns ``out`` ([B, Hq, D];
    allocated when None). Equals :func:`decode_rows` on the same rows exactly (the same
    per-head computation, addressed differently)."""
    mod = cpu_ext.load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {cpu_ext.load_error()}")
    if out is None:
        out = torch.empty_like(query)
    p = pools
    mod.decode_plan(query, out, float(scale),
                    [p.keys, p.values, p.centroids, p.value_sums, p.sizes, p.starts, p.spreads,
                     p.deviates, p.profile, p.key_factor, p.value_factor, p.steady_k,
                     p.steady_v],
                    plan, p.sink_cap, tilted, _NO_GIVEN if given is None else given)
    return out


_NO_GIVEN = torch.empty(0, dtype=torch.int64)


def steady_write(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                 rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``pool_k[slots[i], rows[i]] = keys[i]`` and ``pool_v[...] = values[i]`` for every
    i, in one call (a layer's steady pool taking the step's new token of every row).
    pool_k, pool_v: [S, R, H, D] contiguous; keys, values: [B, H, D] in the pools' dtype,
    last dim contiguous; slots, rows: [B] int64. Raises RuntimeError naming an index
    outside the pool (nothing written then)."""
    mod = cpu_ext.load()
    if mod is None:
        raise RuntimeError(f"the fused CPU kernels are unavailable: {cpu_ext.load_error()}")
    mod.steady_write(pool_k, pool_v, slots, rows, keys, values)


@dataclass(slots=True)
class PQRow:
    """One request's PQCache state for :func:`pq_decode` (tensors referenced, not copied)."""

    codes: torch.Tensor
    """[H, N, m] uint8 codes of the N indexed tokens (rows contiguous)."""
    codebooks: torch.Tensor
    """[H, m, K, D / m] fp32 codewords (contiguous)."""
    token_cluster: torch.Tensor
    """[>= N] int64 the cluster (block) of each indexed token."""
    token_offset: torch.Tensor
    """[>= N] int64 each indexed token's place in its cluster."""
    cluster_starts: torch.Tensor
    """[H, >= C] int64: token i of head h is pool row ``head_rows * h +
    cluster_starts[h, token_cluster[i]] * start_mult + token_offset[i]``."""
    head_rows: int
    start_mult: int
    keys: torch.Tensor
    """[rows, D] the pool's keys (a host tier's pages flattened, or a dense store's)."""
    values: torch.Tensor
    """[rows, D] the pool's values."""
    sink_k: torch.Tensor
    """[H, n_sink, D]; likewise sink_v, and the window's ring win_k / win_v ([H, cap, D]) of
    which ``n_win`` rows from ``win_first`` on (wrapping) count."""
    sink_v: torch.Tensor
    win_k: torch.Tensor
    win_v: torch.Tensor
    n_win: int
    budget: int
    """Indexed tokens read exactly per KV head (k)."""
    win_first: int = 0


def pq_decode(query: torch.Tensor, rows: list[PQRow], scale: float,
              out: torch.Tensor | None = None, selection_width: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PQCache's decode step of ``query[b]`` ([B, Hq, D]) over ``rows[b]``, all rows in one
    call (threads over rows x KV heads): lookup-table scores of every indexed token (the
    GQA group's summed softmax of ``scale * q . k_hat``), the top ``budget`` by (score desc,
    index asc), exact attention over the steady zone and those tokens read in place.
    Returns (out [B, Hq, D] query dtype, lse [B, Hq] fp32, selection [B, H, width] int64:
    each head's chosen token indices, ascending, when ``selection_width`` > 0)."""
    mod = cpu_ext.load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {cpu_ext.load_error()}")
    if out is None:
        out = torch.empty_like(query)
    b, hq, _ = query.shape
    h = rows[0].codes.shape[0] if rows else 1
    lse = torch.empty(b, hq, dtype=torch.float32)
    sel = torch.full((b, h, selection_width), -1, dtype=torch.int64)
    pq, pools, steady, ints = [], [], [], []
    for r in rows:
        pq += [r.codes, r.codebooks, r.token_cluster, r.token_offset, r.cluster_starts]
        pools += [r.keys, r.values]
        steady += [r.sink_k, r.sink_v, r.win_k, r.win_v]
        ints += [r.budget, r.head_rows, r.start_mult, r.n_win, r.win_first]
    mod.pq_decode(query, out, lse, sel, float(scale), pq, pools, steady, ints)
    return out, lse, sel


def pq_decode_ref(query: torch.Tensor, rows: list[PQRow], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Plain-torch reference of :func:`pq_decode` (fp32 math): (out, lse, per-row chosen
    token indices [H, k] ascending)."""
    outs, lses, chosen = [], [], []
    for b, r in enumerate(rows):
        h, n, m = r.codes.shape
        d = query.shape[2]
        q = query[b].reshape(h, -1, d).float()
        sub = q.reshape(h, q.shape[1], m, d // m)
        lut = torch.einsum("hgmd,hmkd->hgmk", sub, r.codebooks) * scale
        idx = r.codes.long().permute(0, 2, 1)[:, None].expand(h, q.shape[1], m, n)
        logits = torch.gather(lut, 3, idx).sum(2)  # [H, G, N]
        score = torch.softmax(logits, dim=-1).sum(1)  # [H, N]
        # tokens with equal codes score exactly alike (a vectorised softmax may differ in
        # the last bit between lanes): each takes its code's first token's score
        joint = (r.codes.long() * (256 ** torch.arange(m))).sum(-1)  # [H, N]
        for hh in range(h):
            _, inverse = torch.unique(joint[hh], return_inverse=True)
            first = torch.full((int(inverse.max()) + 1 if n else 0,), n, dtype=torch.int64)
            first = first.scatter_reduce(0, inverse, torch.arange(n), "amin")
            score[hh] = score[hh, first[inverse]]
        k = min(r.budget, n)
        # (score desc, index asc): a stable sort of the negated scores
        top = torch.sort(-score, dim=1, stable=True).indices[:, :k].sort(dim=1).values
        heads = torch.arange(h)[:, None]
        prow = (r.head_rows * heads + r.cluster_starts[heads, r.token_cluster[top]]
                * r.start_mult + r.token_offset[top])
        keys = torch.cat([r.sink_k, ring_rows(r.win_k, r.win_first, r.n_win), r.keys[prow]],
                         dim=1).float()
        values = torch.cat([r.sink_v, ring_rows(r.win_v, r.win_first, r.n_win),
                            r.values[prow]], dim=1).float()
        lx = torch.einsum("hgd,hnd->hgn", q, keys) * scale
        lses.append(torch.logsumexp(lx, -1).reshape(-1))
        outs.append(torch.einsum("hgn,hnd->hgd", torch.softmax(lx, -1), values)
                    .reshape(-1, d).to(query.dtype))
        chosen.append(top)
    return torch.stack(outs), torch.stack(lses), chosen


def decode_rows_ref(query: torch.Tensor, rows: list[DecodeRow], scale: float, tilted: bool,
                    given: list[torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Plain-torch reference of :func:`decode_rows` (and of :func:`decode_packed` with
    ``given`` selections: those clusters read exactly, no estimation): (out, lse, per-row
    selections [H, r + e])."""
    outs, lses, sels = [], [], []
    for b, r in enumerate(rows):
        h, d = r.centroids.shape[0], query.shape[2]
        c = r.centroids.shape[1]
        q = query[b].reshape(h, -1, d)
        k = min(r.n_retrieval + r.n_estimation, c)
        nr = min(r.n_retrieval, k)
        if given is not None:
            top = given[b]
            k = nr = top.shape[1]
        elif k:
            score = cluster_scores_ref if r.centroids.shape[2] == d else page_bound_scores_ref
            scores = score(q, r.centroids, r.sizes, scale)
            top = top_clusters(scores, k)
        else:
            top = torch.zeros(h, 0, dtype=torch.int64)
        ret, est = top[:, :nr], top[:, nr:]
        parts_k = [r.sink_k, ring_rows(r.win_k, r.win_first, window_len(r))]
        parts_v = [r.sink_v, ring_rows(r.win_v, r.win_first, window_len(r))]
        keys, values, n_exact = [], [], []
        for hh in range(h):
            rows_h = [torch.arange(0, 0, dtype=torch.int64)]
            for cl in ret[hh].tolist():
                n = int(r.sizes[hh, cl])
                first = r.head_rows * hh + int(r.cluster_starts[hh, cl]) * r.start_mult
                rows_h.append(torch.arange(first, first + n))
            idx = torch.cat(rows_h)
            keys.append(torch.cat([p[hh] for p in parts_k] + [r.kv_keys[idx]]))
            values.append(torch.cat([p[hh] for p in parts_v] + [r.kv_values[idx]]))
            n_exact.append(keys[-1].shape[0])
        t = max(n_exact)
        k_exact = torch.zeros(h, t, d, dtype=query.dtype)
        v_exact = torch.zeros_like(k_exact)
        for hh in range(h):
            k_exact[hh, :n_exact[hh]] = keys[hh]
            v_exact[hh, :n_exact[hh]] = values[hh]
        terms = None
        if tilted and est.shape[1]:
            qf = q.float()
            qvar = ((qf * qf) @ r.profile[..., None])[..., 0] * (scale * scale)
            vshift = (qf @ r.key_factor) @ r.value_factor.transpose(1, 2) * scale
            terms = TiltTerms(r.spreads, r.deviates, qvar, vshift)
        n_est = torch.full((h,), est.shape[1], dtype=torch.int64)
        out, lse = tripartite_decode_ref(q, k_exact, v_exact, torch.tensor(n_exact),
                                         r.centroids[..., :d], r.value_sums, r.sizes, est, n_est,
                                         scale, terms)
        outs.append(out.reshape(-1, d))
        lses.append(lse.reshape(-1))
        sels.append(top)
    return torch.stack(outs), torch.stack(lses), sels
