"""A layer's decode by the device step (:mod:`vllm_retro.index.device_layer`): when it
applies, and the :class:`DeviceLayer` it runs on, sized to the layer's batch and grown on
demand.

``RetroConfig.device_resident`` decides: 'auto' takes this path on CUDA while the layer's
resident copy fits the device's free memory, else, when the batch's tokens are in one pinned
host pool (a wave buffer's host tier), reads them there in place with only the meta index and
a cluster cache (the wave buffer's device cache budget, ``cache_fraction``) on the device
(checked when the layer grows); else the wave buffer's host tier and device cache
serve the layer (:func:`vllm_retro.index.padded.decode_padded`). On the CPU 'auto' reads a
batch whose tokens are in one host pool in place, with no cache, and the step is one call
of the fused CPU kernel (:attr:`DeviceLayer.fused`); other batches decode through the fused
kernel on each row's own tensors (:mod:`vllm_retro.index.batched`). 'on' copies on any device,
'in_place' reads in place on any device (tests, benchmarks), 'off' never. A request keeps its
steady-pool slot as its slot here, so the layer's tables are indexed the same way. The wave
index and Quest (their clusters scored on the device) decode by
:func:`~vllm_retro.index.device_layer.decode_step`; the policies that choose their clusters
for the batch (SAAP, StreamingLLM) choose them first, then decode by
:func:`~vllm_retro.index.device_layer.decode_given_step`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vllm_retro.index.device_graph import StepGraphs
from vllm_retro.index.device_layer import (
    DeviceLayer,
    cache_block_size,
    cache_blocks_for,
    readable_in_place,
    round_up,
)
from vllm_retro.index.meta_pool import MetaPool
from vllm_retro.index.wave_index import WaveIndex, common_meta_pool
from vllm_retro.kernels.cluster_cache import ClusterCache
from vllm_retro.kernels.cpu_decode import fused_path

GROWTH = 1.5
"""A grown layer holds this many times what its batch needs (fewer regrowths)."""
HEADROOM_BYTES = 2 << 30
"""Device memory left free after a resident layer grows under 'auto' (allocator slack,
activations of the next steps)."""


_CAPABLE: dict[tuple[type, type], bool] = {}
"""(index class, store class) -> :func:`resident_capable` (asked for every row of every
layer at every step; what it checks is fixed per class)."""


def resident_capable(index: WaveIndex) -> bool:
    """True when ``index`` can decode from a :class:`DeviceLayer`: its clusters scored there
    (:attr:`WaveIndex.kernel_scores`: the wave index's centroids, Quest's page bounds) or
    chosen by the policy for the whole batch (:attr:`WaveIndex.select_batch`: SAAP,
    StreamingLLM; read through :func:`~vllm_retro.index.device_layer.decode_given_step`),
    from a store that addresses its clusters as rows."""
    kinds = (type(index), type(index.store))
    capable = _CAPABLE.get(kinds)
    if capable is None:
        capable = _CAPABLE[kinds] = (index.kernel_scores or index.select_batch is not None) \
            and hasattr(index.store, "cluster_rows")
    return capable


def layer_kind(index: WaveIndex) -> tuple[int, bool]:
    """What a :class:`DeviceLayer` for ``index``'s policy holds: the width of the rows its
    clusters are scored by (:meth:`WaveIndex.fused_scoring`: the centroids, Quest's page
    bounds at twice the head dimension; the head dimension for policies choosing their
    clusters themselves), and whether it estimates by the tilted estimator."""
    width = index.fused_scoring()[0].shape[-1] if index.kernel_scores else index.head_dim
    return width, index.selects_zones and index.config.tilted_estimation


def layer_meta(indexes: list[WaveIndex], device: torch.device) -> MetaPool | None:
    """The meta pool every one of ``indexes`` keeps its meta rows in (the attention layer's),
    when it is on ``device``: a :class:`DeviceLayer` there reads them in place. None when
    they are not in one such pool (the device step does not serve the batch)."""
    common = common_meta_pool(indexes)
    return common[0] if common is not None and common[0].device == device else None


def in_place_capable(indexes: list[WaveIndex], device: torch.device) -> bool:
    """True when a :class:`DeviceLayer` on ``device`` can read these indexes' tokens in
    place: one pool holds them all, on ``device`` or, for CUDA, pinned in host memory.

    The stores are read without waiting for their update work. The update worker may swap
    a grown pool in at any time (a block landing, another request's layout, a store's room
    made after its layout), and a swap between two stores' reads shows one pool as two: the
    stores' layout generations tell, and then they are read again."""
    for _ in range(READS):
        before = [i.store.layout_generation for i in indexes]
        pools = [i.store.cluster_rows(wait=False)[:2] for i in indexes]
        if [i.store.layout_generation for i in indexes] != before:
            continue
        k, v = pools[0]
        return all(kk.data_ptr() == k.data_ptr() and vv.data_ptr() == v.data_ptr()
                   for kk, vv in pools) and readable_in_place(k, v, device)
    return False


READS = 8
"""Reads of a batch's pools at most while growths keep swapping them
(:func:`in_place_capable`); past them the batch is not read in place until it changes."""


def placement(copy_bytes: int, meta_bytes: int, free_bytes: int, in_place_ok: bool
              ) -> str | None:
    """Under 'auto', how a layer is held: 'copy' (its tokens copied to the device) when
    ``copy_bytes`` fit the ``free_bytes`` the layer may take, else 'in_place' (no token on the
    device: ``meta_bytes``, its tables and cluster cache; the tokens read where the store
    keeps them) when that fits and
    ``in_place_ok``, else None (the host tier's path serves the layer)."""
    if copy_bytes <= free_bytes:
        return "copy"
    if in_place_ok and meta_bytes <= free_bytes:
        return "in_place"
    return None


class ResidentDecode:
    """One layer's resident decode state (held by the layer's
    :class:`~vllm_retro.index.padded.MetaViewCache`)."""

    def __init__(self) -> None:
        self.layer: DeviceLayer | None = None
        self.graphs: StepGraphs | None = None
        self.counts = CacheCounts()
        """The layer's cluster cache counts on their way to the buffer's statistics."""
        self._checked: list[WaveIndex] | None = None
        """The batch :meth:`applies` last found loaded, slot for slot (its :meth:`decode`,
        next, then skips the refresh)."""
        self._fitted: tuple[WaveIndex, ...] | None = None
        """The batch last found to fit the layer (the same index objects in order):
        :meth:`applies` then only checks that its slots are loaded."""
        self._refused: tuple | None = None
        """The batch ((uid, meta generation) of each index) whose layer did not fit the
        device under 'auto': it decodes through the host tier without asking (or reading
        anything from the device) until the batch or one of its meta indexes changes."""

    def nbytes(self) -> int:
        """Device bytes held."""
        return self.layer.nbytes() if self.layer is not None else 0

    def clear(self) -> None:
        """Drop the layer and its graphs (its cache counts reported first)."""
        if self.layer is not None and self.layer.cache is not None:
            self.counts.report(self.layer.cache, wait=True)
        self.counts = CacheCounts(self.counts.stats)
        self.layer = self.graphs = self._checked = self._fitted = None

    def applies(self, indexes: list[WaveIndex], query: torch.Tensor) -> bool:
        """True when this batch decodes here (see the module docstring); grows the layer
        when it must and can."""
        self._checked = None
        first = indexes[0]
        lay = self.layer
        steady = first.steady
        batch = tuple(indexes)
        if batch == self._fitted and lay is not None and \
                all([i.steady is steady for i in indexes]) and lay.all_loaded(indexes):
            # the usual step: the batch this layer was found to fit (nothing an index
            # holds changes that, but its steady pool), every slot loaded: nothing to load,
            # nothing read from the device; decode's refresh is skipped
            self._checked = indexes
            return True
        self._fitted = None
        mode = first.config.device_resident
        if mode == "off" or (mode == "auto" and not query.is_cuda and
                             not fused_path(first.config.kernel_backend, query.device)):
            return False
        if not all([resident_capable(i) and i.steady is steady for i in indexes]):
            return False
        fits = lay is not None and lay.dtype == first.centroids.dtype and \
            lay.device == first.centroids.device and steady.num_slots <= lay.num_slots and \
            (lay.score_dim, lay.tilted) == layer_kind(first)
        if fits and lay.all_loaded(indexes):
            # (each was loaded from the meta rows' place, which an index keeps)
            self._checked, self._fitted = indexes, batch
            return True
        batch = tuple((i.uid, i.meta_generation) for i in indexes)
        if batch == self._refused:
            return False
        # a slot loads: its token count is read from the device (a load waits anyway)
        need = (first.steady.num_slots, max(i.num_clusters for i in indexes),
                max(int(i.sizes.sum(1).max()) if i.num_clusters else 0 for i in indexes))
        if fits and need[1] <= lay.max_clusters and (
                in_place_capable(indexes, lay.device) if lay.in_place
                else need[2] <= lay.max_tokens) and layer_meta(indexes, lay.device) is lay.meta:
            return True
        if self._grow(indexes, need, mode):
            return True
        self._refused = batch
        return False

    def _grow(self, indexes: list[WaveIndex], need: tuple[int, int, int], mode: str) -> bool:
        first, lay = indexes[0], self.layer
        held = (0, 0, 0) if lay is None else (lay.num_slots, lay.max_clusters, lay.max_tokens)
        slots = max(need[0], held[0])
        clusters = max(round_up(int(need[1] * GROWTH), 64), held[1])
        tokens = max(round_up(int(need[2] * GROWTH), 1024), held[2])
        dev, dtype = first.centroids.device, first.centroids.dtype
        h, d, rank = first.num_kv_heads, first.head_dim, first.residuals.rank
        in_place = mode == "in_place"
        if in_place and not in_place_capable(indexes, dev):
            return False
        block = cache_block_size(first.config.cluster_size)
        blocks = cache_blocks_for(first.config, tokens, block)
        score_dim, tilted = layer_kind(first)
        meta = layer_meta(indexes, dev)
        if meta is None:  # the layer reads the meta rows where the attention layer keeps them
            return False
        if mode == "auto" and dev.type == "cpu":
            # the host tier is the memory a CPU attends from: read in place, nothing cached
            in_place, blocks = True, 0
            if not in_place_capable(indexes, dev):
                return False
        elif mode == "auto":
            how = placement(
                DeviceLayer.footprint(slots, h, d, dtype, clusters, tokens, rank),
                DeviceLayer.footprint(slots, h, d, dtype, clusters, 0, rank, True, blocks,
                                      block),
                torch.cuda.mem_get_info(dev)[0] + self.nbytes() - HEADROOM_BYTES,
                in_place_capable(indexes, dev))
            if how is None:
                return False
            in_place = how == "in_place"
        self.clear()  # the old layer's memory first
        self.layer = DeviceLayer(first.config, h, d, dtype, dev, slots=slots,
                                 max_clusters=clusters, max_tokens=0 if in_place else tokens,
                                 rank=rank, meta=meta, in_place=in_place,
                                 cache_blocks=blocks if in_place else 0,
                                 cache_block_tokens=block, score_dim=score_dim,
                                 tilted=tilted, scoring_field=first.scoring_field)
        self.graphs = StepGraphs(self.layer)
        self._refused = None
        return True

    def decode(self, indexes: list[WaveIndex], query: torch.Tensor, scale: float,
               out: torch.Tensor) -> torch.Tensor:
        """Decode ``query[b]`` ([B, Hq, D]) over ``indexes[b]`` (after :meth:`applies`
        said yes) into ``out``."""
        assert self.layer is not None and self.graphs is not None
        slots = [i.slot for i in indexes]
        checked = self._checked is indexes  # applies found every slot loaded, one steady pool
        if not checked:
            self.layer.refresh(slots, indexes)
        self._checked = None
        first = indexes[0]
        given = counts = None
        if not first.kernel_scores:  # the policy chooses the clusters, no zones
            given, counts = first.select_batch(indexes, query, scale)
        # the graphs copy the plan's integers into their own inputs: no upload of its own
        plan = self.layer.plan(slots, indexes, upload=not query.is_cuda, given=counts,
                               checked=checked)
        if given is not None and given.shape[2] < plan.retrieval:
            # padded to the plan's width: one graph serves every count up to it
            given = torch.nn.functional.pad(given, (0, plan.retrieval - given.shape[2]),
                                            value=-1)
        self.graphs(plan, query, scale, given, out)
        # the wave buffer's counters (the server's metrics); a dense store has none
        stats = self.counts.stats = self.counts.stats or getattr(first.store, "stats", None)
        if stats is not None:
            stats.add(**{"device_step_in_place_rows" if self.layer.in_place
                         else "device_step_rows": len(indexes)})
        if self.layer.cache is not None:
            self.counts.report(self.layer.cache)
        return out


class CountSink(Protocol):
    """Where counts go: the wave buffer's ``BufferStats`` (``add(name=delta, ...)``)."""

    def add(self, **deltas: float) -> None: ...


class CacheCounts:
    """Moves an in-place layer's cluster cache counts (:attr:`ClusterCache.counts`, on the
    device) into the wave buffer's statistics (``device_cache_hit_clusters``,
    ``device_cache_miss_clusters``, ``hit_tokens``, ``miss_tokens``, ``host_to_device_bytes``:
    the server's device cache metrics)
    without waiting for the device: on CUDA each report takes the copy an earlier one
    started into pinned memory, once it has landed, and starts the next."""

    def __init__(self, stats: CountSink | None = None):
        self.stats = stats
        """Where the counts go (None: nowhere yet)."""
        self._host: torch.Tensor | None = None
        """The counts summed over the rows, [4] int64 on the host (pinned on CUDA)."""
        self._landed: Any = None
        """The CUDA event after the copy into ``_host`` (None: no copy in flight)."""
        self._reported = [0, 0, 0, 0]

    def report(self, cache: ClusterCache, wait: bool = False) -> None:
        """Add to :attr:`stats` what ``cache`` counted since the last report that landed
        (``wait``: everything so far, waiting for the device)."""
        summed = cache.counts.sum(0)
        if not summed.is_cuda or wait:
            self._add(summed.tolist(), cache)
            self._landed = None
            return
        if self._landed is not None:
            if not self._landed.query():
                return  # the last copy is still on its way
            self._add(self._host.tolist(), cache)
        if self._host is None:
            self._host = torch.empty(4, dtype=torch.int64, pin_memory=True)
        self._host.copy_(summed, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()

    def _add(self, now: list[int], cache: ClusterCache) -> None:
        d = [a - b for a, b in zip(now, self._reported, strict=True)]
        self._reported = now
        if self.stats is not None and any(d):
            row = 2 * cache.keys.shape[1] * cache.keys.element_size()
            self.stats.add(hit_tokens=d[0], miss_tokens=d[1], device_cache_hit_clusters=d[2],
                           device_cache_miss_clusters=d[3], host_to_device_bytes=d[1] * row)

