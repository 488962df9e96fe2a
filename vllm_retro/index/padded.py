"""Decode all wave indexes of one layer through one sequence of kernel calls over padded rows:
the batched path on CUDA (and on the CPU with the 'torch' or 'triton' kernel backend; the
'auto' backend on the CPU takes the fused kernel of :mod:`vllm_retro.index.batched`).

Rows are R = B requests x H KV heads, request-major. Per call, whatever B:

1. one cluster-scoring call over the layer's padded meta view (:class:`PaddedMeta`,
   centroids [R, C_max, D]; padding has size 0 and scores ``-inf``) and one top-k of the
   largest zone size among the rows;
2. **one device->host transfer**: every row's retrieval ids and their sizes, together;
3. the fill of the layer's one execution buffer [R, T_max, D]: per request, its steady zone
   (copies) and its mapping-table lookup (one compiled call on the host), then, when the
   stores share one layer pool (the wave buffer's
   :class:`~vllm_retro.buffer.layer_pool.LayerPool`, as in serving), **one gather call**
   for every row's clusters from the host pool (else one per request);
4. the tilted estimator's query terms for all rows (three batched products);
5. one tripartite attention call over all R rows, ragged through ``n_exact`` / ``n_est``.

No device cache here: on CUDA the device step (:mod:`vllm_retro.index.resident`) serves a
layer, with its cluster cache, wherever it fits; this path is what serves when it does not.

The padded view is a copy of the batch's meta indexes (gathered from the layer's meta pool by
one integer table of pool rows when the indexes are in one, as served; else copied row by
row), built when the batch's set of indexes or any of their meta indexes
(:attr:`WaveIndex.meta_generation`) changes — a request joining
or leaving, a block landing — and kept across steps in between by a :class:`MetaViewCache`
the caller holds per layer. What stays per request in step 3 is host-side table work
(a lookup per request, one call into the C++ extension for the layer) and the
steady-zone copies (each index owns its window buffers); none of it waits for the device.

What a CUDA graph could capture: steps 1, 4 and 5 at a fixed batch composition (static
shapes, given a padded T_max bucket); not step 3, whose shapes follow the host-side lookup.

The result is the per-row :meth:`WaveIndex.decode` (fp32 1e-5, 16-bit within rounding; the
cluster choice is the same, exact ties of scores included: both rank with
:func:`~vllm_retro.kernels.scoring.top_clusters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_retro import kernels
from vllm_retro.growth import grown
from vllm_retro.index.resident import ResidentDecode
from vllm_retro.index.steady import fill_steady_batch
from vllm_retro.index.store import shared_batch_group
from vllm_retro.index.wave_index import PhaseClock, WaveIndex, common_meta_pool
from vllm_retro.kernels.tripartite_attention import residual_query_terms


@dataclass(frozen=True)
class PaddedMeta:
    """The meta indexes of a batch's rows, padded to the longest (R = B x H rows)."""

    key: tuple[tuple[int, int], ...]
    """(uid, meta generation) of each index, in batch order: what the view was built from."""
    centroids: torch.Tensor
    """[R, C_max, D] in the indexes' dtype (zeros as padding)."""
    scoring: torch.Tensor
    """[R, C_max, D] centroids for scoring: an fp32 copy on the torch backend (as
    :meth:`WaveIndex._scoring_centroids`), else ``centroids``."""
    value_sums: torch.Tensor
    """[R, C_max, D] in the indexes' dtype."""
    sizes: torch.Tensor
    """[R, C_max] int32 cluster sizes, 0 as padding."""
    empty: torch.Tensor
    """[R, C_max] bool: an empty cluster of the row (not padding)."""
    spreads: torch.Tensor
    """[R, C_max] fp32."""
    deviates: torch.Tensor
    """[R, C_max] fp32."""
    profile: torch.Tensor
    """[R, D] fp32 residual profile per row."""
    key_factor: torch.Tensor
    """[R, D, rank] fp32."""
    value_factor: torch.Tensor
    """[R, D, rank] fp32."""
    n_retrieval: list[int]
    """Retrieval clusters per request (per KV head)."""
    top_k: int
    """Clusters ranked per row: the largest retrieval + estimation zone of the batch."""
    retrieval_keep: torch.Tensor
    """[R, r_max] bool: slot j of the ranking is in the row's retrieval zone."""
    estimation_slots: torch.Tensor
    """[R, e_max] int64: the ranking slots of the row's estimation zone (valid up to
    ``n_est``)."""
    n_est: torch.Tensor
    """[R] int64 estimation clusters per row."""


