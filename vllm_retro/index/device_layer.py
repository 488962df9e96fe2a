"""One attention layer's wave indexes resident on the device, decoded by one fixed sequence of
tensor operations with no host synchronisation (the GPU decode step, KV on the device).

The regime where the context's KV fits the device (DESIGN.md, "offload only under memory
pressure"): every indexed token is read in place from device memory, so a step moves no
KV over PCIe and needs no cache policy. State is preallocated per layer, as vLLM's paged KV
and gpt-fast's in-place buffers are, in rows of ``R = slots x H`` (one per (request slot,
KV head)):

- ``keys``, ``values`` [slots * H, N_cap, D]: each row's indexed tokens, cluster-contiguous
  (cluster c of a row at ``starts[row, c]``, ``sizes[row, c]`` tokens); or, with
  ``in_place`` (the KV does not fit the device), the store's own pool [M, D] that the whole
  batch shares — a wave buffer's host tier, pinned, read over the bus — with ``starts``
  absolute rows of it;
- the meta rows: centroids, value sums (KV dtype), sizes (int32), spreads and deviates
  (fp32) — read in place from the attention layer's
  :class:`~vllm_retro.index.meta_pool.MetaPool` (``meta``: the pool the indexes keep them
  in, each in its extent; nothing copied); and the layer's own starts (int64, [slots * H,
  C_cap]: each cluster's first token row) and per row the tilted estimator's residual model
  (profile [D], key and value factors [D, rank], fp32);
- the steady zone (sinks and the window's ring) is read in place from the layer's shared
  :class:`~vllm_retro.index.steady.SteadyPool`, where the route's append writes it.

A :class:`DeviceLayer` mirrors the host-side :class:`WaveIndex` objects of the batch: a slot
is (re)loaded when its index's meta index changes (a block landing: every ``update_segment``
decoded tokens), never per token. Per step, the host builds a :class:`StepPlan` — the
batch's integers as one [8, B] int64 tensor, copied to the device without waiting — and
:func:`decode_step` runs the same sequence of operations whatever the data:

1. the rows' clusters scored in place in the meta pool (:func:`vllm_retro.kernels.pool_scores`:
   two Triton launches over (rows x cluster blocks) on CUDA), then each row's zones from
   its scores (:func:`vllm_retro.kernels.select_zones`: one launch, a radix select, no
   sort; ``r_max + e_max`` wide, static: the largest zones of the loaded indexes);
2. tripartite attention read in place (:func:`vllm_retro.kernels.resident_attention`: two
   Triton launches): the steady zone from the steady pool's ring, the retrieval zone's
   tokens from the cluster pool through the selected clusters' starts and sizes (a
   static width ``T_ret``, the most tokens any loaded row's retrieval zone can reach, so
   nothing is ever cut off), the estimated clusters from the meta pool, the tilted
   estimator's query terms from the rows' residual models.

Read in place, a layer may keep a cluster cache on the device
(:mod:`vllm_retro.kernels.cluster_cache`: the wave buffer's device cache, LRU over blocks of
clusters, its tables on the device): between the two steps one launch looks the retrieval
zone up, stamps its hits and admits its misses into the least recently used blocks, and the
attention reads hits there and writes admitted misses as it reads them over the bus.

On CUDA that is five launches per layer step (six with a cluster cache); on the CPU with the
'auto' backend the whole step is one call of the fused CPU kernel reading the same pools by
the same plan (:func:`~vllm_retro.kernels.cpu_decode.decode_plan`); the torch path (the
reference) spells the step out in plain operations, packing an execution buffer.

The baselines are strategies over the same pools. Quest scores its pages in step 1 by
their bounds (the layer's scoring rows twice the head dimension wide, ``[max, min]``,
against the query split by sign: one more launch), reads the top pages and estimates
nothing (:meth:`WaveIndex.zone_sizes`). Policies that choose each row's clusters
themselves (:attr:`WaveIndex.select_batch`: SAAP's router, StreamingLLM's recent pages)
decode with :func:`decode_given_step`: their choice is the retrieval zone, nothing scored,
so step 2 alone (the given clusters padded to the plan's static width, which
:meth:`DeviceLayer.plan` takes from the counts given).

Every shape depends only on the batch size and the layer's bounds (``C_live``, ``r_max``,
``e_max``, ``T_ret``, the steady width), which change only when a slot is loaded: a CUDA
graph captured per bound set replays the step. ``tests/index/test_device_layer.py`` runs
the step on CPU tensors under :class:`~vllm_retro.kernels.sync_check.SyncCheck` (no operation that
would wait for the device) and against the per-row reference :meth:`WaveIndex.decode`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import torch

from vllm_retro import kernels
from vllm_retro.config import RetroConfig
from vllm_retro.index.meta_pool import MetaPool
from vllm_retro.index.steady import SteadyPool
from vllm_retro.index.store import expand_runs
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.kernels import cpu_decode
from vllm_retro.kernels.cluster_cache import ClusterCache
from vllm_retro.kernels.resident_attention import LayerPools
from vllm_retro.kernels.step_plan import PLAN_FIELDS

CACHE_BLOCK_CLUSTERS = 1.25
"""A block of an in-place layer's cluster cache holds this many average clusters' tokens
(``cluster_size`` each; 20 at the default 16): most clusters whole, the largest' first
tokens. Measured on a real model's decode steps (``bench/cache_hits.py``, Qwen2.5-0.5B at
16K, cache 5% of the KV): token hit ratio 0.46 / 0.64 / 0.75 / 0.77 / 0.76 / 0.67 at blocks
of 8 / 12 / 16 / 20 / 24 / 32 tokens (small blocks cut clusters, large ones hold fewer)."""

_BUCKET = 64
"""Static widths (clusters scored, retrieval tokens) are rounded up to a multiple of this,
so a CUDA graph captured at one width serves many loads."""


def round_up(n: int, to: int = _BUCKET) -> int:
    """``n`` rounded up to a multiple of ``to`` (at least ``to``)."""
    return max(to, -(-n // to) * to)


@dataclass(frozen=True)
class StepPlan:
    """One step's integers for :func:`decode_step`, made before the step (by
    :meth:`DeviceLayer.plan`)."""

    ints: torch.Tensor
    """[len(PLAN_FIELDS), B] int64 (:data:`~vllm_retro.kernels.step_plan.PLAN_FIELDS`) on the
    layer's device, or pinned on the host (:meth:`DeviceLayer.plan` with ``upload=False``)."""
    steady: SteadyPool
    """The steady pool the batch's windows are in."""
    clusters: int
    """C_live: meta columns scored (>= every row's clusters; a multiple of 64)."""
    retrieval: int
    """r_max: ranking slots kept for the retrieval zone (>= every row's)."""
    estimation: int
    """e_max: ranking slots kept for the estimation zone (>= every row's)."""
    retrieval_tokens: int
    """T_ret: exact tokens the retrieval zone may read per row (>= every row's bound)."""
    steady_tokens: int
    """Steady-zone width of the step: the steady pool's rows per slot (sinks and ring), a
    bound on every row's sinks + window that never changes, so a decoding window does not
    change the step's shapes (a CUDA graph is captured again only when a slot loads)."""


