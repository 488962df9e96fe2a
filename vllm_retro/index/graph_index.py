"""RetrievalAttention's graph index as a serving index (Liu et al., ``../shared/seeds/000``).

At prefill the indexed keys (between the sinks and the local window) of every KV head get a
query-aware proximity graph (:mod:`vllm_retro.index.graph`): the prefill's queries, passed to
:meth:`GraphIndex.build` as ``queries=``, are linked to their exact nearest keys by inner
product and those links are projected onto the keys (RoarGraph), with RoarGraph's
connectivity enhancement; keys are related to keys by cosine (unit-length keys: with raw
inner products the occlusion rule and the key-to-key searches favour large-norm keys and
left 31-39% of Qwen2.5's layer 2/8 keys with no in-edge at all). Without queries the graph is
trained on the keys themselves (the paper's off-the-shelf key-to-key graph, which its OOD
analysis shows is worse).

**GQA.** One graph per KV head, trained on the pooled prefill queries of all the query heads
of its group (the paper builds one per query head, G times the memory; on the Qwen capture
the pooled graph's recall was the higher of the two in every layer). Each decode step,
every query head runs its own best-first search (pool ``graph_search_ef``) on its KV head's
graph for its top ``graph_top_k`` keys by ``q . k`` — the paper's per-head retrieval — and
the KV head reads the union of its group's results exactly (each query head attends over a
superset of its own top-k), merged with the steady zone through one softmax (the paper's
CPU/GPU partial-attention merge is that softmax computed in two parts). With
:meth:`GraphIndex.set_token_budget` (matched-budget comparisons) each query head searches
for the top ``budget`` keys and the KV head reads the ``budget`` of the union ranked by the
group's summed softmax. There is no estimation zone.

**Decoded tokens** join the local window; each update block of ``update_segment`` tokens
that leaves it is inserted into the graph node by node (RoarGraph's connectivity step: a
search with the key itself, the rule, edges back) — the paper keeps decoded tokens in the
static pattern and names RoarGraph's insertion as the way to index them.

**Layout** as PQCache's (:mod:`vllm_retro.index.pq_index`): the KV is in the store (the wave
buffer's host tier), cut into blocks of ``graph_block_tokens``
consecutive positions, each a 'cluster' of the store; the chosen tokens are read one by one
(:meth:`~vllm_retro.index.store.DenseClusterStore.gather_tokens_into`). The graph
(``[H, N, 2 * graph_degree]`` int32) and the searches live on the CPU, reading the keys in
place from the store's pool (:mod:`vllm_retro.kernels.graph_cpu`), as the paper's CPU-side
vector search does.

**Decode paths.** On the CPU (kernel backend 'auto') one fused kernel call per layer step
(:func:`decode_graph`, through :func:`vllm_retro.index.batched.decode_batch`) runs every
(request, KV head) in parallel: its query heads' searches, the group's choice and the exact
attention over the steady zone and the chosen tokens, read in place from the store's pools
(the host tier). Elsewhere (CUDA, or the
'torch' backend) a request's step searches in C++ (:meth:`GraphIndex.select_tokens`), reads
the chosen tokens from the store's host tier and attends with the tripartite kernel, row by row.
"""

from __future__ import annotations

import time

import torch

from vllm_retro import kernels
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.graph import (
    GraphSpec,
    build_graphs,
    build_inputs,
    insert_nodes,
    inverse_norms,
    merge_group,
    search_graphs,
)
from vllm_retro.index.store import ClusterStore, fill_steady
from vllm_retro.index.token_index import TokenIndex
from vllm_retro.index.wave_index import DecodeResult, GrowingRows, PhaseClock, Selection
from vllm_retro.kernels import graph_cpu

BUILD_EF = 64
"""Pool of the key-to-key searches that link each key at build and insertion (RoarGraph's
L; 32 and 128 moved recall on the Qwen capture by about +-0.01)."""

NUM_ENTRIES = 1
"""Entry nodes per graph (RoarGraph's single one, the key nearest the keys' mean; adding the
training queries' most frequent top-1 keys changed nothing measurable)."""


