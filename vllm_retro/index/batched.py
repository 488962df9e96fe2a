"""Decode many wave indexes of one layer at once: one fused kernel call for all rows on the
CPU, one sequence of kernel calls over padded rows elsewhere (:mod:`vllm_retro.index.padded`).

:meth:`WaveIndex.decode` is the per-row reference (select, gather through the store, tripartite
attention: ~30 torch ops and a mapping-table lookup per row). On the CPU the fused kernel
(:mod:`vllm_retro.kernels.cpu_decode`) does the same for every row of a layer in one call,
reading each row's meta index, steady zone and retrieved clusters in place:

- rows backed by a :class:`~vllm_retro.index.store.DenseClusterStore` are read from its
  cluster-contiguous tensors;
- rows backed by the wave buffer are read from the host tier's pages, in place (on a CPU
  the host tier *is* the memory attention runs from).

The result is the same function as the per-row path (fp32 1e-5, 16-bit within rounding; the
cluster choice is the same up to exact ties of scores).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_retro import faults
from vllm_retro.index.padded import (
    MetaViewCache,
    decode_given,
    decode_padded,
    padded_supported,
)
from vllm_retro.index.store import RowAddressedStore
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.kernels import cpu_decode, upload
from vllm_retro.kernels.cpu_decode import fused_path

_ROW_ADDRESSED: dict[type, bool] = {}
"""Store class -> whether it is a :class:`RowAddressedStore` (a runtime protocol check is
slow, and it is asked for every row of every layer at every step)."""


def fused_supported(index: WaveIndex, query: torch.Tensor) -> bool:
    """True when ``index`` can decode ``query`` through the fused CPU kernel, scoring
    included (:attr:`WaveIndex.kernel_scores`: the wave index's centroids, Quest's page
    bounds) from rows the kernel can read (:func:`fused_batch` of that one index)."""
    return fused_batch([index], query, scoring=True)


def fused_batch(indexes: list[WaveIndex], query: torch.Tensor, scoring: bool = False
                ) -> bool:
    """True when the fused CPU kernel can read every index's rows (one layer's batch) for
    ``query``: on the CPU with the 'auto' kernel backend and the kernel built (asked once
    for the batch: this runs in every layer's forward), a store that exposes its rows
    (:class:`RowAddressedStore`), the query in the index's dtype; and, with ``scoring``,
    every index's clusters scored by the kernel (:attr:`WaveIndex.kernel_scores`)."""
    if not fused_path("auto", query.device):
        return False
    dtype = query.dtype
    return all((not scoring or i.kernel_scores) and _rows_readable(i, dtype)
               for i in indexes)


def _rows_readable(index: WaveIndex, dtype: torch.dtype) -> bool:
    """:func:`fused_batch`'s per-index checks."""
    if index.backend != "auto":
        return False
    kind = type(index.store)
    addressed = _ROW_ADDRESSED.get(kind)
    if addressed is None:
        addressed = _ROW_ADDRESSED[kind] = isinstance(index.store, RowAddressedStore)
    return addressed and dtype == index.meta_dtype


def _fused_scoring(indexes: list[WaveIndex], query: torch.Tensor,
                   cache: MetaViewCache | None) -> bool:
    """``fused_batch(indexes, query, scoring=True)``, asked once per batch of the layer
    (``cache``): what it checks of an index (kernel backend, store kind, dtype, policy) never
    changes, so while the layer decodes the same indexes for the same query dtype and device
    the answer is its last one."""
    if cache is None:
        return fused_batch(indexes, query, scoring=True)
    key = (tuple(indexes), query.dtype, query.device)
    if cache.fused_key != key:  # the indexes compared by identity (no __eq__)
        cache.fused_key, cache.fused_ok = key, fused_batch(indexes, query, scoring=True)
    return cache.fused_ok


def decode_row(index: WaveIndex) -> cpu_decode.DecodeRow:
    """The fused kernel's view of one index (tensors referenced, not copied)."""
    cfg = index.config
    scoring, n_retrieval, n_estimation = index.fused_scoring()
    keys, values, starts, head_rows, mult = index.store.cluster_rows(
        wait=not index.store_settling)
    res = index.residuals
    tilted = cfg.tilted_estimation
    win_k, win_v, first, n_win = index.window_ring()
    return cpu_decode.DecodeRow(
        centroids=scoring, value_sums=index.value_sums, sizes=index.sizes,
        spreads=index.spreads, deviates=index.deviates,
        profile=res.profile if tilted else None,
        key_factor=res.key_factor if tilted else None,
        value_factor=res.value_factor if tilted else None,
        kv_keys=keys, kv_values=values, cluster_starts=starts, head_rows=head_rows,
        start_mult=mult, sink_k=index.sink_k, sink_v=index.sink_v, win_k=win_k, win_v=win_v,
        win_first=first, n_win=n_win, n_retrieval=n_retrieval, n_estimation=n_estimation)


def packed_row(index: WaveIndex, tilted: bool) -> cpu_decode.PackedRow:
    """The fused kernel's packed arguments for ``index`` with its window's whole ring (the
    caller passes the window's place in it per call), cached on the index
    (:attr:`WaveIndex.fused_view`) until its meta index changes or moves, its store replaces
    its pools (then the old pools are released) or its steady pool is replaced, so a decode
    step does no per-row Python work beyond the lookup."""
    generation = (index.store.layout_generation, index.steady.generation,
                  index.meta_rows.pool.generation)
    view = index.fused_view
    if view is None or view[0] != generation:
        row = decode_row(index)
        view = index.fused_view = (generation, cpu_decode.pack_row(row, tilted))
    return view[1]


AppendRows = tuple[tuple[tuple[int, int, int], ...], torch.Tensor, torch.Tensor]
"""Where :func:`append_batch` writes a batch's tokens: ((slot, position, sinks) per row,
slots [B], pool rows [B]); the same in every layer of a step (a request's slot, position
and sink count are), so the metadata builder makes it once (:func:`plan_append`)."""


def plan_append(indexes: list[WaveIndex], positions: list[int]) -> AppendRows | None:
    """The steady-pool rows that tokens ``positions[b]`` of ``indexes[b]`` go to (one
    upload, not waited for on CUDA); None when the indexes' steady zones are not in one
    pool (each then appends its own)."""
    pool = indexes[0].steady
    if not all([i.steady is pool for i in indexes]):
        return None
    key = tuple([(i.slot, p, i.num_sinks) for i, p in zip(indexes, positions, strict=True)])
    ring = [pool.ring_row(sinks, p) for _, p, sinks in key]
    dev = upload([[s for s, _, _ in key], ring], pool.device)
    return key, dev[0], dev[1]


def append_batch(indexes: list[WaveIndex], keys: torch.Tensor, values: torch.Tensor,
                 rows: AppendRows | None = None,
                 failed: list[tuple[int, Exception]] | None = None
                 ) -> tuple[int, AppendRows | None]:
    """Append one decoded token to each index (``keys[b]``, ``values[b]``: [B, H, D]).

    When every index's steady zone is in one pool (a served layer's), the tokens go in with
    one write for the whole batch (:meth:`SteadyPool.write`) to ``rows`` (the step's, from
    the metadata builder) when they are these indexes' next rows, else to rows made here.
    Each index then accounts for its token (:meth:`WaveIndex.appended`: update blocks).
    Otherwise each index appends its own. Returns (update blocks landed, the rows written,
    or None). ``failed`` given: an index whose append raises is recorded there as (its
    position, the exception) and the others go on; else the first error is raised."""
    pool = indexes[0].steady
    # list comprehensions, not generators, here and below: one Python call for the batch
    # rather than one per row (this runs per layer at every step)
    if all([i.steady is pool for i in indexes]):
        key = tuple([(i.slot, i.num_tokens, i.num_sinks) for i in indexes])
        if rows is None or rows[0] != key:
            rows = plan_append(indexes, [i.num_tokens for i in indexes])
        pool.write(rows[1], rows[2], keys, values)
        return _each(indexes, None, failed), rows
    return _each(indexes, lambda b, i: i.append(keys[b, :, None], values[b, :, None]),
                 failed), None


def _each(indexes: list[WaveIndex], append: Any, failed: list[tuple[int, Exception]] | None
          ) -> int:
    """``append(b, index)`` for every index (None: ``index.appended(1)``, its token already
    written); update blocks landed. See :func:`append_batch` for ``failed``."""
    landed = 0
    for b, index in enumerate(indexes):
        try:
            landed += index.appended(1) if append is None else append(b, index)
        except Exception as exc:
            if failed is None:
                raise
            failed.append((b, exc))
    return landed


def decode_batch(indexes: list[WaveIndex], query: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, cache: MetaViewCache | None = None
                 ) -> torch.Tensor:
    """Tripartite decode of row ``b``'s query ``query[b]`` ([B, Hq, D]) over ``indexes[b]``:
    all rows in one fused call when every index supports the fused CPU kernel with its own
    scoring (:func:`fused_supported`: the wave index's centroids, Quest's page bounds), else
    all rows through one padded sequence of kernel calls
    (:func:`vllm_retro.index.padded.decode_padded`; ``cache``, held per layer by the caller,
    keeps its meta view across steps) when every index is a plain wave index, else row by
    row through :meth:`WaveIndex.decode` (baselines). Policies with a decode of their own
    (:attr:`WaveIndex.decode_own`: PQCache's :func:`~vllm_retro.index.pq_index.decode_pq`,
    RetrievalAttention's one fused kernel call on the CPU) take it first; policies that
    choose whole clusters for the batch (:attr:`WaveIndex.select_batch`: SAAP's classifier
    pass, Quest's and StreamingLLM's pages) read them through the fused kernel with the
    clusters given, or :func:`~vllm_retro.index.padded.decode_given`.

    Before all of these, a layer's plain wave indexes decode from device-resident KV when
    ``config.device_resident`` says so (:class:`~vllm_retro.index.resident.ResidentDecode`,
    held by ``cache``: on CUDA by default, while the copy fits the device).

    All indexes share one config and head layout (one layer of one model). Returns
    ``out`` ([B, Hq, D], query dtype; allocated when None).
    """
    if out is None:
        out = torch.empty_like(query)
    if not indexes:
        return out
    if faults.ENABLED:
        faults.check_any("kernel_row", (getattr(i.store, "request_id", None) for i in indexes))
    first = indexes[0]
    # one policy: every index has the batch-wide handlers and the zones of the first
    same = all([(i.decode_own, i.select_batch, i.selects_zones)
                == (first.decode_own, first.select_batch, first.selects_zones)
                for i in indexes])
    if same and first.decode_own is not None and first.decode_own(indexes, query, scale, out,
                                                                   cache):
        return out
    if same and cache is not None and cache.resident.applies(indexes, query):
        return cache.resident.decode(indexes, query, scale, out)
    if same and out.dtype == query.dtype and _fused_scoring(indexes, query, cache):
        tilted = first.selects_zones and first.config.tilted_estimation
        rows = [packed_row(i, tilted) for i in indexes]
        if cache is None:
            batch = cpu_decode.pack_batch(rows)
        else:  # the layer's batch of its last step, unless a row changed
            batch = cache.packed = cpu_decode.pack_batch(rows, cache.packed)
        cpu_decode.decode_packed(query, batch, scale, tilted, out=out,
                                 windows=[i.window_span() for i in indexes])
        return out
    if same and first.select_batch is not None:
        # clusters chosen by the policy for all rows (SAAP's trained router, StreamingLLM's
        # recent pages, Quest's page bounds off the CPU), then read and attended in one call
        ids, counts = first.select_batch(indexes, query, scale)
        if out.dtype == query.dtype and fused_batch(indexes, query):
            cpu_decode.decode_packed(
                query, [packed_row(i, False) for i in indexes], scale, False, out=out,
                windows=[i.window_span() for i in indexes],
                given=[ids[j, :, :n] for j, n in enumerate(counts)])
        else:
            decode_given(indexes, query, scale, out, ids, counts, cache)
        return out
    if all(padded_supported(i) for i in indexes):
        return decode_padded(indexes, query, scale, out, cache)
    for b, index in enumerate(indexes):
        out[b] = index.decode(query[b], scale).output.to(out.dtype)
    return out