def cache_block_size(cluster_size: int) -> int:
    """Tokens per block of an in-place layer's cluster cache (:data:`CACHE_BLOCK_CLUSTERS`
    average clusters)."""
    return max(1, round(CACHE_BLOCK_CLUSTERS * cluster_size))


def cache_blocks_for(config: RetroConfig, tokens: int, block_tokens: int) -> int:
    """Blocks per (slot, KV head) of an in-place layer's cluster cache for rows of at most
    ``tokens`` indexed tokens: the wave buffer's device cache budget
    (:meth:`RetroConfig.cache_tokens`) in blocks of ``block_tokens``; 0 for no cache."""
    return -(-config.cache_tokens(tokens) // block_tokens)


def readable_in_place(keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> bool:
    """True when kernels on ``device`` can read the pool (``keys``, ``values``) where it is:
    on ``device``, or pinned host memory for a CUDA device (read over the bus)."""
    if keys.device == device and values.device == device:
        return True
    return device.type == "cuda" and keys.device.type == values.device.type == "cpu" and \
        keys.is_pinned() and values.is_pinned()


@dataclass(frozen=True)
class _Loaded:
    """What a slot of a :class:`DeviceLayer` holds."""

    uid: int
    generation: int
    """The index's :attr:`WaveIndex.meta_generation` when loaded."""
    clusters: int
    head_tokens: torch.Tensor
    """[H] int64 (host) indexed tokens per KV head."""
    retrieval_bound: int
    """Most tokens any head's retrieval zone can read (its largest clusters)."""
    zones: tuple[int, int]
    """(retrieval, estimation) clusters at this meta index's ``clusters`` (the plan's
    columns, fixed until the next load)."""
    largest: np.ndarray
    """[clusters] int64: the most tokens any head's ``n + 1`` largest clusters hold (the
    bound of a retrieval zone of ``n + 1`` clusters chosen by the policy)."""
    source: int = 0
    """In place: the address of the keys pool the slot's starts point into (a store's pool,
    once replaced, keeps the rows laid out before: a slot stays valid until a load from
    the new pool moves the layer there, and every slot with it)."""


_STEADY_SLOT, _SINKS, _STEP = (PLAN_FIELDS.index(f) for f in ("steady_slot", "sinks", "step"))
"""The plan's rows a row gives at every step (:meth:`DeviceLayer.plan`: its steady slot,
sinks, ring start and window, the three last in a row from ``_SINKS``) and the step
counter's; the others change only when a slot loads or the meta rows move."""
assert PLAN_FIELDS[_SINKS:_SINKS + 3] == ("sinks", "ring_start", "window")

_MISSING = _Loaded(-1, -1, 0, torch.empty(0), 0, (0, 0), np.empty(0, dtype=np.int64))
"""What :meth:`DeviceLayer.all_loaded` reads for a slot that holds nothing (no index's)."""


class DeviceLayer:
    """The device-resident wave indexes of one attention layer (see the module docstring).

    ``slots`` requests at once, each with at most ``max_clusters`` clusters and
    ``max_tokens`` indexed tokens per KV head. Allocated once; a request gets a slot from
    its caller (the same slot numbering as the steady pool's is natural, not required).

    ``in_place``: hold only the meta pool; the retrieval zone's tokens are read where the
    indexes' store keeps them, one pool the whole batch shares (a wave buffer's host tier:
    pinned, so on CUDA the kernels read the selected tokens over the bus, zero-copy). For
    contexts whose KV does not fit the device: nothing is copied per request but the meta
    index, and ``max_tokens`` is not a bound (0 accepted). ``cache_blocks`` > 0 (in place
    only): a :class:`~vllm_retro.kernels.cluster_cache.ClusterCache` of that many blocks of
    ``cache_block_tokens`` tokens (None: :func:`cache_block_size` of the config's
    ``cluster_size``) per (slot, KV head) keeps recently retrieved clusters on the device
    (see :func:`cache_blocks_for`).

    ``score_dim``: the width of the rows the layer's policy scores clusters by
    (:meth:`WaveIndex.fused_scoring`; None: ``head_dim``, the centroids); twice
    ``head_dim`` for Quest's page bounds, scored with the query split into its positive and
    negative parts. ``tilted``: the estimation zone by the tilted estimator (None: the
    config's; False for policies that estimate nothing).

    ``meta``: the pool the layer's indexes keep their meta rows in (the attention layer's,
    on this device, :meth:`WaveIndex.adopt_meta`): the step reads them there, each
    request's at its extent, and a load copies none of them; every index loaded must be in
    it. ``scoring_field``: the pool's field the clusters are scored by
    (:attr:`WaveIndex.scoring_field`).
    """

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, slots: int,
                 max_clusters: int, max_tokens: int, rank: int, meta: MetaPool,
                 in_place: bool = False,
                 cache_blocks: int = 0, cache_block_tokens: int | None = None,
                 score_dim: int | None = None, tilted: bool | None = None,
                 scoring_field: str = "centroids"):
        if score_dim not in (None, head_dim, 2 * head_dim):
            raise ValueError(f"DeviceLayer: score_dim={score_dim}; accepted: head_dim "
                             f"({head_dim}, centroids) or twice it (page bounds)")
        for name, v in (("slots", slots), ("max_clusters", max_clusters),
                        ("max_tokens", max_tokens), ("rank", rank)):
            if v < (0 if in_place and name == "max_tokens" else 1):
                raise ValueError(f"DeviceLayer: {name}={v}; accepted: an integer >= 1")
        if cache_blocks and not in_place:
            raise ValueError(f"DeviceLayer: cache_blocks={cache_blocks} without in_place; "
                             "accepted: 0 (a copied layer reads every token on the device)")
        self.config = config
        self.num_kv_heads = h = num_kv_heads
        self.head_dim = d = head_dim
        self.dtype = dtype
        self.device = dev = torch.device(device)
        self.num_slots = slots
        self.max_clusters = c = max_clusters
        self.max_tokens = n = max_tokens
        self.in_place = in_place
        rows = slots * h
        f32 = torch.float32
        if in_place:  # the store's pool, set by each load (see _Loaded.source)
            self.keys = self.values = torch.empty(0, d, dtype=dtype)
        else:  # zero-filled: rows past a row's data are read (and masked) by the gathers
            self.keys = torch.zeros(rows, n, d, dtype=dtype, device=dev)
            self.values = torch.zeros(rows, n, d, dtype=dtype, device=dev)
        self.score_dim = score_dim or d
        """The width of the rows each cluster is scored by (the centroids, or Quest's page
        bounds)."""
        self.meta = meta
        self.scoring_field = scoring_field
        if meta.device != dev or meta.num_heads != h:
            raise ValueError(f"DeviceLayer: a meta pool of {meta.num_heads} heads on "
                             f"{meta.device}; accepted: {h} heads on {dev}")
        self.tilted = config.tilted_estimation if tilted is None else tilted
        inf = float("inf")
        self._sign_bounds = (torch.tensor([[0.0], [-inf]], dtype=dtype, device=dev),
                             torch.tensor([[inf], [0.0]], dtype=dtype, device=dev))
        """The clamp bounds of :meth:`split_by_sign` ([2, 1] each)."""
        self._absent = {"centroids": torch.zeros(1, self.score_dim, dtype=dtype, device=dev),
                        "value_sums": torch.zeros(1, d, dtype=dtype, device=dev),
                        "spreads": torch.zeros(1, dtype=f32, device=dev),
                        "deviates": torch.zeros(1, dtype=f32, device=dev)}
        """What the kernels are handed for a field the pool's policy keeps none of (never
        read: nothing is estimated, or nothing scored)."""
        self.starts = torch.zeros(rows, c, dtype=torch.int64, device=dev)
        self.profile = torch.zeros(rows, d, dtype=f32, device=dev)
        self.key_factor = torch.zeros(rows, d, rank, dtype=f32, device=dev)
        self.value_factor = torch.zeros(rows, d, rank, dtype=f32, device=dev)
        block = cache_block_tokens or cache_block_size(config.cluster_size)
        self.cache = ClusterCache.allocate(rows, c, cache_blocks, block, d, dtype,
                                           dev) if cache_blocks else None
        """In place: the retrieval clusters kept on the device (None: every retrieved token
        read over the bus)."""
        self.fused = cache_blocks == 0 and cpu_decode.fused_path(config.kernel_backend, dev)
        """The step is one call of the fused CPU kernel over the layer's pools
        (:func:`~vllm_retro.kernels.cpu_decode.decode_plan`): on the CPU with the 'auto'
        backend and the extension built, no cluster cache (on a CPU the host tier is the
        memory attention reads)."""
        self.steps = 0
        """Plans made (the cache's clock)."""
        self._loaded: dict[int, _Loaded] = {}
        """What each slot holds."""
        self._meta_starts: dict[int, int] = {}
        """Slot -> its index's first meta row (the plan's ``meta_row``), as read at the
        pool's generation :attr:`_meta_at` (rows moved since: read again)."""
        self._meta_at = -1
        self._loads = 0
        """Loads so far (a batch's plan columns are kept until the next)."""
        self._batch: tuple | None = None
        """(key, columns, widths) of the last batch planned (:meth:`_batch_columns`)."""
        self._pools: tuple | None = None
        """(the meta pool's storage count, the tensors they were made of, the
        :class:`LayerPools`) of the last :meth:`pools`."""
        self._widths: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}
        """(most clusters, largest retrieval bound, largest zones) of a batch -> its plan's
        static widths (clusters, retrieval, estimation, retrieval tokens)."""

    def split_by_sign(self, q: torch.Tensor) -> torch.Tensor:
        """``[q+, q-]`` ([R, G, 2D]) of ``q`` ([R, G, D]), as page bounds ``[max, min]`` are
        scored: one clamp of ``q`` seen twice against the bounds [(0, inf), (-inf, 0)]
        (made with the layer: nothing uploaded per step)."""
        lo, hi = self._sign_bounds
        if lo.dtype != q.dtype:
            lo, hi = lo.to(q.dtype), hi.to(q.dtype)
        r, g, d = q.shape
        return torch.clamp(q[:, :, None].expand(r, g, 2, d), lo, hi).view(r, g, 2 * d)

    # ------------------------------------------------------------------ host side
    def pools(self, steady: SteadyPool) -> LayerPools:
        """The layer's tensors with ``steady``'s, as the attention kernels take them (the
        meta rows: the meta pool's tensors as they are now)."""
        storage, made_of = self.meta.storage, (steady.k, steady.v, self.keys, self.values)
        held = self._pools
        if held is not None and held[0] == storage and \
                all([a is b for a, b in zip(held[1], made_of, strict=True)]):
            return held[2]
        t, absent = self.meta.tensors, self._absent
        meta = (t.get(self.scoring_field, absent["centroids"]),
                t.get("value_sums", absent["value_sums"]), t["sizes"],
                t.get("spreads", absent["spreads"]), t.get("deviates", absent["deviates"]))
        pools = LayerPools(self.keys, self.values, *meta[:3], self.starts, *meta[3:],
                           self.profile, self.key_factor, self.value_factor, steady.k,
                           steady.v, steady.sink_cap)
        self._pools = (storage, made_of, pools)
        return pools

    def meta_storage(self) -> int:
        """Which storage of the meta rows the step reads (a CUDA graph reads them by
        address): the meta pool's :attr:`~MetaPool.storage` count."""
        return self.meta.storage

    @staticmethod
    def footprint(slots: int, heads: int, head_dim: int, dtype: torch.dtype, clusters: int,
                  tokens: int, rank: int, in_place: bool = False, cache_blocks: int = 0,
                  cache_block_tokens: int = 0) -> int:
        """Device bytes a layer of these bounds allocates (its :meth:`nbytes`: not the meta
        rows, the meta pool's); with a cluster cache, ``cache_blocks`` of
        ``cache_block_tokens`` each (both given)."""
        if cache_blocks and cache_block_tokens < 1:
            raise ValueError(f"DeviceLayer.footprint: cache_block_tokens={cache_block_tokens} "
                             "with a cache; accepted: an integer >= 1")
        elem = torch.empty(0, dtype=dtype).element_size()
        kv = 0 if in_place else 2 * tokens * head_dim * elem
        # each cluster's first token row (int64), the residual model (fp32)
        per_row = kv + clusters * 8 + 4 * head_dim * (1 + 2 * rank)
        cache = ClusterCache.footprint(slots * heads, clusters, cache_blocks,
                                       cache_block_tokens, head_dim, dtype) if cache_blocks else 0
        return slots * heads * per_row + cache

    def nbytes(self) -> int:
        """Bytes held on the device (in place: no KV, the store's; no meta rows, the meta
        pool's)."""
        held = [] if self.in_place else [self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in (
            *held, self.starts, self.profile, self.key_factor, self.value_factor)) + \
            (self.cache.nbytes() if self.cache is not None else 0)

    def cache_tokens(self) -> tuple[int, int]:
        """Retrieval tokens read so far from the cluster cache and in place, over every slot
        (read from the device: for reports, not the step); (0, 0) without a cache."""
        if self.cache is None:
            return 0, 0
        read = self.cache.counts[:, :2].sum(0).tolist()
        return int(read[0]), int(read[1])

    def load(self, slot: int, index: WaveIndex) -> None:
        """Copy ``index``'s meta index, residual model and indexed KV (in place: where the
        store keeps each cluster) into ``slot``
        (host-side work when a request arrives or a block lands, not per step). When the
        slot already holds an earlier generation of the same index, only the clusters added
        since are copied (a wave index's meta index only grows: blocks append clusters),
        with the residual model, which every block refines. The index must fit the
        layer's bounds; its store must address its clusters as rows
        (:meth:`~vllm_retro.index.store.RowAddressedStore.cluster_rows`)."""
        h, c = self.num_kv_heads, index.num_clusters
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"DeviceLayer.load: slot={slot}; accepted: 0..{self.num_slots - 1}")
        if (index.num_kv_heads, index.head_dim) != (h, self.head_dim):
            raise ValueError(f"DeviceLayer.load: index has {index.num_kv_heads} x "
                             f"{index.head_dim} heads; the layer {h} x {self.head_dim}")
        if c > self.max_clusters:
            raise ValueError(f"DeviceLayer.load: {c} clusters; accepted: at most "
                             f"{self.max_clusters} (max_clusters)")
        if index.residuals.rank != self.key_factor.shape[2]:
            raise ValueError(f"DeviceLayer.load: residual rank {index.residuals.rank}; the "
                             f"layer's is {self.key_factor.shape[2]}")
        scoring = index.fused_scoring()[0] if index.kernel_scores else None
        if scoring is not None and scoring.shape[-1] != self.score_dim:
            raise ValueError(f"DeviceLayer.load: the index scores rows of width "
                             f"{scoring.shape[-1]}; the layer's are {self.score_dim} "
                             "(score_dim)")
        if index.kernel_scores and index.scoring_field != self.scoring_field:
            raise ValueError(f"DeviceLayer.load: the index scores its "
                             f"{index.scoring_field!r}; the layer reads {self.scoring_field!r}")
        sizes = index.sizes.long().cpu()
        prev = self._loaded.get(slot)
        same = prev is not None and prev.uid == index.uid and prev.clusters <= c
        # the store's (keys, values, starts, head_rows, mult), when anything is read from it
        rows_of = index.store.cluster_rows() if self.in_place or not same or \
            prev.clusters < c else None
        source = rows_of[0].data_ptr() if self.in_place else 0
        grow = same and prev.source == source
        first = prev.clusters if grow else 0
        held = prev.head_tokens if grow else torch.zeros(h, dtype=torch.int64)
        added = sizes[:, first:]
        tokens = held + added.sum(1)
        if not self.in_place and int(tokens.max()) > self.max_tokens:
            raise ValueError(f"DeviceLayer.load: {int(tokens.max())} indexed tokens per head; "
                             f"accepted: at most {self.max_tokens} (max_tokens)")
        if self.in_place:
            self._read_in_place(rows_of[0], rows_of[1])
        self._meta_row(index)  # (checks that the meta rows are in the layer's pool)
        rows = slice(slot * h, (slot + 1) * h)
        if not grow:
            self.starts[rows] = 0
            if self.cache is not None:  # another index, or its tokens moved: cached for none
                self.cache.clear_rows(rows)
        dev = self.device
        if c > first:
            keys, values, starts, head_rows, mult = rows_of
            new = slice(first, c)
            # each new cluster's first row in the store's pool
            src = starts[:, new].cpu() * mult + head_rows * torch.arange(h)[:, None]
            if self.in_place:  # the tokens stay where they are
                self.starts[rows, new] = src.to(dev)
            else:
                self._copy_tokens(slot, keys, values, src, added, held)
                self.starts[rows, new] = (held[:, None] + added.cumsum(1) - added).to(dev)
        res = index.residuals
        self.profile[rows] = res.profile.to(dev)
        self.key_factor[rows] = res.key_factor.to(dev)
        self.value_factor[rows] = res.value_factor.to(dev)
        zones = index.zone_sizes(c)
        # the most tokens any head's n largest clusters hold, for n = 1 .. c
        largest = sizes.sort(1, descending=True).values.cumsum(1).amax(0).numpy()
        bound = int(largest[zones[0] - 1]) if zones[0] else 0
        self._loaded[slot] = _Loaded(index.uid, index.meta_generation, c, tokens, bound,
                                     zones, largest, source)
        self._meta_starts.pop(slot, None)  # an extent grown or another index: read again
        self._loads += 1

    def _meta_row(self, index: WaveIndex) -> int:
        """The first row of ``index``'s meta rows (cluster 0 of head 0) in the meta rows the
        step reads: its extent's start in :attr:`meta`."""
        place = index.meta_place()
        if place is None or place[0] is not self.meta:
            raise ValueError("DeviceLayer: the index's meta rows are not in the layer's meta "
                             "pool (adopt_meta first)")
        return place[1]

    def _copy_tokens(self, slot: int, keys: torch.Tensor, values: torch.Tensor,
                     src: torch.Tensor, added: torch.Tensor, held: torch.Tensor) -> None:
        """Copy clusters (first rows ``src`` [H, n] in the store's pool, ``added`` [H, n]
        tokens each) into ``slot``'s rows after the ``held`` [H] tokens already there."""
        h = self.num_kv_heads
        idx, _, totals = expand_runs(src, added)
        for j in range(h):
            t0, t = int(held[j]), int(totals[j])
            take = idx[j, :t].to(keys.device)
            self.keys[slot * h + j, t0:t0 + t] = keys.index_select(0, take).to(
                self.device, self.dtype)
            self.values[slot * h + j, t0:t0 + t] = values.index_select(0, take).to(
                self.device, self.dtype)

    def _read_in_place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take the store's pool as the one the kernels read (in place)."""
        if keys.dim() != 2 or keys.shape[1] != self.head_dim or keys.dtype != self.dtype or \
                not keys.is_contiguous() or values.shape != keys.shape:
            raise ValueError(f"DeviceLayer.load in place: the store's pool is "
                             f"{tuple(keys.shape)} {keys.dtype}; accepted: contiguous "
                             f"[rows, {self.head_dim}] {self.dtype}")
        if not readable_in_place(keys, values, self.device):
            raise ValueError(f"DeviceLayer.load in place: the store's pool is on "
                             f"{keys.device}, unpinned; accepted: on {self.device}, or "
                             "pinned host memory for a CUDA layer")
        self.keys, self.values = keys, values

    def loaded(self, slot: int, index: WaveIndex) -> bool:
        """True when ``slot`` holds ``index``'s current meta index."""
        held = self._loaded.get(slot)
        return held is not None and (held.uid, held.generation) == (index.uid,
                                                                      index.meta_generation)

    def all_loaded(self, indexes: list[WaveIndex], slots: list[int] | None = None) -> bool:
        """:meth:`loaded` of every index in its slot (``slots[b]``; None: each index's own,
        :attr:`WaveIndex.slot`), in one call (asked per layer at every step)."""
        held, missing = self._loaded, _MISSING
        if slots is None:
            slots = [i.slot for i in indexes]
        return all([(held.get(s, missing).uid, held.get(s, missing).generation)
                    == (i.uid, i.meta_generation) for s, i in zip(slots, indexes, strict=True)])

    def release(self, slot: int) -> None:
        """Forget ``slot``'s index (its rows are overwritten by the next load)."""
        self._loaded.pop(slot, None)
        self._meta_starts.pop(slot, None)

    def refresh(self, slots: list[int], indexes: list[WaveIndex]) -> None:
        """(Re)load every slot whose index is not the one loaded there, or whose meta index
        changed since (then only what was added)."""
        for slot, index in zip(slots, indexes, strict=True):
            if not self.loaded(slot, index):
                self.load(slot, index)
        for _ in range(3 if self.in_place else 0):  # a load moved the layer to a new pool
            stale = [(s, i) for s, i in zip(slots, indexes, strict=True)
                     if self._loaded[s].source != self.keys.data_ptr()]
            if not stale:
                break
            for slot, index in stale:
                self.load(slot, index)
    def plan(self, slots: list[int], indexes: list[WaveIndex], upload: bool = True,
             given: list[int] | None = None, checked: bool = False) -> StepPlan:
        """The step's integers for ``indexes`` in ``slots`` (each loaded, see
        :meth:`refresh`), sharing one steady pool. What changes only when a slot loads or
        the meta rows move (slots, clusters, zones, meta rows, the static widths) is kept
        for the batch; per step a row adds its steady slot, sinks and window (one call
        each). ``upload``: one host->device copy, not waited for; else (for
        :class:`StepGraphs`, which copies them into its graph's own inputs) the integers
        stay on the host, pinned on CUDA.

        ``given``: the step's clusters are chosen by the policy (:func:`decode_given_step`),
        ``given[b]`` of them for row b (its retrieval zone; no estimation zone): the plan's
        retrieval width is then the most of them, rounded up. ``checked``: the caller found
        every slot loaded (:meth:`all_loaded`) and the steady zones in one pool this step;
        not asked again."""
        if not indexes:
            raise ValueError("DeviceLayer.plan: an empty batch")
        if given is not None and len(given) != len(indexes):
            raise ValueError(f"DeviceLayer.plan: {len(given)} given counts for a batch of "
                             f"{len(indexes)}")
        steady = indexes[0].steady
        if not checked and not self.all_loaded(indexes, slots):
            stale = next(s for s, i in zip(slots, indexes, strict=True)
                         if not self.loaded(s, i))
            raise ValueError(f"DeviceLayer.plan: slot {stale} does not hold this index's "
                             "current meta index (refresh first)")
        if not checked and not all([i.steady is steady for i in indexes]):
            raise ValueError("DeviceLayer.plan: the indexes' steady zones are in different "
                             "pools; a layer's decode needs them in one (adopt_steady)")
        key = (tuple(slots), self._loads, self.meta.generation,
               None if given is None else tuple(given))
        batch = self._batch
        if batch is None or batch[0] != key:
            batch = self._batch = (key, *self._batch_columns(slots, indexes, given))
        step = self.steps + 1
        cols = batch[1].copy()  # [fields, B]
        # (a flat buffer: numpy converts a list of tuples at ~1 us a row)
        per_step = np.frombuffer(array("q", [v for i in indexes for v in (
            i.slot, i.num_sinks, *i.window_span())]), dtype=np.int64).reshape(-1, 4)
        cols[_STEADY_SLOT] = per_step[:, 0]
        cols[_SINKS:_SINKS + 3] = per_step[:, 1:].T  # sinks, ring start, window
        cols[_STEP] = step
        ints = torch.from_numpy(cols)
        if self.device.type == "cuda":
            ints = ints.pin_memory()
            if upload:
                ints = ints.to(self.device, non_blocking=True)
        self.steps = step
        return StepPlan(ints, steady, *batch[2], steady.sink_cap + steady.ring)

    def _batch_columns(self, slots: list[int], indexes: list[WaveIndex],
                       given: list[int] | None) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        """:meth:`plan`'s columns that change only at a load or a move of the meta rows
        ([fields, B] int64; the per-step rows left 0) and the plan's static widths
        (clusters, retrieval, estimation, retrieval tokens)."""
        meta = self.meta
        stride = meta.capacity
        if self._meta_at != meta.generation:  # rows moved: read again
            self._meta_starts, self._meta_at = {}, meta.generation
        starts = self._meta_starts
        cols, held = [], []
        for b, (slot, index) in enumerate(zip(slots, indexes, strict=True)):
            x = self._loaded[slot]
            zones = x.zones if given is None else (min(given[b], x.clusters), 0)
            first = starts.get(slot)
            if first is None:
                first = starts[slot] = self._meta_row(index)
            cols.append((slot, 0, x.clusters, *zones, 0, 0, 0, 0, first, stride))
            held.append(x)
        source = self.keys.data_ptr()
        if self.in_place and any([x.source != source for x in held]):
            raise ValueError("DeviceLayer.plan: the batch's stores keep their tokens in "
                             "different pools; read in place, a layer's batch needs one")
        columns = np.array(cols, dtype=np.int64).T.copy()
        if given is not None:
            width = max(given)
            bound = max([int(x.largest[min(width, x.clusters) - 1]) if width and x.clusters
                         else 0 for x in held])
            return columns, (min(round_up(max([x.clusters for x in held])), self.max_clusters),
                             round_up(width), 0, round_up(bound))
        most = (max([x.clusters for x in held]), max([x.retrieval_bound for x in held]),
                max([x.zones[0] for x in held]), max([x.zones[1] for x in held]))
        widths = self._widths.get(most)
        if widths is None:
            # the zones at the rounded cluster count: stable while rows grow within it (a
            # graph per bound set), and at least every row's own
            c_live = min(round_up(most[0]), self.max_clusters)
            r, e = indexes[0].zone_sizes(c_live)
            widths = self._widths[most] = (c_live, max(r, most[2]), max(e, most[3]),
                                           round_up(most[1]))
        return columns, widths


