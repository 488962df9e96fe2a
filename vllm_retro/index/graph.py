"""RetrievalAttention's attention-aware graph index over keys (Liu et al., ``seeds/000``;
RoarGraph's projected bipartite graph, Chen et al., VLDB 2024), as functions.

The paper's observation: decode queries are *out of distribution* for the keys (different
projections), so a proximity graph built from key-to-key closeness leads a query's greedy
search astray; a graph built from the prefill's own queries does not. Build (§3.2):

1. **kNN from queries to keys**: every training query (a prefill query) is linked to its
   exact ``knn`` nearest keys by inner product (:func:`exact_knn`);
2. **projection**: the query nodes are removed by linking, for each training query, its
   top-1 key to the query's other nearest keys ("linking key vectors that are connected to
   the same query vectors"), pruned by RoarGraph's occlusion rule to at most ``degree``
   neighbours, then reverse edges (each list re-pruned);
3. **connectivity enhancement** (RoarGraph): every key in turn searches the graph so far
   with itself as the query from the entry (the key nearest the keys' mean) and links to
   the expanded keys the rule keeps (at most ``degree`` more), with edges back, so keys no
   training query reached are reachable too (:func:`link_ref`). Adjacency width
   ``2 * degree``.

Search (:func:`search_ref`): RoarGraph's best-first search — a pool of the ``ef`` best
candidates by ``q . k``, repeatedly expanding the best unexpanded one — whose pool's top
``k`` are the query's retrieved keys. Insertion of a key after the build
(:func:`insert_ref`): linked like step 3 among the keys before it.

Every ranking orders by (similarity descending, node id ascending). The ``*_ref`` functions
are the plain-Python statement of each step (lists, loops, float64 dot products), the
reference the C++ kernels (``kernels/csrc/graph_cpu.cpp``, :mod:`vllm_retro.kernels.graph_cpu`)
are tested against; the public functions dispatch to the kernels when they are built.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from vllm_retro.kernels import graph_cpu

KNN_CHUNK_ELEMENTS = 1 << 24
"""Query-key logits computed per chunk of :func:`exact_knn` (64 MiB of fp32)."""


# ------------------------------------------------------------------ build inputs
def exact_knn(queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's ``k`` nearest keys by inner product, best first.

    queries: [Q, D]; keys: [N, D] (any float dtype, same device; computed in fp32 on that
    device, in row chunks). Returns [Q, min(k, N)] int32 key indices."""
    q, n = queries.shape[0], keys.shape[0]
    k = min(k, n)
    out = torch.empty(q, k, dtype=torch.int32, device=keys.device)
    if q == 0 or k == 0:
        return out
    kf = keys.float()
    rows = max(1, KNN_CHUNK_ELEMENTS // max(n, 1))
    for s in range(0, q, rows):
        logits = queries[s:s + rows].float() @ kf.T
        out[s:s + rows] = torch.topk(logits, k, dim=1, sorted=True).indices.int()
    return out


def entry_points(keys: torch.Tensor, knn: torch.Tensor, count: int) -> list[int]:
    """A graph's entry nodes: RoarGraph's (the key nearest (L2) to the mean of ``keys``,
    [N, D]), then the keys most often the training queries' nearest (``knn`` [Q, K], first
    column; more often first, then lower id), ``count`` in all at most."""
    if keys.shape[0] == 0 or count <= 0:
        return []
    kf = keys.float()
    out = [int(((kf - kf.mean(0)) ** 2).sum(1).argmin())]
    top1 = knn[:, 0].long() if knn.numel() else torch.zeros(0, dtype=torch.long)
    top1 = top1[top1 >= 0].cpu()
    if top1.numel():
        freq = torch.bincount(top1, minlength=keys.shape[0])
        order = torch.sort(-freq, stable=True).indices
        for i in order[:count].tolist():
            if freq[i] == 0 or len(out) == count:
                break
            if i != out[0]:
                out.append(i)
    return out


def training_queries(queries: torch.Tensor, limit: int) -> torch.Tensor:
    """At most ``limit`` rows of ``queries`` ([Q, D]), evenly spaced (all when fewer)."""
    q = queries.shape[0]
    if q <= limit:
        return queries
    idx = torch.linspace(0, q - 1, limit, device=queries.device).round().long()
    return queries[idx]


@dataclass(frozen=True)
class GraphSpec:
    """How many graphs index a layer's keys and which training queries each one gets."""

    num_graphs: int
    """Graphs: one per KV head (``per_query_head`` False) or one per query head (the
    paper's choice)."""
    graph_head: torch.Tensor
    """[G] int64 the KV head whose keys graph g indexes."""

    @classmethod
    def make(cls, num_kv_heads: int, num_heads: int, per_query_head: bool) -> GraphSpec:
        """One graph per KV head, or per query head (``num_heads`` a multiple of KV heads)."""
        g = num_heads if per_query_head else num_kv_heads
        return cls(g, torch.arange(g) // (g // num_kv_heads))

    def queries_of(self, queries: torch.Tensor, g: int) -> torch.Tensor:
        """The prefill queries training graph g: its query head's ([Hq, T, D] -> [T, D]),
        or all query heads of its KV head's group pooled ([group * T, D])."""
        hq = queries.shape[0]
        if self.num_graphs == hq:
            return queries[g]
        group = hq // self.num_graphs
        return queries[g * group:(g + 1) * group].reshape(-1, queries.shape[-1])


def build_inputs(keys: torch.Tensor, queries: torch.Tensor | None, spec: GraphSpec,
                 knn: int, max_queries: int, num_entries: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kNN lists and entries of every graph of ``spec`` over ``keys`` ([Hk, N, D]).

    queries: [Hq, T, D] post-RoPE prefill queries, or None: then each graph is trained on
    its keys themselves (the off-the-shelf, key-to-key graph the paper shows suffers from
    the queries' OOD). At most ``max_queries`` training queries per graph (evenly spaced).
    Returns (knn [G, Q, min(knn, N)] int32 on the CPU, -1 padding; entries [G, E] int64,
    -1 padding: :func:`entry_points`, ``num_entries`` at most)."""
    lists, entries = [], []
    for g in range(spec.num_graphs):
        h = int(spec.graph_head[g])
        train = keys[h] if queries is None else spec.queries_of(queries, g)
        train = training_queries(train, max_queries)
        lists.append(exact_knn(train, keys[h], knn).cpu())
        entries.append(entry_points(keys[h], lists[-1], num_entries))
    q = max(x.shape[0] for x in lists)
    k = min(knn, keys.shape[1])
    out = torch.full((spec.num_graphs, q, k), -1, dtype=torch.int32)
    for g, x in enumerate(lists):
        out[g, :x.shape[0]] = x
    e = max(1, max(len(x) for x in entries))
    ent = torch.full((spec.num_graphs, e), -1, dtype=torch.int64)
    for g, x in enumerate(entries):
        ent[g, :len(x)] = torch.tensor(x, dtype=torch.int64)
    return out, ent


# ------------------------------------------------------------------ references
def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()))


def search_ref(keys: torch.Tensor, adj: torch.Tensor, entries: list[int], query: torch.Tensor,
               ef: int, skip: int = -1
               ) -> tuple[list[tuple[float, int]], list[tuple[float, int]], int]:
    """Best-first search (RoarGraph's, in plain Python).

    keys: [N, D] (node i's key); adj: [N, W] int (out-neighbours, then -1); query: [D].
    The pool starts with the entry nodes (ids outside [0, N) ignored) and keeps the ``ef``
    best candidates by ``q . k`` (ties: lower id first); the best unexpanded one is expanded
    (its unvisited neighbours scored and offered to the pool) until none is left. ``skip``
    is never offered; an entry equal to it offers its neighbours instead. Returns (the final
    pool best first, the expanded nodes in order), as (similarity, id) pairs, and how many
    keys were scored."""
    n = keys.shape[0]
    if n == 0:
        return [], [], 0
    nbrs = adj.tolist()
    sims = (keys.double() @ query.double()).tolist()  # q . k of every key, looked up below
    visited = {skip}
    order: list[tuple[float, int]] = []  # the pool's (-similarity, id), sorted
    done: set[int] = set()  # expanded ids
    scored = [0]

    def offer(node: int) -> None:
        scored[0] += 1
        key = (-sims[node], node)
        if len(order) == ef and not key < order[-1]:
            return
        bisect.insort(order, key)
        del order[ef:]

    for e in entries:
        if not 0 <= e < n:
            continue
        if e == skip:
            for v in nbrs[e]:
                if v < 0:
                    break
                if v not in visited:
                    visited.add(v)
                    offer(v)
        elif e not in visited:
            visited.add(e)
            offer(e)
    expanded = []
    while True:
        best = next((p for p in order if p[1] not in done), None)
        if best is None:
            break
        done.add(best[1])
        expanded.append((-best[0], best[1]))
        for v in nbrs[best[1]]:
            if v < 0:
                break
            if v in visited:
                continue
            visited.add(v)
            offer(v)
    return [(-p[0], p[1]) for p in order], expanded, scored[0]


def prune_ref(keys: torch.Tensor, target: int, cands: list[tuple[float, int]], m: int,
              fill: bool) -> list[int]:
    """RoarGraph's occlusion rule for inner products. ``cands``: (``k_c . k_target``, c)
    pairs in any order (repeats and ``target`` allowed). In (similarity desc, id asc) order,
    c is kept unless an already kept r has ``k_c . k_r > k_c . k_target``; at most ``m``.
    ``fill``: then topped up to ``m`` with the remaining candidates in order."""
    order = sorted({c: s for s, c in cands}.items(), key=lambda x: (-x[1], x[0]))
    out: list[int] = []
    for c, s in order:
        if len(out) == m:
            break
        if c != target and not any(_dot(keys[c], keys[r]) > s for r in out):
            out.append(c)
    if fill:
        for c, _ in order:
            if len(out) == m:
                break
            if c != target and c not in out:
                out.append(c)
    return out


def _scored(keys: torch.Tensor, u: int, ids: list[int]) -> list[tuple[float, int]]:
    return [(_dot(keys[u], keys[v]), v) for v in ids]


def _add_reverse_ref(keys: torch.Tensor, lists: list[list[int]], m: int) -> list[list[int]]:
    into: list[list[int]] = [[] for _ in lists]
    for u, row in enumerate(lists):
        for v in row:
            into[v].append(u)
    out = []
    for u, row in enumerate(lists):
        joined = list(row)
        for v in into[u]:
            if v not in joined:
                joined.append(v)
        out.append(joined if len(joined) <= m else
                   prune_ref(keys, u, _scored(keys, u, joined), m, fill=True))
    return out


def _row(adj: torch.Tensor, u: int) -> list[int]:
    row = adj[u].tolist()
    return row[:row.index(-1)] if -1 in row else row


def _set_row(adj: torch.Tensor, u: int, row: list[int]) -> None:
    adj[u] = -1
    adj[u, :len(row)] = torch.tensor(row, dtype=adj.dtype)


def _add_edge_ref(keys: torch.Tensor, adj: torch.Tensor, v: int, u: int, keep: int) -> None:
    """The edge v -> u: appended when v's row has room, else the row past its first
    ``keep`` entries re-pruned (with fill) together with u."""
    row, w = _row(adj, v), adj.shape[1]
    if u in row:
        return
    if len(row) < w:
        _set_row(adj, v, row + [u])
        return
    tail = row[keep:] + [u]
    _set_row(adj, v, row[:keep] + prune_ref(keys, v, _scored(keys, v, tail), w - keep, True))


def link_ref(keys: torch.Tensor, adj: torch.Tensor, limit: int, u: int, entries: list[int],
             m: int, ef: int, keep: list[int] | None = None) -> None:
    """Link node u into ``adj`` ([*, W] int32, in place): a search of the nodes below
    ``limit`` with u's own key from ``entries`` (u skipped); of the expanded nodes not yet
    u's neighbours, the rule (with fill) keeps at most ``min(m, room in u's row)``, appended
    to u's row; each gets the edge back (its first ``keep[v]`` entries kept)."""
    row = _row(adj, u)
    _, expanded, _ = search_ref(keys[:limit], adj[:limit], entries, keys[u], ef,
                                skip=u if u < limit else -1)
    cands = [(s, v) for s, v in expanded if v not in row]
    out = prune_ref(keys, u, cands, min(m, adj.shape[1] - len(row)), fill=True)
    _set_row(adj, u, row + out)
    for v in out:
        _add_edge_ref(keys, adj, v, u, keep[v] if keep is not None else 0)


def build_ref(keys: torch.Tensor, knn: torch.Tensor, entries: list[int], m: int, ef: int
              ) -> torch.Tensor:
    """One graph over ``keys`` ([N, D]) from the training queries' kNN lists ([Q, K] int,
    best first, -1 padding): projection, reverse edges, connectivity enhancement (see the
    module docstring). Returns the adjacency [N, 2m] int32 (-1 padding)."""
    n = keys.shape[0]
    by_top: list[list[int]] = [[] for _ in range(n)]
    lists = knn.tolist()
    for i, row in enumerate(lists):
        if row and row[0] >= 0:
            by_top[row[0]].append(i)
    proj: list[list[int]] = [[] for _ in range(n)]
    for t in range(n):
        if by_top[t]:
            ids = [v for i in by_top[t] for v in lists[i][1:] if v >= 0 and v != t]
            proj[t] = prune_ref(keys, t, _scored(keys, t, ids), m, fill=True)
    proj = _add_reverse_ref(keys, proj, m)
    adj = torch.full((n, 2 * m), -1, dtype=torch.int32)
    for u in range(n):
        _set_row(adj, u, proj[u])
    keep = [len(p) for p in proj]
    for u in range(n):
        link_ref(keys, adj, n, u, entries, m, ef, keep)
    return adj


def insert_ref(keys: torch.Tensor, adj: torch.Tensor, n_old: int, entries: list[int],
               m: int, ef: int) -> None:
    """Insert nodes ``n_old .. N - 1`` (keys [N, D]) into ``adj`` ([>= N, W] int32, in
    place), in order, each linked (:func:`link_ref`) among the nodes before it."""
    for u in range(n_old, keys.shape[0]):
        adj[u] = -1
        link_ref(keys, adj, u, u, entries, m, ef)


# ------------------------------------------------------------------ dispatch
def unit_keys(pool: torch.Tensor, rows: torch.Tensor, inv: torch.Tensor | None,
              h: int) -> torch.Tensor:
    """KV head h's keys ([N, D] fp64) as the key-key relations see them: scaled by ``inv``
    ([Hk, N] 1 / |k|: unit length, cosine) when given, else as they are (inner product)."""
    k = pool[rows[h]].double()
    return k if inv is None else k * inv[h, :, None].double()


def inverse_norms(keys: torch.Tensor) -> torch.Tensor:
    """1 / |k| per key ([..., D] -> [...] fp32; 0 for a zero key)."""
    norm = keys.float().norm(dim=-1)
    return torch.where(norm > 0, 1.0 / norm, torch.zeros_like(norm))


def build_graphs(pool: torch.Tensor, rows: torch.Tensor, knn: torch.Tensor,
                 graph_head: torch.Tensor, entries: torch.Tensor, degree: int, ef: int,
                 inv: torch.Tensor | None = None) -> torch.Tensor:
    """Every graph's adjacency [G, N, 2 * degree] int32 (CPU). pool: [R, D] keys (CPU);
    rows: [Hk, N] int64 (node i of KV head h is pool row ``rows[h, i]``); knn [G, Q, K]
    int32 and entries [G, E] (:func:`build_inputs`); graph_head [G]: each graph's KV head;
    inv: None (keys related to keys by inner product) or [Hk, N] fp32 1 / |k| (by cosine,
    :func:`inverse_norms`)."""
    ext = graph_cpu.load()
    if ext is not None:
        return ext.graph_build(pool.contiguous(), rows.contiguous(), knn.contiguous(),
                               graph_head, entries, degree, ef, inv)
    return torch.stack([
        build_ref(unit_keys(pool, rows, inv, int(h)), knn[g], entries[g].tolist(), degree, ef)
        for g, h in enumerate(graph_head.tolist())])


def insert_nodes(adj: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor,
                 graph_head: torch.Tensor, entries: torch.Tensor, n_old: int, degree: int,
                 ef: int, inv: torch.Tensor | None = None) -> None:
    """Insert nodes ``n_old .. N - 1`` (rows [Hk, N], inv as :func:`build_graphs`) into
    every graph ``adj`` ([G, >= N, W] int32, in place); see :func:`insert_ref`."""
    n = rows.shape[1]
    ext = graph_cpu.load()
    if ext is not None:
        ext.graph_insert(adj, pool.contiguous(), rows.contiguous(), graph_head, entries,
                         n_old, n, degree, ef, inv)
        return
    for g, h in enumerate(graph_head.tolist()):
        insert_ref(unit_keys(pool, rows, inv, h), adj[g], n_old, entries[g].tolist(), degree,
                   ef)


def search_graphs(queries: list[torch.Tensor], adjs: list[torch.Tensor],
                  pools: list[torch.Tensor], rows: list[torch.Tensor],
                  entries: list[torch.Tensor], ef: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Best-first search of every query head of every request (one kernel call for all).

    Request b: queries [Hq, D] (query head j searches graph ``j // (Hq / G)`` of adjs[b]
    [G, >= N, W] over the keys of KV head ``j // (Hq / Hk)``: pool rows rows[b] [Hk, N]
    of pools[b] [R, D]), entries[b] [G]. Returns per request (ids [Hq, ef] int64, scores
    [Hq, ef] fp32 ``q . k``, scored [Hq] int64): each search's final pool best first, -1 /
    -inf padding, and how many keys it scored."""
    queries = [q.float().contiguous() for q in queries]
    ext = graph_cpu.load()
    if ext is not None:
        return ext.graph_search(queries, adjs, [p.contiguous() for p in pools], rows,
                                entries, ef)
    out = []
    for q, adj, pool, row, ent in zip(queries, adjs, pools, rows, entries, strict=True):
        hq, g, hk = q.shape[0], adj.shape[0], row.shape[0]
        ids = torch.full((hq, ef), -1, dtype=torch.int64)
        sc = torch.full((hq, ef), -math.inf)
        scored = torch.zeros(hq, dtype=torch.int64)
        for j in range(hq):
            gi, hi = j // (hq // g), j // (hq // hk)
            found, _, scored[j] = search_ref(pool[row[hi]], adj[gi, :row.shape[1]],
                                             ent[gi].tolist(), q[j], ef)
            for i, (s, v) in enumerate(found):
                ids[j, i], sc[j, i] = v, s
        out.append((ids, sc, scored))
    return out


# ------------------------------------------------------------------ the GQA group's choice
def merge_group(ids: torch.Tensor, queries: torch.Tensor, pool: torch.Tensor,
                rows: torch.Tensor, scale: float, per_head: int, budget: int | None
                ) -> torch.Tensor:
    """The tokens each KV head reads, from its query heads' searches.

    ids: [Hk, G, P] each query head's search pool, best first (-1 padding); queries
    [Hk, G, D]; the indexed keys: node i of KV head h is row ``rows[h, i]`` ([Hk, N] int64)
    of ``pool`` ([R, D], any float dtype). Per KV head, the
    candidates are every id its G heads' pools hold; the members are each head's first
    ``per_head`` ids (its own top-k, the paper's retrieval). Candidates are ranked members
    first, then by the group's summed softmax of ``scale * q . k`` (each head's softmax
    over the candidates), then lower id; a KV head reads its first ``budget`` (None: as
    many as it has members), at most its candidates. Returns [Hk, T] int64 ascending per
    head, -1 padding (T the largest count)."""
    hk, g, p = ids.shape
    flat = ids.reshape(hk, g * p)
    member = torch.zeros_like(flat, dtype=torch.bool).reshape(hk, g, p)
    member[:, :, :per_head] = True
    member = member.reshape(hk, g * p) & (flat >= 0)
    # one slot per distinct id per head: sort by (id, member first), keep first occurrences
    big = rows.shape[1] + 1
    code = torch.where(flat >= 0, flat * 2 + (~member).long(), 2 * big)
    code, _ = code.sort(dim=1)
    cand = code // 2
    first = torch.ones_like(cand, dtype=torch.bool)
    first[:, 1:] = cand[:, 1:] != cand[:, :-1]
    valid = first & (cand < big)
    is_member = valid & (code % 2 == 0)
    safe = torch.where(valid, cand, 0)
    ck = pool[torch.gather(rows, 1, safe)].float()  # [Hk, C, D]
    logits = torch.einsum("hgd,hcd->hgc", queries.float(), ck) * scale
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    summed = torch.softmax(logits, dim=-1).sum(1)  # [Hk, C]
    count = is_member.sum(1) if budget is None else torch.full((hk,), budget)
    count = torch.minimum(count, valid.sum(1))
    # rank: members, then summed softmax, then id (stable sort on id order)
    rank_key = torch.where(valid, summed + 2.0 * g * is_member.float(), -1.0)
    order = torch.sort(rank_key, dim=1, descending=True, stable=True).indices
    t = int(count.max()) if hk else 0
    picked = torch.gather(cand, 1, order[:, :t])
    picked = torch.where(torch.arange(t)[None, :] < count[:, None], picked, big)
    picked = picked.sort(dim=1).values
    return torch.where(picked < big, picked, -1)


def merge_group_ref(ids: torch.Tensor, queries: torch.Tensor, pool: torch.Tensor,
                    rows: torch.Tensor, scale: float, per_head: int, budget: int | None
                    ) -> list[list[int]]:
    """:func:`merge_group` in plain Python (float64): per KV head, its ascending token
    list."""
    hk, g, _ = ids.shape
    out = []
    for h in range(hk):
        keys = pool[rows[h]]
        lists = [[v for v in ids[h, j].tolist() if v >= 0] for j in range(g)]
        members = {v for lst in lists for v in lst[:per_head]}
        cands = sorted({v for lst in lists for v in lst})
        summed = dict.fromkeys(cands, 0.0)
        for j in range(g):
            logit = {c: _dot(queries[h, j], keys[c]) * scale for c in cands}
            top = max(logit.values())
            z = sum(math.exp(x - top) for x in logit.values())
            for c in cands:
                summed[c] += math.exp(logit[c] - top) / z
        ranked = sorted(cands, key=lambda c: (c not in members, -summed[c], c))
        count = len(members) if budget is None else budget
        out.append(sorted(ranked[:min(count, len(cands))]))
    return out
