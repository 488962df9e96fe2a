"""The wave index of one (request, layer): meta index, steady zone, tripartite decode.

Token layout of a context of ``n`` tokens::

    [0, sink)                      steady zone: attention sinks, exact
    indexed blocks                 clustered (prefill: segmented; decode: update blocks),
                                   KV in a ClusterStore, centroids / value sums in the meta
    [window_start, n)              steady zone: the local window, exact; it grows by one
                                   token per decode step until ``local_window +
                                   update_segment`` tokens, when its oldest
                                   ``update_segment`` tokens are clustered and appended.

The steady zone's KV lives in a slot of a :class:`~vllm_retro.index.steady.SteadyPool`
(sinks, and the window as a ring: a block leaving it moves nothing); a standalone index has
a pool of its own, a served one shares its layer's (:meth:`WaveIndex.adopt_steady`), so
that one step's new tokens of every request are one write
(:func:`~vllm_retro.index.batched.append_batch`). Its meta rows (centroids, value sums, sizes,
...) live likewise in an extent of a :class:`~vllm_retro.index.meta_pool.MetaPool`: its own,
or its layer's once adopted (:meth:`WaveIndex.adopt_meta`).

A context shorter than ``config.min_indexed_context`` gets no clusters: every token is in
the steady zone and decode attention is exact (dense) until it grows long enough.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_retro import kernels
from vllm_retro.config import RetroConfig
from vllm_retro.growth import grown
from vllm_retro.index.clustering import Clusters, cluster_block_steps, run_steps
from vllm_retro.index.estimator import ResidualModel, expected_max_deviate
from vllm_retro.index.estimator_choice import JUDGE_QUERIES, choose_tilted_heads
from vllm_retro.index.meta_pool import FieldSpec, MetaPool, MetaRows
from vllm_retro.index.steady import SteadyPool, ring_size
from vllm_retro.index.store import ClusterStore, DenseClusterStore, SteadyParts


@dataclass(frozen=True)
class Selection:
    """The zones chosen for one decode query, per KV head."""

    retrieval_ids: torch.Tensor
    """[H, r] cluster ids read exactly (retrieval zone)."""
    estimation_ids: torch.Tensor
    """[H, e] cluster ids estimated from their centroid (estimation zone)."""


@dataclass(frozen=True)
class DecodeResult:
    """Output of one tripartite decode step."""

    output: torch.Tensor
    """[num_heads, D] attention output, query dtype."""
    lse: torch.Tensor
    """[num_heads] fp32 log of the (estimated) softmax denominator."""
    selection: Selection
    n_exact: torch.Tensor
    """[H] int64 tokens read exactly per KV head (steady + retrieval)."""
    exact_positions: torch.Tensor | None
    """[H, T] int64 absolute positions of the exactly-read tokens (-1 padding), if asked."""


_UIDS = itertools.count()
"""Source of :attr:`WaveIndex.uid` (unlike ``id()``, never reused within a process)."""


class GrowingRows:
    """A [H, capacity, ...] buffer filled along dim 1 up to :attr:`n`: appending a block of
    rows writes them in place, and a full buffer is replaced by one >= 1.5x as large (plus
    the caller's headroom), so a context of N rows is copied O(log N) times in all instead
    of at every block."""

    def __init__(self, empty: torch.Tensor):
        self.buf = empty
        self.n = 0

    def append(self, rows: torch.Tensor, headroom: int = 0) -> torch.Tensor:
        """Add ``rows`` ([H, c, ...]) after the filled ones; returns the filled view."""
        n, c = self.n, rows.shape[1]
        if n + c > self.buf.shape[1]:
            cap = grown(n + c + headroom, self.buf.shape[1])
            buf = self.buf.new_empty((self.buf.shape[0], cap, *self.buf.shape[2:]))
            buf[:, :n] = self.buf[:, :n]
            self.buf = buf
        self.buf[:, n:n + c] = rows
        self.n = n + c
        return self.buf[:, :self.n]

    def nbytes(self) -> int:
        """Bytes held (the whole capacity)."""
        return self.buf.numel() * self.buf.element_size()


class PhaseClock:
    """Adds the time since the previous mark to ``phases[name]`` (seconds), synchronising
    the device first on CUDA; does nothing without ``phases`` (the serving path)."""

    def __init__(self, phases: dict[str, float] | None, device: torch.device):
        self.phases = phases
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter() if phases is not None else 0.0

    def __call__(self, name: str) -> None:
        if self.phases is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


class WaveIndex:
    """Wave index of one request-layer, over ``num_kv_heads`` heads.

    Build with :meth:`build` from the prefill's post-RoPE keys and values; then call
    :meth:`decode` for each new query and :meth:`append` for each new token.

    A policy (subclass) says what it does differently by the capabilities below, set in the
    class that changes the behaviour; the batched decode and the update schedule read them,
    never the class.
    """

    clusters_in_rounds: ClassVar[bool] = True
    """An update block is clustered a k-means round per step (:meth:`_cluster_steps`);
    False: in one go by the policy's own :meth:`_cluster`."""
    lands_in_store: ClassVar[bool] = True
    """An update block goes to the store's asynchronous layout and joins the index one call
    later (:meth:`_advance_update`); False: the policy's own :meth:`_add_block` adds it at
    once."""
    selects_zones: ClassVar[bool] = True
    """Clusters are chosen by centroid scores into the retrieval and estimation zones
    (:meth:`select`): the rule the padded and device-resident decodes implement."""
    kernel_scores: ClassVar[bool] = True
    """The fused CPU kernel scores and selects this policy's clusters itself
    (:meth:`fused_scoring`)."""
    scoring_field: ClassVar[str] = "centroids"
    """The meta field :meth:`fused_scoring` scores (the device step reads it in the layer's
    meta pool)."""
    select_batch: ClassVar[Callable[..., tuple[torch.Tensor, list[int]]] | None] = None
    """The policy chooses whole clusters for all rows of a layer step before they are read:
    ``(indexes, query [B, Hq, D], scale) -> (ids [B, H, W] padded with -1, counts)``."""
    decode_own: ClassVar[Callable[..., bool] | None] = None
    """The policy's own decode of a layer's rows: ``(indexes, query [B, Hq, D], scale, out,
    cache) -> bool`` (False: it does not apply to this batch; the shared routes run)."""

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None):
        self.config = config
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = config.kernel_backend
        self.store: ClusterStore = store or DenseClusterStore(num_kv_heads, head_dim, dtype, device)
        self._new_meta(dtype, device)
        self.residuals = ResidualModel(num_kv_heads, head_dim, device)
        self._centroids_f32: torch.Tensor | None = None
        self.steady = SteadyPool(num_kv_heads, head_dim, config.sink_tokens,
                                 ring_size(config.local_window, config.update_segment),
                                 dtype, device)
        """The pool holding this index's steady zone (its own until :meth:`adopt_steady`)."""
        self.slot = 0
        """This index's slot in :attr:`steady`."""
        self._own_steady = True
        self.num_sinks = 0
        """Sink tokens (``min(sink_tokens, context)``)."""
        self.window_start = 0
        self.num_tokens = 0
        self.num_updates = 0
        self._pending: Generator[None, None, Clusters] | None = None
        """The update block being clustered a few rounds per step (its tokens are the
        window's first ``update_segment``), or None."""
        self._pending_block: tuple[torch.Tensor, torch.Tensor] | None = None
        """A copy of the pending block's keys and values ([H, update_segment, D] each)."""
        self._landing: Clusters | None = None
        """An update block clustered and handed to the store, whose clusters join the meta
        index (and whose tokens leave the window) once the store has taken it in."""
        self.uid = next(_UIDS)
        """Identifies this index for caches of batch views (never reused in the process)."""
        self.meta_generation = 0
        """Counts changes of the meta index (a block joining it, :meth:`free`): a batch view
        read at one generation stays valid until the next."""
        self._meta_nbytes: tuple[Any, int] = (None, 0)  # (what it was counted at, bytes)
        self.judged_queries = 0
        """Prompt queries that chose each head's estimator (``estimator='auto'``; 0: none
        given, every head tilted)."""
        self.fused_view: Any = None
        """The fused CPU kernel's packed view of this index and the layout generations it
        was read at (:func:`vllm_retro.index.batched.packed_row`), kept across steps; reset
        to None whenever the meta index (with it the store's layout) changes or the steady
        zone moves to another pool."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, keys: torch.Tensor, values: torch.Tensor, config: RetroConfig | None = None,
              store: ClusterStore | None = None, judge_queries: torch.Tensor | None = None,
              judge_scale: float | None = None, **options: Any) -> WaveIndex:
        """Index a prefilled context. keys, values: [H_kv, N, D] post-RoPE, same dtype/device.

        ``judge_queries`` ([Hq, T, D] post-RoPE, the prompt's last positions) and the softmax
        ``judge_scale`` (default ``D ** -0.5``) judge each head's estimator under
        ``estimator='auto'`` (:mod:`vllm_retro.index.estimator_choice`); other estimators
        ignore them. ``options`` go to the constructor of subclasses (e.g. a baseline's page
        size).
        """
        config = config or RetroConfig()
        h, n, d = keys.shape
        index = cls(config, h, d, keys.dtype, keys.device, store, **options)
        sink = min(config.sink_tokens, n)
        index.num_sinks = sink
        index.steady.write_sinks(index.slot, keys[:, :sink], values[:, :sink])
        index.num_tokens = n
        index.window_start = sink
        middle_end = n - config.local_window
        if n >= config.min_indexed_context and middle_end > sink:
            mk, mv = keys[:, sink:middle_end], values[:, sink:middle_end]
            clusters = index._cluster(mk, mv, update=False)
            index._add_block(mk, mv, sink, clusters)
            index.window_start = middle_end
            judge = judge_queries
            if config.estimator == "auto" and judge is not None and judge.shape[1]:
                scale = d ** -0.5 if judge_scale is None else judge_scale
                index.residuals.set_tilted_heads(
                    choose_tilted_heads(index, judge, mk, mv, clusters, scale))
                index.judged_queries = min(judge.shape[1], JUDGE_QUERIES)
        # the window: at most local_window + update_segment - 1 tokens here, within the ring
        ws = index.window_start
        index.steady.write_rows(index.slot, sink, ws, keys[:, ws:], values[:, ws:])
        return index

    # ------------------------------------------------------------------ steady zone
    @property
    def win_len(self) -> int:
        """Tokens in the local window."""
        return self.num_tokens - self.window_start

    @property
    def ring_start(self) -> int:
        """Ring row (of :meth:`SteadyPool.ring_view`) of the window's first token."""
        return (self.window_start - self.num_sinks) % self.steady.ring

    @property
    def sink_k(self) -> torch.Tensor:
        """[H, sinks, D] keys of the sinks (a strided view of the steady pool)."""
        return self.steady.sink_view(self.slot, self.num_sinks)[0]

    @property
    def sink_v(self) -> torch.Tensor:
        """[H, sinks, D] values of the sinks (a strided view of the steady pool)."""
        return self.steady.sink_view(self.slot, self.num_sinks)[1]

    def window_parts(self) -> SteadyParts:
        """The local window in order: one or two (keys, values) [H, n_i, D] views of the
        ring (two when it wraps)."""
        return self.steady.window_parts(self.slot, self.ring_start, self.win_len)

    def steady_parts(self) -> SteadyParts:
        """The steady zone in attention order: the sinks, then the window's pieces."""
        return [self.steady.sink_view(self.slot, self.num_sinks), *self.window_parts()]

    @property
    def win_k(self) -> torch.Tensor:
        """[H, n, D] keys of the local window (a copy: the ring may wrap)."""
        return torch.cat([k for k, _ in self.window_parts()], dim=1)

    @property
    def win_v(self) -> torch.Tensor:
        """[H, n, D] values of the local window (a copy: the ring may wrap)."""
        return torch.cat([v for _, v in self.window_parts()], dim=1)

    def window_span(self) -> tuple[int, int]:
        """(:attr:`ring_start`, :attr:`win_len`) in one call: where the window starts in its
        ring and how many tokens it holds (what the fused kernel takes per row and call)."""
        start = self.window_start
        return (start - self.num_sinks) % self.steady.ring, self.num_tokens - start

    def window_ring(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(keys, values, start, n): the window's ring [H, ring, D] (strided views of the
        steady pool), whose rows ``(start + i) % ring`` for ``i < n`` are the window."""
        rk, rv = self.steady.ring_view(self.slot)
        return rk, rv, self.ring_start, self.win_len

    def adopt_steady(self, pool: SteadyPool, slot: int) -> None:
        """Move the steady zone into ``slot`` of ``pool`` (a layer's shared pool, holding
        that slot; same shape), releasing the index's own pool."""
        if not pool.fits(self.num_kv_heads, self.head_dim, self.steady.dtype,
                         self.steady.device, self.steady.sink_cap, self.steady.ring):
            raise ValueError("adopt_steady: the pool's layout differs from this index's")
        pool.copy_slot(self.steady, self.slot, slot, self.num_sinks, self.ring_start,
                       self.win_len)
        if self._own_steady:
            self.steady.release()
        self.steady, self.slot, self._own_steady = pool, slot, False
        self.fused_view = None

    def _cluster(self, keys: torch.Tensor, values: torch.Tensor, update: bool) -> Clusters:
        """Cluster a block: the prefill's middle (segmented) or one decode update block."""
        return run_steps(self._cluster_steps(keys, values, update))

    def _cluster_steps(self, keys: torch.Tensor, values: torch.Tensor, update: bool
                       ) -> Generator[None, None, Clusters]:
        """:meth:`_cluster` a k-means round at a time (see :func:`cluster_block_steps`)."""
        cfg = self.config
        seg, per_seg = (keys.shape[1], [cfg.update_clusters]) if update else \
            (cfg.segment_size, None)
        return cluster_block_steps(keys, values, seg, per_seg, cfg.cluster_size,
                                   cfg.kmeans_iters, self.backend, cfg.kmeans_tol)

    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        positions = torch.arange(start, start + keys.shape[1], device=keys.device)
        self.store.append(keys, values, positions, clusters)
        self._add_meta(clusters)

    meta_kept: ClassVar[tuple[str, ...]] = ("centroids", "value_sums", "sizes", "spreads",
                                            "deviates")
    """The per-cluster rows this policy keeps, of those every index answers for (the
    properties :attr:`centroids` .. :attr:`deviates`; the others read empty)."""

    def meta_fields(self, dtype: torch.dtype) -> dict[str, FieldSpec]:
        """The per-cluster rows this policy keeps: name -> (trailing shape, dtype)."""
        return {name: spec for name, spec in self._base_fields(dtype).items()
                if name in self.meta_kept}

    def _base_fields(self, dtype: torch.dtype) -> dict[str, FieldSpec]:
        d = self.head_dim
        return {"centroids": ((d,), dtype), "value_sums": ((d,), dtype),
                "sizes": ((), torch.int32), "spreads": ((), torch.float32),
                "deviates": ((), torch.float32)}

    def _new_meta(self, dtype: torch.dtype, device: torch.device) -> None:
        """Empty meta index, in a :class:`MetaPool` of its own (until :meth:`adopt_meta`)."""
        h = self.num_kv_heads
        fields = self.meta_fields(dtype)
        base = self._base_fields(dtype)
        absent = {name: torch.empty(h, 0, *trail, dtype=dt, device=device)
                  for name, (trail, dt) in base.items() if name not in fields}
        self.meta_dtype = dtype
        """The dtype of the centroids and value sums (the KV's)."""
        self._meta_device = torch.device(device)
        self.meta_rows = MetaRows(MetaPool(h, fields, device), own=True, absent=absent)
        """The per-cluster rows (:attr:`centroids` .. :attr:`deviates` are views of them)."""

    def meta_pool_layout(self) -> tuple[int, dict[str, FieldSpec], torch.device]:
        """(heads, fields, device) of a pool that can hold this index's meta rows."""
        dtype, device = self.meta_dtype, self._meta_device
        return self.num_kv_heads, self.meta_fields(dtype), device

    def adopt_meta(self, pool: MetaPool) -> None:
        """Move the meta rows into ``pool`` (a layer's shared pool, of
        :meth:`meta_pool_layout`), releasing the index's own."""
        self.meta_rows.adopt(pool)
        self.fused_view = None

    def meta_place(self) -> tuple[MetaPool, int] | None:
        """(the layer's meta pool, the first row of this index's extent in it: 0 while it
        has no rows), or None while the index keeps its rows in a pool of its own."""
        start = self.meta_rows.shared_start()
        return None if start is None else (self.meta_rows.pool, start)

    @property
    def centroids(self) -> torch.Tensor:
        """[H, C, D] cluster centroids (the keys' dtype; a view of the meta pool)."""
        return self.meta_rows.view("centroids")

    @property
    def value_sums(self) -> torch.Tensor:
        """[H, C, D] per-cluster sums of the values (the values' dtype)."""
        return self.meta_rows.view("value_sums")

    @property
    def sizes(self) -> torch.Tensor:
        """[H, C] int32 tokens per cluster."""
        return self.meta_rows.view("sizes")

    @property
    def spreads(self) -> torch.Tensor:
        """[H, C] fp32 per-cluster key spread (the tilted estimator's)."""
        return self.meta_rows.view("spreads")

    @property
    def deviates(self) -> torch.Tensor:
        """[H, C] fp32 expected largest deviate of a cluster's size (the tilted
        estimator's)."""
        return self.meta_rows.view("deviates")

    def _add_meta(self, clusters: Clusters) -> None:
        """Append a block's clusters to the meta index (its KV is already in the store),
        in place: a growth leaves room for a few more update blocks."""
        self.fused_view = None
        self.meta_generation += 1
        self.meta_rows.append({"centroids": clusters.centroids, "value_sums": clusters.value_sums,
                           "sizes": clusters.sizes, "spreads": clusters.spreads.float(),
                           "deviates": expected_max_deviate(clusters.sizes)},
                          4 * self.config.update_clusters)
        self.residuals.add(clusters.key_sq, clusters.cross)

    def _own_meta_nbytes(self) -> int:
        """Bytes of the meta rows when their pool is this index's own (else 0: the layer
        counts its pool)."""
        return self.meta_rows.pool.nbytes() if self.meta_rows.own else 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Add decoded tokens. key, value: [H_kv, n, D] (n >= 1) post-RoPE.

        Once ``update_segment`` tokens lie beyond the local window, the oldest of them form
        an update block: clustered ``config.update_rounds_per_step`` k-means rounds per call
        (all at once when 0) while they stay in the window, attended exactly, and appended
        to the index when done. Returns True when a block was appended by this call.
        """
        n = key.shape[1]
        landed = False
        done = 0
        while done < n:  # in pieces that fit the ring (a catch-up may bring many tokens)
            c = min(n - done, self.steady.ring - self.win_len)
            assert c > 0, "the window fills the ring"
            self.steady.write_rows(self.slot, self.num_sinks, self.num_tokens,
                                   key[:, done:done + c], value[:, done:done + c])
            landed |= self.appended(c)
            done += c
        return landed

    def appended(self, n: int) -> bool:
        """Account for ``n`` tokens just written into the ring at positions
        ``num_tokens ..`` (by :meth:`append`, or for a whole batch at once by
        :func:`~vllm_retro.index.batched.append_batch`); runs the update-block work (see
        :meth:`append`) and returns True when a block landed. Leaves the window at most
        ``local_window + 2 * update_segment - 1`` tokens long, so the next token fits."""
        cfg = self.config
        self.num_tokens += n
        seg = cfg.update_segment
        # (most steps have no block in flight: the check is inlined, as this runs per row and
        # layer at every step)
        landed = (self._landing is not None or self._pending is not None) and \
            self._advance_update(cfg.update_rounds_per_step)
        while self.num_tokens - self.window_start >= cfg.local_window + seg:
            # decoding (fewer new tokens than a block) with room for the block to wait:
            # deferred; else (a block or more at once, rounds per step 0) clustered now
            room = (cfg.update_rounds_per_step > 0 and n < seg
                    and self.win_len < cfg.local_window + 2 * seg)
            if self._pending is None and self._landing is None:
                block = self._window_head(seg)
                self._pending_block = block
                self._pending = self._update_steps(*block)
                if room:
                    landed |= self._advance_update(cfg.update_rounds_per_step)
                    break
            elif room:
                break
            landed |= self._advance_update(None)
        return landed

    def _window_head(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies ([H, n, D] keys and values) of the window's oldest ``n`` tokens."""
        parts = self.steady.window_parts(self.slot, self.ring_start, n)
        if len(parts) == 1:
            return parts[0][0].clone(), parts[0][1].clone()
        return (torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1))

    def _update_steps(self, keys: torch.Tensor, values: torch.Tensor
                      ) -> Generator[None, None, Clusters]:
        """Cluster one update block a round at a time (see :meth:`append`); subclasses that
        cluster differently (baselines' ``_cluster``) do it in one go."""
        if not self.clusters_in_rounds:
            return self._cluster(keys, values, update=True)
        return (yield from self._cluster_steps(keys, values, update=True))

    @property
    def store_settling(self) -> bool:
        """True while an update block handed to the store has not joined the meta index:
        decoding must then not wait for the store (see :meth:`_advance_update`)."""
        return self._landing is not None

    def _advance_update(self, rounds: int | None) -> bool:
        """Advance the update block in flight; True when one landed.

        A block handed to the store at the previous call lands now: its clusters join the
        meta index and its tokens leave the window. Else up to ``rounds`` k-means rounds
        (None: all) run; when its clusters are ready the block goes to the store (whose
        layout work, on the wave buffer's worker, overlaps the rest of the step) and lands
        at the next call, or at once when ``rounds`` is None. Landing one call later on
        every store keeps outputs independent of how fast the worker is."""
        if self._landing is not None:
            return self._land()
        if self._pending is None:
            return False
        done = None
        try:
            for _ in range(rounds if rounds is not None else 1 << 30):
                next(self._pending)
        except StopIteration as stop:
            done = stop.value
        if done is None:
            return False
        self._pending = None
        seg = self.config.update_segment
        assert self._pending_block is not None
        bk, bv = self._pending_block  # copies: the store keeps them
        self._pending_block = None
        if not self.lands_in_store:  # baselines: in one go
            self._add_block(bk, bv, self.window_start, done)
            return self._drop_block()
        positions = torch.arange(self.window_start, self.window_start + seg, device=bk.device)
        self.store.append(bk, bv, positions, done)
        self._landing = done
        return self._land() if rounds is None else False

    def _land(self) -> bool:
        assert self._landing is not None
        self._add_meta(self._landing)
        self._landing = None
        return self._drop_block()

    def _drop_block(self) -> bool:
        """Remove the landed block's tokens from the front of the window (the ring's rows
        stay; the window starts later)."""
        self.window_start += self.config.update_segment
        self.num_updates += 1
        return True

    # ------------------------------------------------------------------ properties
    @property
    def num_clusters(self) -> int:
        """Clusters per KV head (empty ones included)."""
        return self.meta_rows.counts["sizes"]

    @property
    def num_steady(self) -> int:
        """Tokens in the steady zone (sinks + local window)."""
        return self.num_sinks + self.win_len

    @property
    def is_dense(self) -> bool:
        """True while no token is indexed (decode attention is exact)."""
        return self.num_clusters == 0

    def _scoring_centroids(self) -> torch.Tensor:
        """Centroids for cluster scoring. The torch path computes in fp32; for 16-bit
        centroids it keeps an fp32 copy (refreshed when clusters are added) rather than
        converting every centroid at every step."""
        if self.centroids.dtype == torch.float32 or kernels.resolve_backend(
                self.backend, self.centroids.device) == "triton":
            return self.centroids
        if self._centroids_f32 is None or self._centroids_f32.shape != self.centroids.shape:
            self._centroids_f32 = self.centroids.float()
        return self._centroids_f32

    def free(self) -> None:
        """Release the store's KV and the meta index (the index is unusable afterwards)."""
        self.store.free()
        self._pending = self._landing = self.fused_view = self._pending_block = None
        self.meta_generation += 1
        self.meta_rows.release()
        self._new_meta(self.meta_dtype, self._meta_device)
        if self._own_steady:
            self.steady.release()
        self.num_sinks = self.num_tokens = self.window_start = 0
        self.residuals = ResidualModel(self.num_kv_heads, self.head_dim, self.sizes.device)

    def steady_nbytes(self) -> int:
        """Bytes of the steady zone's own pool (0 in a shared pool: its owner counts it)."""
        return self.steady.nbytes() if self._own_steady else 0

    def meta_nbytes(self) -> int:
        """Bytes held for the meta index: the per-head residual model, and, while the meta
        rows' pool is the index's own, the pool (centroids, value sums, sizes, the tilted
        estimator's per-cluster spreads and deviates, with room for later blocks; a layer's
        shared pool is counted by its owner)."""
        # counted once per meta_generation (every change of these buffers bumps it) and
        # pool: the runtime's gauges ask every live index at every step
        at = (self.meta_generation, self.meta_rows.own)
        counted, nbytes = self._meta_nbytes
        if counted != at:
            nbytes = self.residuals.nbytes() + self._own_meta_nbytes()
            self._meta_nbytes = (at, nbytes)
        return nbytes

    # ------------------------------------------------------------------ decode
    def zone_sizes(self, clusters: int) -> tuple[int, int]:
        """(clusters read exactly, clusters estimated) per KV head of an index of
        ``clusters`` clusters per head, as :meth:`select` chooses; growing with
        ``clusters``."""
        return self.config.num_retrieval(clusters), self.config.num_estimation(clusters)

    def fused_scoring(self) -> tuple[torch.Tensor, int, int]:
        """What the fused CPU kernel (:func:`vllm_retro.index.batched.decode_row`) and the
        device step (:mod:`vllm_retro.index.device_layer`) score and how much they read:
        (scoring rows [H, C, D], the centroids; then :meth:`zone_sizes`)."""
        return self.centroids, *self.zone_sizes(self.num_clusters)

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        """Choose the retrieval and estimation clusters for a query [num_heads, D]."""
        h = self.num_kv_heads
        c = self.num_clusters
        r = self.config.num_retrieval(c)
        e = self.config.num_estimation(c)
        if c == 0:
            none = torch.empty(h, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        q = query.reshape(h, -1, self.head_dim)
        scores = kernels.cluster_scores(q, self._scoring_centroids(), self.sizes, scale,
                                        backend=self.backend)
        top = kernels.top_clusters(scores, r + e)
        return Selection(top[:, :r], top[:, r:])

    def decode(self, query: torch.Tensor, scale: float | None = None,
               selection: Selection | None = None, return_positions: bool = False,
               phases: dict[str, float] | None = None) -> DecodeResult:
        """Tripartite attention of one query over the whole context.

        query: [num_heads, D], num_heads a multiple of the KV heads (query head i uses KV
        head ``i // (num_heads // H_kv)``). ``selection`` overrides the cluster choice.
        ``phases``, when given, accumulates the seconds spent in each phase of the step
        (``select``: scoring + top-k; ``gather``: mapping-table lookup, execution-buffer
        assembly, update submission; ``estimator``: the tilted estimator's query terms;
        ``attention``; ``bookkeeping``: joining the cache update and its admissions), with a
        device synchronisation at each boundary (for benchmarks, not serving).
        """
        h, d = self.num_kv_heads, self.head_dim
        scale = d ** -0.5 if scale is None else scale
        mark = PhaseClock(phases, query.device)
        sel = selection or self.select(query, scale)
        mark("select")
        k_exact, v_exact, rpos, n_exact = self.store.gather(sel.retrieval_ids,
                                                            self.steady_parts())
        mark("gather")
        n_est = torch.full((h,), sel.estimation_ids.shape[1], dtype=torch.int64,
                           device=query.device)
        q = query.reshape(h, -1, d)
        tilt = None
        if self.config.tilted_estimation and sel.estimation_ids.shape[1]:
            qvar, vshift = self.residuals.query_terms(q, scale)
            tilt = kernels.TiltTerms(self.spreads, self.deviates, qvar, vshift)
        mark("estimator")
        out, lse = kernels.tripartite_decode(
            q, k_exact, v_exact, n_exact, self.centroids, self.value_sums, self.sizes,
            sel.estimation_ids, n_est, scale, tilt, backend=self.backend,
        )
        mark("attention")
        mark("bookkeeping")
        positions = None
        if return_positions:
            steady_pos = torch.cat([
                torch.arange(self.num_sinks, device=query.device),
                torch.arange(self.window_start, self.num_tokens, device=query.device),
            ])
            positions = torch.cat([steady_pos[None, :].expand(h, -1), rpos], dim=1)
        return DecodeResult(out.reshape(-1, d), lse.reshape(-1), sel, n_exact, positions)

    def zone_stats(self, sel: Selection, n_exact: torch.Tensor) -> dict:
        """Token accounting of one decode step (see :func:`vllm_retro.index.sparse_attention`)."""
        n = max(self.num_tokens, 1)
        est_sizes = torch.gather(self.sizes, 1, sel.estimation_ids)  # [H, e]
        return {
            "n_tokens": self.num_tokens,
            "dense": self.is_dense,
            "n_clusters": self.num_clusters,
            "n_steady": self.num_steady,
            "n_retrieval_clusters": int(sel.retrieval_ids.shape[1]),
            "n_estimated_clusters": int(sel.estimation_ids.shape[1]),
            "n_exact": [int(x) for x in n_exact.tolist()],
            "exact_token_fraction": float(n_exact.double().mean().item()) / n,
            "estimated_token_fraction": float(est_sizes.sum(1).double().mean().item()) / n,
        }


def common_meta_pool(indexes: list[WaveIndex]) -> tuple[MetaPool, list[int]] | None:
    """(the layer meta pool every one of ``indexes`` keeps its meta rows in, the first row
    of each one's extent there), or None when they are not all in one layer pool."""
    places = [i.meta_place() for i in indexes]
    pool = places[0][0] if places[0] is not None else None
    if pool is None or any(p is None or p[0] is not pool for p in places):
        return None
    return pool, [start for _, start in places]