def rank_clusters(layer: DeviceLayer, plan: StepPlan, q: torch.Tensor, scale: float,
                  pools: LayerPools | None = None) -> torch.Tensor:
    """Step 1 of :func:`decode_step`: the rows' first ``plan.clusters`` meta columns scored in
    place, then each row's zones chosen from its scores. q [R, G, D] (row r: request r // H,
    KV head r % H). Returns the zones [R, K] int64 cluster ids (K = retrieval + estimation
    bounds): row r's retrieval zone in ``[:n_ret]``, then its estimation zone, each in
    ascending id (:func:`vllm_retro.kernels.select_zones`: ties by cluster id, as on CPU).
    ``pools``: :meth:`DeviceLayer.pools` of the plan's steady pool (None: read here)."""
    backend = layer.config.kernel_backend
    pools = pools or layer.pools(plan.steady)
    if layer.score_dim != q.shape[-1]:  # page bounds: max by q+, min by q-
        q = layer.split_by_sign(q)
    scores = kernels.pool_scores(q, pools.centroids, pools.sizes, plan.ints, plan.clusters,
                                 scale, backend=backend)  # [R, C]
    return kernels.select_zones(scores, plan.ints, plan.retrieval, plan.estimation,
                                backend=backend)


def attend(layer: DeviceLayer, plan: StepPlan, q: torch.Tensor, top: torch.Tensor,
           scale: float, tilted: bool | None = None, pools: LayerPools | None = None
           ) -> torch.Tensor:
    """Step 2 of :func:`decode_step`: attention over the steady zone, the retrieved tokens
    and the estimated clusters of ranking ``top``, read in place — with a cluster cache,
    the retrieval zone looked up and admitted first (one more launch) and its hits read
    there. ``tilted``: the tilted estimator (None: the layer's); ``pools`` as for
    :func:`rank_clusters`. Returns [R, G, D]."""
    backend = layer.config.kernel_backend
    if tilted is None:
        tilted = layer.tilted
    pools = pools or layer.pools(plan.steady)
    runs = None
    if layer.cache is not None:
        runs = kernels.cache_lookup(layer.cache, pools.sizes, plan.ints, top, plan.retrieval,
                                    backend=backend)
    return kernels.resident_attention(
        q, pools, plan.ints, top, plan.steady_tokens + plan.retrieval_tokens,
        plan.retrieval, plan.estimation, scale, tilted=tilted,
        cache=layer.cache, runs=runs, backend=backend)