class MetaViewCache:
    """One layer's decode state kept across steps: the padded meta view of its last batch
    (until the batch changes) and its execution buffer."""

    def __init__(self) -> None:
        self.view: Any = None
        """The last batch's view (a :class:`PaddedMeta`, or another index kind's)."""
        self.packed: Any = None
        """The last fused batch's argument lists (a
        :class:`~vllm_retro.kernels.cpu_decode.PackedBatch`: references to the rows' own
        tensors, no copies), reused while the batch's rows are unchanged."""
        self.fused_key: tuple | None = None
        self.fused_ok = False
        """Whether the batch ``fused_key`` (its indexes, the query's dtype and device) decodes
        through the fused CPU kernel with its own scoring (asked once per batch:
        :func:`vllm_retro.index.batched.decode_batch`)."""
        self._exec: tuple[torch.Tensor, torch.Tensor] | None = None
        self.resident = ResidentDecode()
        """The layer's decode from device-resident KV, where it applies
        (:mod:`vllm_retro.index.resident`)."""

    def exec_buffer(self, rows: int, tokens: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [rows, tokens, head_dim] (K, V) of this layer's execution buffer, grown by
        >= 1.5x when too small. It is zero-filled when allocated and afterwards holds only
        KV rows, so slots past a row's length are finite (the kernels mask them by weight,
        and a NaN there would survive a zero weight)."""
        need = rows * tokens * head_dim
        held = self._exec
        if held is None or held[0].numel() < need or held[0].dtype != dtype \
                or held[0].device != device:
            size = grown(need, 0 if held is None else held[0].numel())
            held = self._exec = (torch.zeros(size, dtype=dtype, device=device),
                                 torch.zeros(size, dtype=dtype, device=device))
        shape = (rows, tokens, head_dim)
        return held[0][:need].view(shape), held[1][:need].view(shape)

    def get(self, indexes: list, build: Callable[[list, tuple], Any] | None = None) -> Any:
        """The view of ``indexes`` (rebuilt when the batch or a meta index changed):
        ``build(indexes, key)``, by default :func:`padded_meta` (a :class:`PaddedMeta`)."""
        key = _view_key(indexes)
        if self.view is None or self.view.key != key:
            self.view = None  # release the old copy before building the new one
            self.view = (build or padded_meta)(indexes, key)
        return self.view

    def nbytes(self) -> int:
        """Bytes held: the padded meta view's tensors and the execution buffer."""
        held = [] if self._exec is None else list(self._exec)
        if self.view is not None:
            held += [t for t in vars(self.view).values() if isinstance(t, torch.Tensor)]
        unique = {t.data_ptr(): t for t in held}  # ``scoring`` may be ``centroids``
        return sum(t.numel() * t.element_size() for t in unique.values()) + \
            self.resident.nbytes()

    def clear(self) -> None:
        """Drop the view and the execution buffer (the layer has no indexed rows)."""
        self.view = None
        self.packed = None
        self.fused_key = None
        self._exec = None
        self.resident.clear()


