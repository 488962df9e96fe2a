"""Every knob of vllm-retro in one validated dataclass.

Defaults follow the RetroInfer paper (§5.1) and its public reference implementation. Every
field is checked on construction; a bad value raises :class:`ConfigError` naming the field,
the value and the accepted range.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KERNEL_BACKENDS = ("auto", "torch", "triton")
DEVICE_RESIDENT = ("auto", "on", "in_place", "off")
ESTIMATORS = ("tilted", "centroid", "auto")
CACHE_POLICIES = ("lru",)
INDEXES = ("wave", "pqcache", "saap", "graph", "quest", "streaming")


class ConfigError(ValueError):
    """A configuration value outside its accepted range."""


def _fail(name: str, value: Any, accepted: str) -> None:
    raise ConfigError(f"retro config: {name}={value!r} is invalid; accepted: {accepted}")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(name, value, f"an integer in [{lo}, {hi}]")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        _fail(name, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_saap_file(path: str | None, index: str) -> None:
    """SAAP's file, required with index='saap' (its type is :class:`SAAPConfig`'s check)."""
    if path is None:
        if index == "saap":
            _fail("saap_file", path, "the path of a file written by `vllm-retro calibrate "
                  "MODEL --out FILE` (required with index='saap')")
        return
    if index == "saap" and not os.path.isfile(os.path.expanduser(path)):
        _fail("saap_file", path, "an existing file written by `vllm-retro calibrate MODEL "
              "--out FILE` (no such file)")


@dataclass(frozen=True, slots=True)
class PQConfig:
    """PQCache (index='pqcache'; defaults from the PQCache paper, LongBench). Each field is
    the flag ``pq_<field>``."""

    subspaces: int = 2
    """Sub-spaces the head dimension is cut into (m; must divide head_dim)."""
    bits: int = 6
    """Bits per code (b): 2**b k-means codewords per sub-space, fitted at prefill."""
    token_ratio: float = 0.2
    """Tokens attended per decode step as a fraction of the context, steady zone included
    (the paper's 1/5); the rest of the budget is the top indexed tokens by
    product-quantised score. 1.0 attends every token (full attention)."""
    block_tokens: int = 128
    """Tokens per block of the device cache (consecutive positions; the paper's 128)."""

    def __post_init__(self) -> None:
        _check_int("pq_subspaces", self.subspaces, 1, 256)
        _check_int("pq_bits", self.bits, 1, 8)
        _check_float("pq_token_ratio", self.token_ratio, 0.0, 1.0, lo_open=True)
        _check_int("pq_block_tokens", self.block_tokens, 1, 1 << 16)


@dataclass(frozen=True, slots=True)
class SAAPConfig:
    """SAAP (index='saap'; Mazare et al., 2025). Each field is the flag ``saap_<field>``."""

    file: str | None = None
    """The file `vllm-retro calibrate MODEL --out FILE` trained for the served model (per
    layer and KV head: key centroids and the query classifier); required with
    index='saap'."""
    probes: int = 16
    """Buckets (l) each decode query visits, out of the file's C (256 by default) per
    (layer, KV head): every indexed token of those buckets is read exactly; l = C reads every
    token (full attention). Measured on Qwen2.5-0.5B (held-out text, 64-token window): l = 16
    reads 11% of the indexed keys and holds 52% of the attention beyond the window; 8 (the
    paper's l / C = 32 / 1024) 7% and 40%; 32, 19% and 66%."""

    def __post_init__(self) -> None:
        _check_int("saap_probes", self.probes, 1, 1 << 16)
        if self.file is not None and (not isinstance(self.file, str) or not self.file):
            _fail("saap_file", self.file, "a file path (a non-empty string)")


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """RetrievalAttention's graph index (index='graph'; Liu et al.). Each field is the flag
    ``graph_<field>``."""

    top_k: int = 100
    """Keys each query head retrieves per decode step by its graph search (the paper's
    top-100); a KV head reads its query heads' union exactly, with the steady zone. At least
    the indexed tokens: every token is read (full attention)."""
    search_ef: int = 128
    """Candidate pool of each decode search (at least top_k is used); larger finds more of
    the true top-k and scores more keys."""
    degree: int = 16
    """Out-edges per key from the query projection, and as many more from the connectivity
    enhancement (RoarGraph's M; 2 x 16 int32 per key and KV head)."""
    knn: int = 100
    """Exact nearest keys of each training (prefill) query linked at build (RoarGraph's
    N_q)."""
    train_queries: int = 4096
    """At most this many prefill queries (of all query heads of a KV head's group, evenly
    spaced) train each KV head's graph; the exact kNN costs this x context x head_dim per KV
    head."""
    block_tokens: int = 128
    """Tokens per block of the device cache (consecutive positions)."""

    def __post_init__(self) -> None:
        _check_int("graph_top_k", self.top_k, 1, 1 << 20)
        _check_int("graph_search_ef", self.search_ef, 1, 1 << 20)
        _check_int("graph_degree", self.degree, 2, 256)
        _check_int("graph_knn", self.knn, 2, 4096)
        _check_int("graph_train_queries", self.train_queries, 1, 1 << 22)
        _check_int("graph_block_tokens", self.block_tokens, 1, 1 << 16)


@dataclass(frozen=True, slots=True)
class PageConfig:
    """The page policies (index='quest' / 'streaming'; Quest, Tang et al. 2024;
    StreamingLLM). Flags: ``quest_page_size`` (:attr:`page_tokens`), ``quest_token_budget``
    (:attr:`quest_tokens`), ``streaming_tokens``."""

    page_tokens: int = 16
    """Quest and streaming: tokens per page, the unit read (Quest's 16)."""
    quest_tokens: int = 1024
    """Quest: indexed tokens read exactly per decode step and KV head, in whole pages, with
    the steady zone (the paper evaluates 256-4096). At least the context: full attention."""
    streaming_tokens: int = 1024
    """Streaming: the most recent indexed tokens read per decode step, in whole pages,
    beyond the sinks and the local window (StreamingLLM's cache is sinks + recent window)."""

    def __post_init__(self) -> None:
        _check_int("quest_page_size", self.page_tokens, 1, 1 << 16)
        _check_int("quest_token_budget", self.quest_tokens, 0, 1 << 30)
        _check_int("streaming_tokens", self.streaming_tokens, 0, 1 << 30)


GROUPS: dict[str, type] = {"pq": PQConfig, "saap": SAAPConfig, "graph": GraphConfig,
                           "pages": PageConfig}
""":class:`RetroConfig`'s policy groups: its attribute -> the group's class."""

FLAGS: dict[str, tuple[str, str]] = {
    **{f"{group}_{f.name}": (group, f.name) for group in ("pq", "saap", "graph")
       for f in dataclasses.fields(GROUPS[group])},
    "quest_page_size": ("pages", "page_tokens"),
    "quest_token_budget": ("pages", "quest_tokens"),
    "streaming_tokens": ("pages", "streaming_tokens"),
}
"""The flat name users set (an ``additional_config`` key, ``--retro-<name>``) of each group
field: flat name -> (group attribute, field)."""


@dataclass(frozen=True, slots=True, init=False)
class RetroConfig:
    """Configuration of the wave index and the wave buffer, and of the other policies in
    one group each (:attr:`pq`, :attr:`saap`, :attr:`graph`, :attr:`pages`).

    Token counts are in tokens, budgets are fractions of a (request, layer, KV head)'s clusters.
    Constructed from keyword arguments: the wave index's and buffer's fields by name, a
    group's fields by their flat names (:data:`FLAGS`, e.g. ``pq_bits=4``) or as a whole
    group (``pq=PQConfig(bits=4)``; flat names given with it override its fields).
    """

    enabled: bool = True
    """Serve decode through the wave index; ``False`` gives stock dense attention."""

    index: str = "wave"
    """Which index chooses the tokens a decode step reads: 'wave' (RetroInfer: clusters,
    retrieval and estimation zones), 'pqcache' (PQCache: product-quantised keys, the top
    tokens read exactly; see ``pq_*``), 'saap' (SAAP: trained key buckets and query router,
    see ``saap_*``), 'graph' (RetrievalAttention: a query-aware graph over the keys
    searched per decode query, see ``graph_*``), 'quest' (Quest: pages ranked by the
    bound of q.k from their keys' min and max, see ``quest_*``) or 'streaming'
    (StreamingLLM: sinks and the most recent tokens, see ``streaming_tokens``). The steady
    zone, wave buffer and metrics are shared."""

    # --- wave index: clustering -------------------------------------------------------------
    cluster_size: int = 16
    """Average tokens per centroid at prefill (one centroid per ``cluster_size`` tokens)."""
    segment_size: int = 8192
    """Prefill context is clustered in independent segments of this many tokens."""
    kmeans_iters: int = 10
    """Spherical k-means iterations per segment (at most)."""
    kmeans_tol: float = 0.01
    """Stop k-means early once a round moves at most this fraction of the keys (0: only when
    none moves, which gives exactly the clustering of all ``kmeans_iters`` rounds). At 0.01
    the Qwen capture's output errors match the full 10 rounds' within 0.2% (bench/README)."""

    # --- wave index: tripartite attention ---------------------------------------------------
    sink_tokens: int = 4
    """Steady zone: the first tokens of the context, always attended exactly."""
    local_window: int = 64
    """Steady zone: the most recent tokens, always attended exactly."""
    retrieval_budget: float = 0.018
    """Fraction of clusters (top by centroid score) whose tokens are attended exactly."""
    min_retrieval_clusters: int = 32
    """Floor on the retrieval zone, in clusters (~512 tokens at ``cluster_size`` 16): at
    short contexts ``retrieval_budget`` alone leaves too few exact tokens (5 clusters, ~80
    tokens at 4K) and the model loops on aggregation tasks (bench/README, "The 4K
    regression hunt", "A floor on the retrieval zone": 16 clusters gave full attention's
    score at 4K; "A retrieval floor of 32 clusters": 16 still lost aggregation prompts at
    16K, 32 closed it at 4K-16K). Binds up to ``min_retrieval_clusters / retrieval_budget``
    clusters (~28K tokens at the defaults), so longer contexts read exactly what they did.
    0: none."""
    estimation_budget: float = 0.232
    """Fraction of clusters (the next ones by score) estimated from centroid and value sum."""
    estimator: str = "tilted"
    """How an estimated cluster is weighted: 'tilted' corrects the centroid's weight and mean
    value for the spread of the cluster's keys (see ``vllm_retro.index.estimator``);
    'centroid' is the paper's size * exp(q.C / sqrt(d)), a lower bound of the true mass;
    'auto' chooses between the two per KV head when the index is built, by which comes closer
    to exact attention for the prompt's last queries
    (:mod:`vllm_retro.index.estimator_choice`; tilted where no queries are given)."""

    # --- wave index: decode-time updates ----------------------------------------------------
    update_segment: int = 1024
    """New tokens beyond the local window are clustered in blocks of this many tokens."""
    update_clusters: int = 64
    """Clusters made from each update block."""
    update_rounds_per_step: int = 1
    """k-means rounds of a due update block run per decode step (per layer), so clustering
    it never stalls one step; its tokens stay in the window, attended exactly, until its
    clusters land. 0 clusters the block within the step that completes it."""
    build_steps: int | None = None
    """Decode steps a request runs exactly on its paged KV while a background thread (a
    side stream on CUDA) builds its wave indexes; at the next step it switches to the index
    (waiting for the build only if it is not done by then) and its paged blocks are freed.
    Counted in the request's own steps, not in time, so its output never depends on load.
    Requests with at most this many tokens left to decode are never indexed. 0 builds
    inside the step that completes the prompt (on the critical path) and switches at once.
    None: 16 on CUDA, 0 on CPU, where the engine's threads already use every core and a
    background build slows the steps it overlaps (see :meth:`build_steps_on`)."""

    # --- the other policies' settings, one group each (flags stay flat: see FLAGS) --------
    pq: PQConfig = PQConfig()
    """PQCache's settings (index='pqcache'); flags ``pq_*``."""
    saap: SAAPConfig = SAAPConfig()
    """SAAP's settings (index='saap'); flags ``saap_*``."""
    graph: GraphConfig = GraphConfig()
    """RetrievalAttention's graph settings (index='graph'); flags ``graph_*``."""
    pages: PageConfig = PageConfig()
    """The page policies' settings (index='quest' / 'streaming'); flags ``quest_page_size``,
    ``quest_token_budget``, ``streaming_tokens``."""

    # --- wave buffer ------------------------------------------------------------------------
    page_size: int = 8
    """Tokens per page of the host tier."""
    cache_fraction: float = 0.05
    """Device cluster cache size (the device step reading a layer's KV in place from the
    host tier, :mod:`vllm_retro.kernels.cluster_cache`) as a fraction of the indexed KV
    (ignored if cache_pages set), and never less than the same multiple of the retrieval
    zone's floor (see :meth:`cache_tokens`)."""
    cache_pages: int | None = None
    """Device cluster cache size in pages of ``page_size`` tokens; overrides
    ``cache_fraction`` when set."""
    cache_policy: str = "lru"
    """Replacement policy of the device cluster cache: 'lru' (its only one; 'lfu' was the
    per-request host-side block cache's, removed)."""
    async_updates: bool = True
    """Lay blocks out in the host tier on a background CPU worker, off the decode critical
    path."""
    table_threads: int | None = None
    """Host threads for a layer step's table work on the batched host-tier path: every
    request's mapping-table lookup (one call, on the decode thread), the requests in
    parallel. None: on
    CUDA, half the CPUs this process may use, at most 8 (vLLM sets torch's own intra-op
    threads to 1 while serving on a GPU, so these are separate); 1 elsewhere, where the
    engine's threads already use every core (see :meth:`table_threads_on`)."""
    host_memory_gb: float | None = None
    """Host memory (GiB, all workers) that indexed requests may reserve for their host
    tiers. A request that does not fit waits in the queue until others finish; one that
    needs more than the whole budget decodes densely (see vllm_retro.vllm.host_budget).
    None: 80% of the memory available once the engine has loaded its weights and KV cache."""

    # --- Block-Attention (retro_blocks requests; Ma et al., seed 002) -----------------------
    block_cache_gb: float = 2.0
    """Host memory (GiB per worker) holding retrieved passages' KV by content, so that a
    passage a later Block-Attention request lists again is loaded (its keys moved to their
    new positions) instead of prefilled; least recently used passages go first. 0: every
    passage is prefilled. Pages are touched only as passages are cached."""
    block_recompute_tokens: int = 0
    """Tokens before a Block-Attention request's last block that attend to the whole prompt
    anyway (the passages' tail nearest the question, recomputed rather than loaded, and
    never cached): selective recompute for a model that was not block-fine-tuned, as
    CacheBlend's. 0: the paper's mask. Measured in bench/README.md ("Block-Attention")."""

    # --- execution --------------------------------------------------------------------------
    kernel_backend: str = "auto"
    """'triton' (CUDA), 'torch' (reference, any device) or 'auto' (triton on CUDA)."""
    device_resident: str = "auto"
    """Decode a layer by the device step (one fixed sequence of device operations per layer
    step, no host synchronisation, replayed from CUDA graphs; vllm_retro.index.device_layer)
    over a device-resident copy of its indexed KV or, read in place, over the wave buffer's
    pinned host tier: 'auto' on CUDA, copied while the copy fits the device's free memory,
    else in place (the meta index alone on the device), else the host tier and device block
    cache serve it; 'auto' on the CPU, in place from the host tier (one fused kernel call
    per layer step); 'on' (copied) and 'in_place' on any device (tests, benchmarks); 'off'
    never."""

    def __init__(self, **values: Any) -> None:
        groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for flat in [k for k in values if k in FLAGS]:
            group, name = FLAGS[flat]
            groups[group][name] = values.pop(flat)
        for f in dataclasses.fields(self):
            value = values.pop(f.name, f.default)
            if f.name in groups and groups[f.name]:
                base = value if isinstance(value, GROUPS[f.name]) else GROUPS[f.name]()
                value = dataclasses.replace(base, **groups[f.name])
            object.__setattr__(self, f.name, value)
        if values:
            raise TypeError(f"RetroConfig got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, sorted(values)))}")
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("enabled", "async_updates"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        _check_choice("index", self.index, INDEXES)
        for name, kind in GROUPS.items():  # each group checked its own fields
            if not isinstance(getattr(self, name), kind):
                _fail(name, getattr(self, name), f"a {kind.__name__}")
        _check_saap_file(self.saap.file, self.index)
        _check_int("cluster_size", self.cluster_size, 1, 4096)
        _check_int("segment_size", self.segment_size, 16, 1 << 20)
        if self.segment_size < self.cluster_size:
            _fail("segment_size", self.segment_size, f">= cluster_size ({self.cluster_size})")
        _check_int("kmeans_iters", self.kmeans_iters, 0, 100)
        _check_float("kmeans_tol", self.kmeans_tol, 0.0, 0.5)
        _check_int("sink_tokens", self.sink_tokens, 0, 1 << 16)
        _check_int("local_window", self.local_window, 1, 1 << 16)
        _check_float("retrieval_budget", self.retrieval_budget, 0.0, 1.0, lo_open=True)
        _check_int("min_retrieval_clusters", self.min_retrieval_clusters, 0, 1 << 20)
        _check_float("estimation_budget", self.estimation_budget, 0.0, 1.0)
        if self.retrieval_budget + self.estimation_budget > 1.0 + 1e-9:
            _fail(
                "estimation_budget",
                self.estimation_budget,
                f"[0, {1.0 - self.retrieval_budget:g}] so that retrieval_budget "
                f"({self.retrieval_budget:g}) + estimation_budget <= 1",
            )
        _check_choice("estimator", self.estimator, ESTIMATORS)
        _check_int("update_segment", self.update_segment, 16, 1 << 20)
        _check_int("update_clusters", self.update_clusters, 1, self.update_segment)
        _check_int("update_rounds_per_step", self.update_rounds_per_step, 0, 1000)
        if self.build_steps is not None:
            _check_int("build_steps", self.build_steps, 0, 1 << 16)
        _check_int("page_size", self.page_size, 1, 1024)
        _check_float("cache_fraction", self.cache_fraction, 0.0, 1.0)
        if self.cache_pages is not None:
            _check_int("cache_pages", self.cache_pages, 0, 1 << 40)
        _check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        if self.table_threads is not None:
            _check_int("table_threads", self.table_threads, 1, 1024)
        if self.host_memory_gb is not None:
            _check_float("host_memory_gb", self.host_memory_gb, 0.0, float(1 << 20),
                         lo_open=True)
        _check_float("block_cache_gb", self.block_cache_gb, 0.0, float(1 << 20))
        _check_int("block_recompute_tokens", self.block_recompute_tokens, 0, 1 << 24)
        _check_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        _check_choice("device_resident", self.device_resident, DEVICE_RESIDENT)

    def check_head_dim(self, head_dim: int, index: str | None = None) -> None:
        """Raise :class:`ConfigError` unless the settings fit a model of ``head_dim`` served
        with ``index`` (default: :attr:`index`): ``pq_subspaces`` must divide it for
        'pqcache'; for 'saap' the file must be a SAAP file for ``head_dim`` with at least
        ``saap_probes`` buckets."""
        if (index or self.index) == "pqcache" and head_dim % self.pq.subspaces:
            _fail("pq_subspaces", self.pq.subspaces,
                  f"a divisor of the model's head_dim {head_dim}")
        if (index or self.index) == "saap" and self.saap.file is not None:
            from vllm_retro.index.saap_model import load_saap  # reads the file once

            load_saap(self.saap.file).check_serving(None, head_dim, self.saap.probes)

    def build_steps_on(self, device_type: str) -> int:
        """``build_steps`` on a device type ('cuda', 'cpu', ...), the default resolved:
        measured on a 2-core CPU (Qwen2.5-0.5B, 3 x 4K prompts), building in the background
        for 16 steps lowered decode throughput to 0.67x of building in the step, at the
        same time to first token (bench/README)."""
        if self.build_steps is not None:
            return self.build_steps
        return 16 if device_type == "cuda" else 0

    def table_threads_on(self, device_type: str) -> int:
        """``table_threads`` on a device type ('cuda', 'cpu', ...), the default resolved
        (``bench/layer_lookup.py``: a layer's lookups for 8 requests at 128K took 1.4x less
        time on 2 threads than on 1, on a 2-core CPU)."""
        if self.table_threads is not None:
            return self.table_threads
        if device_type != "cuda":
            return 1
        return max(1, min(8, len(os.sched_getaffinity(0)) // 2))

    @property
    def tilted_estimation(self) -> bool:
        """The estimation zone carries the tilted estimator's terms ('tilted', and 'auto',
        whose centroid heads carry zero terms: see
        :meth:`vllm_retro.index.estimator.ResidualModel.set_tilted_heads`)."""
        return self.estimator != "centroid"

    @property
    def min_indexed_context(self) -> int:
        """Shortest context (tokens) that gets a wave index; shorter ones use dense attention."""
        return self.sink_tokens + self.local_window + self.update_segment

    def num_retrieval(self, num_clusters: int) -> int:
        """Clusters in the retrieval zone for ``num_clusters`` clusters: the top
        ``retrieval_budget`` of them, at least ``min_retrieval_clusters`` and one, at most
        all."""
        if num_clusters <= 0:
            return 0
        by_budget = math.ceil(self.retrieval_budget * num_clusters - 1e-9)
        return min(num_clusters, max(1, self.min_retrieval_clusters, by_budget))

    def num_estimation(self, num_clusters: int) -> int:
        """Clusters in the estimation zone for ``num_clusters`` clusters."""
        rest = num_clusters - self.num_retrieval(num_clusters)
        return max(0, min(rest, math.ceil(self.estimation_budget * num_clusters - 1e-9)))

    def cache_tokens(self, tokens: int) -> int:
        """The device step's cluster cache budget, in tokens, of one KV head with ``tokens`` indexed
        tokens: ``cache_pages`` pages when set; else ``cache_fraction`` of the tokens, but
        at least ``cache_fraction / retrieval_budget`` times the retrieval zone's floor
        (``min_retrieval_clusters`` clusters of ``cluster_size``), at most all of them.

        The paper sizes the cache against the retrieval zone it serves (5% of the KV for a
        1.8% zone: 2.8x). Below ~28K tokens the floor makes the zone larger than 1.8% of the
        KV, and a cache of 5% would then hold less than the zone (205 tokens at 4K against
        its 512), so the cache keeps that ratio to the zone instead (1423 tokens at the
        defaults); from where the floor stops binding on, it is ``cache_fraction``'s."""
        if self.cache_pages is not None:
            return self.cache_pages * self.page_size
        tokens = max(0, int(tokens))
        by_fraction = math.ceil(self.cache_fraction * tokens - 1e-9)
        if self.retrieval_budget <= 0:
            return by_fraction
        by_floor = math.ceil(self.cache_fraction / self.retrieval_budget
                             * self.min_retrieval_clusters * self.cluster_size - 1e-9)
        return max(by_fraction, min(tokens, by_floor))

    def replace(self, **changes: Any) -> RetroConfig:
        """A copy with ``changes`` applied (validated; flat names as :meth:`from_dict`'s, or
        whole groups)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def flat_names(cls) -> list[str]:
        """Every key :meth:`from_dict` accepts, in declaration order: the wave index's and
        buffer's fields, and each group's fields by their flat names (:data:`FLAGS`)."""
        flat_of = {(group, name): flat for flat, (group, name) in FLAGS.items()}
        names: list[str] = []
        for f in dataclasses.fields(cls):
            if f.name in GROUPS:
                names += [flat_of[f.name, g.name] for g in dataclasses.fields(GROUPS[f.name])]
            else:
                names.append(f.name)
        return names

    def get(self, flat: str) -> Any:
        """The value of the flat key ``flat`` (a :meth:`flat_names` entry)."""
        if flat in FLAGS:
            group, name = FLAGS[flat]
            return getattr(getattr(self, group), name)
        return getattr(self, flat)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> RetroConfig:
        """Build from a flat mapping (e.g. vLLM's ``additional_config["retro"]``, keys as
        :meth:`flat_names`); unknown keys fail."""
        values = dict(values or {})
        known = set(cls.flat_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"retro config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"accepted keys: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Every setting under its flat key (:meth:`flat_names`), as :meth:`from_dict` takes
        it."""
        return {name: self.get(name) for name in self.flat_names()}