class GraphIndex(TokenIndex):
    """The RetrievalAttention index of one (request, layer); see the module docstring.
    Build with ``GraphIndex.build(keys, values, config, store=..., queries=q)``, q the
    prefill's post-RoPE queries ([Hq, T, D], e.g. its last chunk's; None: keys as queries),
    then :meth:`decode` and :meth:`append` as a :class:`WaveIndex`."""

    @staticmethod
    def decode_own(indexes: list[GraphIndex], query: torch.Tensor, scale: float,
                   out: torch.Tensor, cache: object) -> bool:
        """See :attr:`WaveIndex.decode_own`: search, choose and attend in one fused kernel
        call (:func:`decode_graph`) when every row can (:meth:`fused`: on the CPU)."""
        if not all(i.fused(query) for i in indexes):
            return False
        decode_graph(indexes, query, scale, out)
        return True

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None,
                 queries: torch.Tensor | None = None, per_query_head: bool = False):
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store,
                         config.graph.block_tokens)
        if queries is not None and (queries.dim() != 3 or queries.shape[2] != head_dim
                                    or queries.shape[0] % num_kv_heads):
            raise ValueError(f"queries of shape {tuple(queries.shape)}; accepted: [num_heads, "
                             f"tokens, {head_dim}], num_heads a multiple of {num_kv_heads}")
        self.queries = queries
        """The prefill queries training the graph (dropped once it is built)."""
        self.per_query_head = per_query_head and queries is not None
        """One graph per query head (the paper's choice) instead of one per KV head."""
        self.spec: GraphSpec | None = None
        self.adj = GrowingRows(torch.empty(0, 0, 1, dtype=torch.int32))
        """[G, N, W] int32 adjacency of the graphs (CPU), in a buffer with room to grow."""
        self.entries = torch.zeros(0, 1, dtype=torch.int64)
        """[G, E] entry nodes of each graph."""
        self._inv = GrowingRows(torch.empty(num_kv_heads, 0))
        """[H, N] fp32 1 / |k| of the indexed keys (CPU): keys relate to keys by cosine."""
        self._rows: tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.build_seconds = 0.0
        """Seconds spent building and extending the graphs (kNN, projection, insertion)."""
        self.trained_on = ""
        """What trained the graphs: 'queries' (the prefill's), 'keys' (none were given), or
        '' before the build."""

    # ------------------------------------------------------------------ blocks
    # (set_token_budget: each query head searches for the top ``tokens`` keys and the KV
    # head reads that many of the union, ranked by the group's summed softmax)
    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        n_old = self.num_indexed
        super()._add_block(keys, values, start, clusters)
        t0 = time.perf_counter()
        cfg = self.config
        inv = self._inv.append(inverse_norms(keys).cpu(), headroom=4 * cfg.update_segment)
        if self.spec is None:
            self._build_graphs(keys, inv)
        else:
            n = self.num_indexed
            w = self.adj.buf.shape[2]
            grown = torch.full((self.adj.buf.shape[0], n - n_old, w), -1, dtype=torch.int32)
            self.adj.append(grown, headroom=4 * cfg.update_segment)
            pool, rows = self._key_rows()
            insert_nodes(self.adj.buf, pool, rows, self.spec.graph_head, self.entries, n_old,
                         cfg.graph.degree, BUILD_EF, inv)
        self.build_seconds += time.perf_counter() - t0

    def _build_graphs(self, keys: torch.Tensor, inv: torch.Tensor) -> None:
        """The prefill block's graphs from ``keys`` [H, M, D] and :attr:`queries`."""
        cfg = self.config
        h, m, d = keys.shape
        hq = self.queries.shape[0] if self.queries is not None else h
        spec = GraphSpec.make(h, hq, self.per_query_head)
        queries = None if self.queries is None else self.queries.to(keys.device)
        knn, entries = build_inputs(keys, queries, spec, cfg.graph.knn,
                                    cfg.graph.train_queries, NUM_ENTRIES)
        pool = keys.detach().to("cpu").reshape(h * m, d)
        rows = torch.arange(h * m).reshape(h, m)
        adj = build_graphs(pool, rows, knn, spec.graph_head, entries, cfg.graph.degree,
                           BUILD_EF, inv)
        self.adj = GrowingRows(adj[:, :0])
        self.adj.append(adj, headroom=4 * cfg.update_segment)
        self.trained_on = "keys" if self.queries is None else "queries"
        self.spec, self.entries, self.queries = spec, entries, None

    def token_pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [R, D], values [R, D] on the CPU, rows [H, N] int64): indexed token i of KV
        head h is row ``rows[h, i]`` of the store's pools; refreshed when the store's layout
        or the indexed tokens change."""
        st = self.store
        key = (getattr(st, "layout_generation", 0), self.num_indexed)
        if self._rows is None or self._rows[0] != key:
            h = self.num_kv_heads
            if self.num_indexed == 0:
                empty = torch.zeros(0, self.head_dim, dtype=self.sink_k.dtype)
                self._rows = (key, empty, empty, torch.zeros(h, 0, dtype=torch.int64))
                return self._rows[1], self._rows[2], self._rows[3]
            keys, values, starts, head_rows, mult = st.cluster_rows()  # type: ignore[attr-defined]
            cluster = torch.from_numpy(self.token_cluster)
            rows = (head_rows * torch.arange(h)[:, None] + starts[:, cluster].long() * mult
                    + torch.from_numpy(self.token_offset)[None])
            self._rows = (key, keys.cpu(), values.cpu(), rows.contiguous())
        return self._rows[1], self._rows[2], self._rows[3]

    def _key_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key pool [R, D], rows [H, N]) of :meth:`token_pools`."""
        keys, _, rows = self.token_pools()
        return keys, rows

    def fused(self, query: torch.Tensor) -> bool:
        """True when a step for ``query`` runs the fused CPU kernel (:func:`decode_graph`):
        the kernels built, the query on the CPU, the 'auto' kernel backend, a store exposing
        its rows."""
        return (query.device.type == "cpu" and self.backend == "auto"
                and hasattr(self.store, "cluster_rows") and graph_cpu.load() is not None)

    # ------------------------------------------------------------------ memory
    def meta_nbytes(self) -> int:
        """Bytes of the graphs (with their room for later blocks), the keys' inverse norms,
        the token tables and the block sizes."""
        tables = self.token_cluster.nbytes + self.token_offset.nbytes
        return (self.adj.nbytes() + self._inv.nbytes() + tables
                + self._own_meta_nbytes())

    def free(self) -> None:
        """Release the store's KV, the graphs and tables (the index is unusable after)."""
        super().free()
        self.adj = GrowingRows(torch.empty(0, 0, 1, dtype=torch.int32))
        self._inv = GrowingRows(torch.empty(self.num_kv_heads, 0))
        self.spec, self.queries, self._rows = None, None, None

    # ------------------------------------------------------------------ decode
    def select_tokens(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The indexed tokens each KV head reads for query [num_heads, D]: [H, T] int64
        token indices (position ``sinks + index``), ascending, -1 padding (heads may read
        different counts). All of them when the budget covers every indexed token."""
        h, n = self.num_kv_heads, self.num_indexed
        budget, cfg = self.fixed_budget, self.config
        k = cfg.graph.top_k if budget is None else budget
        if n == 0 or k == 0 or self.spec is None:
            return torch.zeros(h, 0, dtype=torch.int64)
        if k >= n:
            return torch.arange(n)[None].expand(h, n).clone()
        if self.spec.num_graphs not in (h, query.shape[0]):
            raise ValueError(f"query of {query.shape[0]} heads; this index's graphs are per "
                             f"query head of {self.spec.num_graphs}")
        ef = max(cfg.graph.search_ef, k)
        pool, rows = self._key_rows()
        q = query.detach().float().cpu()
        ids = search_graphs([q], [self.adj.buf], [pool], [rows], [self.entries], ef)[0][0]
        g = q.shape[0] // h
        return merge_group(ids.reshape(h, g, ef), q.reshape(h, g, -1), pool, rows, scale, k,
                           budget)

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        """:meth:`select_tokens` as a selection (retrieval ids [H, T], -1 padding; no
        estimation zone)."""
        ids = self.select_tokens(query, scale).to(query.device)
        return Selection(ids, ids[:, :0])

    def decode(self, query: torch.Tensor, scale: float | None = None,
               selection: Selection | None = None, return_positions: bool = False,
               phases: dict[str, float] | None = None) -> DecodeResult:
        """One step: the steady zone and the selected tokens (:meth:`select_tokens`) read
        exactly through the store, one softmax over them (``selection`` is not supported:
        the tokens are chosen inside). Returns the output [num_heads, D] with the chosen
        token indices as ``selection.retrieval_ids`` ([H, T], -1 padding)."""
        if selection is not None:
            raise ValueError("GraphIndex.decode chooses its tokens itself; selection must be None")
        h, d = self.num_kv_heads, self.head_dim
        scale = d ** -0.5 if scale is None else scale
        dev = query.device
        mark = PhaseClock(phases, dev)
        if self.fused(query):
            out = torch.empty_like(query)[None]
            chosen, lse, counts = decode_graph([self], query[None], scale, out, want_chosen=True)
            mark("kernel")
            return self._result(out[0], lse, chosen[0], counts, return_positions)
        ids = self.select_tokens(query, scale)
        mark("select")
        counts = (ids >= 0).sum(1)
        safe = torch.where(ids >= 0, ids, ids[:, :1].clamp_min(0)).numpy()
        t = ids.shape[1]
        exec_k = torch.empty(h, max(self.num_steady + t, 1), d, dtype=self.sink_k.dtype,
                             device=dev)
        exec_v = torch.empty_like(exec_k)
        n_steady = fill_steady(self.steady_parts(), exec_k, exec_v)
        self.store.gather_tokens_into(  # type: ignore[attr-defined]
            self.token_cluster[safe], self.token_offset[safe], n_steady, exec_k, exec_v)
        mark("gather")
        n_exact = (counts + n_steady).to(dev)
        none = torch.zeros(h, 0, dtype=torch.int64, device=dev)
        out, lse = kernels.tripartite_decode(
            query.reshape(h, -1, d), exec_k, exec_v, n_exact, exec_k[:, :0], exec_v[:, :0],
            none.int(), none, torch.zeros(h, dtype=torch.int64, device=dev), scale,
            backend=self.backend)
        mark("attention")
        mark("bookkeeping")
        return self._result(out.reshape(-1, d), lse.reshape(-1), ids, counts, return_positions)

    def _result(self, out: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, return_positions: bool) -> DecodeResult:
        """A step's result from its output [Hq, D], lse [Hq] and chosen tokens ([H, T]
        ascending, -1 padding; counts [H])."""
        dev = out.device
        n_exact = (counts + self.num_steady).to(dev)
        positions = None
        if return_positions:
            h, sinks = self.num_kv_heads, self.num_sinks
            steady_pos = torch.cat([torch.arange(sinks),
                                    torch.arange(self.window_start, self.num_tokens)])
            chosen = torch.where(ids >= 0, ids + sinks, -1)
            positions = torch.cat([steady_pos[None].expand(h, -1), chosen], 1).to(dev)
        sel = ids.to(dev)
        return DecodeResult(out, lse, Selection(sel, sel[:, :0]), n_exact, positions)

    def token_budget(self) -> int:
        """Indexed tokens read per query head's search (``graph_top_k``), or per KV head
        as set by :meth:`set_token_budget`; at most the indexed tokens."""
        k = self.config.graph.top_k if self.fixed_budget is None else self.fixed_budget
        return min(k, self.num_indexed)


def decode_graph(indexes: list[GraphIndex], query: torch.Tensor, scale: float,
                 out: torch.Tensor, want_chosen: bool = False
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One decode step of ``indexes[b]`` for ``query[b]`` ([B, Hq, D], CPU) in one fused
    kernel call (:func:`GraphIndex.fused`): per (request, KV head) in parallel, its query
    heads' graph searches, the group's choice and exact attention over the steady zone and
    the chosen tokens, read in place from the store's pools; ``out`` ([B, Hq, D]) is
    written. Returns (each request's chosen tokens [H, T] ascending, -1 padding, when
    ``want_chosen``, else an empty list; lse [B * Hq] fp32; counts [B * H] int64)."""
    ext = graph_cpu.load()
    args: dict[str, list] = {k: [] for k in ("q", "adj", "ent", "rows", "kp", "vp", "sk", "sv",
                                             "k", "budget")}
    ef = indexes[0].config.graph.search_ef
    for b, index in enumerate(indexes):
        keys, values, rows = index.token_pools()
        h = index.num_kv_heads
        spec = index.spec
        args["q"].append(query[b].float().contiguous())
        args["adj"].append(index.adj.buf if spec is not None else
                           torch.zeros(h, 0, 1, dtype=torch.int32))
        args["ent"].append(index.entries if spec is not None else
                           torch.zeros(h, 1, dtype=torch.int64))
        args["rows"].append(rows)
        args["kp"].append(keys)
        args["vp"].append(values)
        parts = index.steady_parts()
        args["sk"].append([k for k, _ in parts])
        args["sv"].append([v for _, v in parts])
        budget = index.fixed_budget
        args["k"].append(index.config.graph.top_k)
        args["budget"].append(-1 if budget is None else budget)
    res, lse, counts, chosen = ext.graph_decode(
        args["q"], args["adj"], args["ent"], args["rows"], args["kp"], args["vp"], args["sk"],
        args["sv"], args["k"], args["budget"], ef, float(scale), want_chosen)
    out.copy_(res.reshape(out.shape))
    return chosen, lse, counts