def _pad(parts: list[torch.Tensor], width: int, dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """Stack ``parts`` ([H, c_b, ...] each) into [B * H, width, ...], zero-padded."""
    first = parts[0]
    out = first.new_zeros((len(parts), first.shape[0], width, *first.shape[2:]),
                          dtype=dtype or first.dtype)
    for b, p in enumerate(parts):
        out[b, :, :p.shape[1]] = p
    return out.flatten(0, 1)


def _pool_rows(indexes: list[WaveIndex], counts: list[int], width: int
               ) -> Callable[[str], torch.Tensor] | None:
    """When every index's meta rows are in one layer pool: a field's rows of all of them,
    [B * H, width, ...] zero-padded, by one gather from the pool at the rows' extents (an
    integer table of B x width pool rows); else None."""
    common = common_meta_pool(indexes)
    if common is None:
        return None
    pool, firsts = common
    dev = pool.device
    col = torch.arange(width, device=dev)
    valid = col[None, :] < torch.tensor(counts, device=dev)[:, None]  # [B, width]
    starts = torch.tensor(firsts, device=dev)
    at = torch.where(valid, starts[:, None] + col[None, :], 0).flatten()

    def rows(name: str) -> torch.Tensor:
        x = pool.tensors[name]  # [H, capacity, *trail]
        got = x[:, at].unflatten(1, valid.shape).transpose(0, 1)  # [B, H, width, *trail]
        keep = valid[:, None].reshape(*valid.shape[:1], 1, width, *[1] * (x.dim() - 2))
        return torch.where(keep, got, torch.zeros((), dtype=x.dtype, device=dev)).flatten(0, 1)

    return rows


def _view_key(indexes: list[WaveIndex]) -> tuple[tuple[int, int], ...]:
    return tuple((i.uid, i.meta_generation) for i in indexes)


def padded_meta(indexes: list[WaveIndex], key: tuple[tuple[int, int], ...] | None = None
                ) -> PaddedMeta:
    """Build the padded meta view of ``indexes`` (one layer: same config and head layout);
    ``key``: their :func:`_view_key`, when the caller has it."""
    first = indexes[0]
    cfg, h, dev = first.config, first.num_kv_heads, first.centroids.device
    counts = [i.num_clusters for i in indexes]
    width = max(counts)
    n_ret = [cfg.num_retrieval(c) for c in counts]
    n_est = [cfg.num_estimation(c) for c in counts]
    top_k = max(r + e for r, e in zip(n_ret, n_est, strict=True))
    r_max, e_max = max(n_ret), max(n_est)
    rows = _pool_rows(indexes, counts, width) or (
        lambda name: _pad([getattr(i, name) for i in indexes], width))
    centroids = rows("centroids")
    sizes = rows("sizes")
    in_row = (torch.arange(width, device=dev)[None, :]
              < torch.tensor(counts, device=dev).repeat_interleave(h)[:, None])
    per_row = torch.tensor(n_ret, device=dev).repeat_interleave(h)
    est_per_row = torch.tensor(n_est, device=dev).repeat_interleave(h)
    slots = per_row[:, None] + torch.arange(e_max, device=dev)[None, :]
    torch_scoring = kernels.resolve_backend(first.backend, dev) == "torch"
    return PaddedMeta(
        key=key if key is not None else _view_key(indexes),
        centroids=centroids,
        scoring=centroids.float() if torch_scoring else centroids,
        value_sums=rows("value_sums"),
        sizes=sizes, empty=in_row & (sizes == 0),
        spreads=rows("spreads"),
        deviates=rows("deviates"),
        profile=torch.cat([i.residuals.profile for i in indexes]),
        key_factor=torch.cat([i.residuals.key_factor for i in indexes]),
        value_factor=torch.cat([i.residuals.value_factor for i in indexes]),
        n_retrieval=n_ret, top_k=top_k,
        retrieval_keep=torch.arange(r_max, device=dev)[None, :] < per_row[:, None],
        estimation_slots=slots.clamp_max(max(top_k - 1, 0)),
        n_est=est_per_row,
    )


def padded_supported(index: WaveIndex) -> bool:
    """True when ``index`` can decode through :func:`decode_padded`: a plain
    :class:`WaveIndex` (:attr:`WaveIndex.selects_zones`; baselines select differently)."""
    return index.selects_zones


def decode_padded(indexes: list[WaveIndex], query: torch.Tensor, scale: float,
                  out: torch.Tensor, cache: MetaViewCache | None = None,
                  phases: dict[str, float] | None = None) -> torch.Tensor:
    """Tripartite decode of ``query[b]`` over ``indexes[b]`` for all rows at once (see the
    module docstring). query: [B, Hq, D]; out: [B, Hq, D] (written, returned). ``cache``
    keeps the padded meta view across calls (None: built for this call). ``phases``, when
    given, accumulates seconds per phase (``view``, ``select``: scoring + top-k,
    ``transfer``: the device->host copy, ``lookup+gather``, ``estimator``, ``attention``),
    synchronising the device at each boundary (benchmarks only)."""
    first = indexes[0]
    mark = PhaseClock(phases, query.device)
    b, h, d = len(indexes), first.num_kv_heads, first.head_dim
    dev, dtype, backend = first.centroids.device, first.centroids.dtype, first.backend
    meta = cache.get(indexes) if cache is not None else padded_meta(indexes)
    mark("view")
    q = query.reshape(b * h, -1, d)
    r_max = meta.retrieval_keep.shape[1]
    if meta.top_k:
        scores = kernels.cluster_scores(q, meta.scoring, meta.sizes, scale, backend=backend)
        # a row's empty clusters rank above its padding, so no zone reaches the padding
        scores = scores.masked_fill(meta.empty, torch.finfo(scores.dtype).min)
        top = kernels.top_clusters(scores, meta.top_k)
    else:
        top = torch.zeros(b * h, 0, dtype=torch.int64, device=dev)
    mark("select")
    retrieval = top[:, :r_max]
    sizes = torch.gather(meta.sizes, 1, retrieval).long() * meta.retrieval_keep
    host = torch.stack([retrieval, sizes]).cpu().numpy()  # the step's one device->host copy
    mark("transfer")
    n_steady = [i.num_steady for i in indexes]
    n_exact = torch.tensor(n_steady).repeat_interleave(h) + torch.from_numpy(host[1].sum(axis=1))
    t = max(int(n_exact.max()), 1)
    buffers = cache if cache is not None else MetaViewCache()  # without one: a fresh buffer
    exec_k, exec_v = buffers.exec_buffer(b * h, t, d, dtype, dev)
    fill_steady_batch(indexes, exec_k, exec_v)  # one gather for all rows of a layer's pool
    ids = [np.ascontiguousarray(host[0, j * h:(j + 1) * h, :meta.n_retrieval[j]])
           for j in range(b)]
    stores = [i.store for i in indexes]
    group = shared_batch_group(stores)
    if group is not None:  # one layer pool: one gather for all rows
        group.gather_batch(stores, ids, n_steady, exec_k, exec_v)
    else:
        for j, st in enumerate(stores):
            rows = slice(j * h, (j + 1) * h)
            st.gather_into(ids[j], n_steady[j], exec_k[rows], exec_v[rows])
    mark("lookup+gather")
    tilt = None
    est = top.gather(1, meta.estimation_slots) if meta.estimation_slots.shape[1] else \
        torch.zeros(b * h, 0, dtype=torch.int64, device=dev)
    if first.config.tilted_estimation and est.shape[1]:
        qvar, vshift = residual_query_terms(q, meta.profile, meta.key_factor,
                                            meta.value_factor, scale)
        tilt = kernels.TiltTerms(meta.spreads, meta.deviates, qvar, vshift)
    mark("estimator")
    res, _ = kernels.tripartite_decode(
        q, exec_k, exec_v, n_exact.to(dev, non_blocking=True), meta.centroids,
        meta.value_sums, meta.sizes, est, meta.n_est, scale, tilt, backend=backend)
    mark("attention")
    out.copy_(res.reshape(out.shape))
    return out


@dataclass(frozen=True)
class PaddedSizes:
    """The cluster sizes of a batch's indexes, padded to the most clusters (R = B x H rows):
    the meta view of indexes whose clusters are chosen for them (:func:`decode_given`)."""

    key: tuple[tuple[int, int], ...]
    """(uid, meta generation) of each index: what the view was built from."""
    sizes: torch.Tensor
    """[R, C_max] int64 (0 as padding)."""


def padded_sizes(indexes: list[WaveIndex], key: tuple[tuple[int, int], ...]) -> PaddedSizes:
    """Build the :class:`PaddedSizes` view of ``indexes`` (one layer)."""
    width = max(max(i.num_clusters for i in indexes), 1)
    return PaddedSizes(key, _pad([i.sizes.long() for i in indexes], width))


def decode_given(indexes: list[WaveIndex], query: torch.Tensor, scale: float,
                 out: torch.Tensor, ids: torch.Tensor, counts: list[int],
                 cache: MetaViewCache | None = None) -> torch.Tensor:
    """Exact attention of ``query[b]`` ([B, Hq, D]) over the steady zone of ``indexes[b]``
    and the clusters chosen for it, ``ids[b, :, :counts[b]]`` (ids [B, H, W] int64 on the
    indexes' device, -1 padding; e.g. a trained router's buckets), for all rows at once;
    ``out`` ([B, Hq, D]) is written and returned. No estimation zone.

    Per call, whatever B: one lookup of the chosen clusters' sizes in the layer's padded
    sizes view (kept by ``cache`` across steps), **one device->host copy** of the ids and
    sizes, the steady zones' fill (one gather for a layer's pool), one gather of every
    row's clusters when the stores share a layer pool, and one attention call."""
    first = indexes[0]
    b, h, d = len(indexes), first.num_kv_heads, first.head_dim
    dev, dtype = ids.device, first.steady.dtype
    buffers = cache if cache is not None else MetaViewCache()
    view = buffers.get(indexes, build=padded_sizes)
    flat = ids.reshape(b * h, -1)
    sizes = torch.gather(view.sizes, 1, flat.clamp_min(0)) * (flat >= 0)
    host = torch.stack([flat, sizes]).cpu().numpy()  # the step's one device->host copy
    n_steady = [i.num_steady for i in indexes]
    n_exact = torch.tensor(n_steady).repeat_interleave(h) + torch.from_numpy(host[1].sum(1))
    exec_k, exec_v = buffers.exec_buffer(b * h, max(int(n_exact.max()), 1), d, dtype, dev)
    fill_steady_batch(indexes, exec_k, exec_v)
    chosen = [np.ascontiguousarray(host[0, j * h:(j + 1) * h, :counts[j]]) for j in range(b)]
    stores = [i.store for i in indexes]
    group = shared_batch_group(stores)
    if group is not None:
        group.gather_batch(stores, chosen, n_steady, exec_k, exec_v)
    else:
        for j, st in enumerate(stores):
            rows = slice(j * h, (j + 1) * h)
            st.gather_into(chosen[j], n_steady[j], exec_k[rows], exec_v[rows])
    none = torch.zeros(b * h, 0, dtype=torch.int64, device=dev)
    res, _ = kernels.tripartite_decode(
        query.reshape(b * h, -1, d), exec_k, exec_v, n_exact.to(dev, non_blocking=True),
        exec_k[:, :0], exec_v[:, :0], none.int(), none,
        torch.zeros(b * h, dtype=torch.int64, device=dev), scale, backend=first.backend)
    out.copy_(res.reshape(out.shape))
    return out