def _fused(layer: DeviceLayer, query: torch.Tensor, out: torch.Tensor | None) -> bool:
    """True when the step runs as one call of the fused CPU kernel (:attr:`DeviceLayer.fused`,
    the query and ``out`` in the layer's dtype)."""
    return layer.fused and query.dtype == layer.dtype and (out is None or out.dtype == query.dtype)


def decode_step(layer: DeviceLayer, plan: StepPlan, query: torch.Tensor, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Tripartite decode of ``query[b]`` ([B, Hq, D]) over the index in the plan's batch row
    b, for the whole batch, with no host synchronisation (see the module docstring):
    :func:`rank_clusters`, then :func:`attend`. Returns ``out`` ([B, Hq, D], query dtype;
    allocated when None). Equals :meth:`WaveIndex.decode` per row (fp32 1e-5; the same
    clusters, exact ties of scores included)."""
    if _fused(layer, query, out):
        return cpu_decode.decode_plan(query, layer.pools(plan.steady), plan.ints, scale,
                                      layer.tilted, out=out)
    q = query.reshape(query.shape[0] * layer.num_kv_heads, -1, layer.head_dim)
    pools = layer.pools(plan.steady)
    res = attend(layer, plan, q, rank_clusters(layer, plan, q, scale, pools), scale,
                 pools=pools)
    if out is None:
        return res.view(query.shape)
    out.copy_(res.view(out.shape))
    return out


def decode_given_step(layer: DeviceLayer, plan: StepPlan, query: torch.Tensor,
                      given: torch.Tensor, scale: float, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Exact attention of ``query[b]`` ([B, Hq, D]) over the steady zone of plan row b and
    the clusters its policy chose, ``given[b, :, :n_b]`` ([B, H, W] int64 on the layer's
    device, -1 padding past each row's count; ``n_b`` is the plan's retrieval column, from
    :meth:`DeviceLayer.plan` with ``given``): the device step for policies that choose
    their clusters themselves (:attr:`WaveIndex.select_batch`: SAAP's router,
    StreamingLLM's recent pages). No estimation zone, nothing scored: :func:`attend`
    on the given clusters (padded to the plan's retrieval width), so the same launches
    and no host synchronisation. Returns ``out`` ([B, Hq, D]; allocated when None). Equals
    :func:`~vllm_retro.index.padded.decode_given` (fp32 1e-5)."""
    r = query.shape[0] * layer.num_kv_heads
    w = given.shape[2]
    if w > plan.retrieval or plan.estimation:
        raise ValueError(f"decode_given_step: {w} given clusters per row for a plan of "
                         f"{plan.retrieval} retrieval and {plan.estimation} estimation slots; "
                         "accepted: a plan made with given counts")
    if _fused(layer, query, out):
        return cpu_decode.decode_plan(query, layer.pools(plan.steady), plan.ints, scale, False,
                                      given=given.contiguous(), out=out)
    top = given.reshape(r, w).clamp_min(0)  # past a row's count: never read
    if w < plan.retrieval:
        top = torch.nn.functional.pad(top, (0, plan.retrieval - w))
    q = query.reshape(r, -1, layer.head_dim)
    res = attend(layer, plan, q, top, scale, tilted=False)
    if out is None:
        return res.view(query.shape)
    out.copy_(res.view(out.shape))
    return out
