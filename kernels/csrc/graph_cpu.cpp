// RetrievalAttention's attention-aware graph index over keys (Liu et al.; RoarGraph's
// projected bipartite graph, Chen et al., VLDB 2024), on CPU: build, insertion and search.
//
// A decode query's similarity to a key is the inner product q . k (no scale: the ranking is
// the attention's); keys are related to keys by inner product or, given their inverse
// norms, by cosine (what the index uses: see vllm_retro.index.graph). Every
// ranking orders by (similarity descending, node id ascending), so results are deterministic
// and, given exactly representable inputs, identical to the plain Python reference of
// vllm_retro.index.graph (its functions *_ref), which these follow step by step.
//
// Keys are read in place: node i of a graph over KV head h is row rows[h, i] of a pool
// [R, D] (fp32, bf16 or fp16; the index's store or the prefill's keys), so no copy of the
// keys is made. A graph is an adjacency [N, W] int32, each row its out-neighbours then -1s.
//
// - graph_build: per graph, (1) projection: every training query's top-1 key t links to the
//   query's other nearest keys, pruned by RoarGraph's occlusion rule to at most M; (2)
//   reverse edges, each list re-pruned to M; (3) connectivity enhancement: every node in
//   order searches the graph so far with its own key from the entry, and links to the
//   expanded nodes the rule keeps (at most M more), with edges back (a full row re-pruned
//   past its projection edges). Width W = 2M.
// - graph_insert: decoded tokens joining the index, one node at a time, linked as in (3)
//   among the nodes before it.
// - graph_search: best-first search per (request, query head) with a pool of ef candidates.
//
// Part of the project's single CPU extension (kernels/cpu_decode.py _SOURCES); the functions
// are bound by retro_cpu.cpp.
#include <torch/extension.h>

#include "retro_check.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RETRO_GRAPH_AVX2 1
#endif

namespace {

// ------------------------------------------------------------------ dot products
inline float hsum8(float* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// q (fp32) . k (scalar_t), both of length d.
template <typename T>
inline float dot_qk(const float* q, const T* k, int64_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += q[i + l] * static_cast<float>(k[i + l]);
  float s = hsum8(acc);
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

#ifdef RETRO_GRAPH_AVX2
inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
template <>
inline float dot_qk<float>(const float* q, const float* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
  }
  float s = hsum256(_mm256_add_ps(a0, a1));
  for (; i < d; ++i) s += q[i] * k[i];
  return s;
}
inline __m256 load_bf16(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
template <>
inline float dot_qk<at::BFloat16>(const float* q, const at::BFloat16* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load_bf16(k + i + 8), a1);
  }
  float s = hsum256(_mm256_add_ps(a0, a1));
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}
#if defined(__F16C__)
template <>
inline float dot_qk<at::Half>(const float* q, const at::Half* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i)));
    __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i + 8)));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), k0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), k1, a1);
  }
  float s = hsum256(_mm256_add_ps(a0, a1));
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}
#endif
#endif

// The keys of one graph: node i is row rows[i] of pool [R, D]. Similarity is the inner
// product, or with `inv` (1 / |k_i| per node) the cosine.
template <typename T>
struct Keys {
  const T* pool;
  const int64_t* rows;
  int64_t d;
  const float* inv = nullptr;
  const T* at(int32_t i) const { return pool + rows[i] * d; }
  void prefetch(int32_t i) const {
    const char* p = reinterpret_cast<const char*>(at(i));
    for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
      __builtin_prefetch(p + off);
  }
  // node i's key as a query (fp32; unit length with `inv`)
  void query(int32_t i, float* out) const {
    const T* k = at(i);
    const float f = inv ? inv[i] : 1.0f;
    for (int64_t j = 0; j < d; ++j) out[j] = static_cast<float>(k[j]) * f;
  }
  // similarity of query q (as made by `query`, or a decode query) with node v
  float sim(const float* q, int32_t v) const {
    const float s = dot_qk(q, at(v), d);
    return inv ? s * inv[v] : s;
  }
};

// a is ranked before b: higher similarity, then lower id.
inline bool before(float sa, int32_t ia, float sb, int32_t ib) {
  return sa > sb || (sa == sb && ia < ib);
}

// ------------------------------------------------------------------ visited tags
// Per thread, one tag per node; a search takes a fresh epoch instead of clearing them.
struct Visited {
  std::vector<uint32_t> tag;
  uint32_t epoch = 0;
  void start(int64_t n) {
    if (static_cast<int64_t>(tag.size()) < n) tag.assign(n, 0), epoch = 0;
    if (++epoch == 0) std::fill(tag.begin(), tag.end(), 0), epoch = 1;
  }
  bool test_set(int32_t i) {
    if (tag[i] == epoch) return true;
    tag[i] = epoch;
    return false;
  }
};
thread_local Visited tls_visited;

// ------------------------------------------------------------------ candidate pool
// At most `cap` candidates sorted best first; `cur` is at or before the best unexpanded one.
struct Pool {
  struct Entry {
    float s;
    int32_t id;
    bool done;
  };
  std::vector<Entry> e;
  int64_t cap = 0, size = 0, cur = 0;
  void reset(int64_t c) {
    cap = c;
    size = cur = 0;
    if (static_cast<int64_t>(e.size()) < c + 1) e.resize(c + 1);
  }
  void insert(float s, int32_t id) {
    if (size == cap && !before(s, id, e[size - 1].s, e[size - 1].id)) return;
    int64_t lo = 0, hi = size;
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (before(e[mid].s, e[mid].id, s, id)) lo = mid + 1; else hi = mid;
    }
    int64_t last = size < cap ? size : cap - 1;
    for (int64_t i = last; i > lo; --i) e[i] = e[i - 1];
    e[lo] = {s, id, false};
    if (size < cap) ++size;
    if (lo < cur) cur = lo;
  }
  // The best unexpanded candidate's id (now expanded), or -1 when none is left.
  int32_t next() {
    while (cur < size && e[cur].done) ++cur;
    if (cur >= size) return -1;
    e[cur].done = true;
    return e[cur].id;
  }
};
thread_local Pool tls_pool;

// Best-first search of graph adj [n, w] for query q (fp32 [d]) from the entries (ne of them;
// ids < 0 or >= n ignored) with a pool of `ef`; `skip` (or -1) is never inserted, and an
// entry equal to it contributes its neighbours instead. Expanded nodes are appended to
// `expanded` (if given) in order, with their similarity. Leaves the final pool in `pool`;
// returns how many keys were scored.
template <typename T>
int64_t search(const Keys<T>& keys, const int32_t* adj, int64_t n, int64_t w,
               const int64_t* entries, int64_t ne, const float* q, int64_t ef, int32_t skip,
               Pool& pool, std::vector<std::pair<float, int32_t>>* expanded) {
  Visited& vis = tls_visited;
  vis.start(n);
  pool.reset(ef);
  if (n == 0) return 0;
  int64_t scored = 0;
  if (skip >= 0) vis.test_set(skip);
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t e = entries[i];
    if (e < 0 || e >= n) continue;
    if (e == skip) {  // the node itself: start from its neighbours
      const int32_t* nb = adj + e * w;
      for (int64_t j = 0; j < w && nb[j] >= 0; ++j)
        if (!vis.test_set(nb[j])) pool.insert(keys.sim(q, nb[j]), nb[j]), ++scored;
    } else if (!vis.test_set(static_cast<int32_t>(e))) {
      pool.insert(keys.sim(q, static_cast<int32_t>(e)), static_cast<int32_t>(e));
      ++scored;
    }
  }
  thread_local std::vector<int32_t> fresh;
  for (int32_t u; (u = pool.next()) >= 0;) {
    if (expanded) expanded->emplace_back(pool.e[pool.cur].s, u);
    const int32_t* nb = adj + static_cast<int64_t>(u) * w;
    // the unvisited neighbours' keys are fetched together (random rows: the search is
    // bound by these misses), then scored in order
    fresh.clear();
    for (int64_t j = 0; j < w; ++j) {
      int32_t v = nb[j];
      if (v < 0) break;
      if (vis.test_set(v)) continue;
      fresh.push_back(v);
      keys.prefetch(v);
    }
    for (int32_t v : fresh) pool.insert(keys.sim(q, v), v);
    scored += static_cast<int64_t>(fresh.size());
  }
  return scored;
}

// RoarGraph's occlusion rule for inner products. cands: (ip with tgt, id) in any order, may
// hold repeats and tgt. Sorted best first and deduplicated, a candidate c is kept unless an
// already kept r has k_c . k_r > k_c . k_tgt; at most m are kept. With `fill`, the list is
// then topped up to m with the remaining candidates in order. Result in `out`.
template <typename T>
void prune(const Keys<T>& keys, int32_t tgt, std::vector<std::pair<float, int32_t>>& cands,
           int64_t m, bool fill, std::vector<int32_t>& out, std::vector<float>& buf) {
  std::sort(cands.begin(), cands.end(), [](const auto& a, const auto& b) {
    return before(a.first, a.second, b.first, b.second);
  });
  cands.erase(std::unique(cands.begin(), cands.end(),
                          [](const auto& a, const auto& b) { return a.second == b.second; }),
              cands.end());
  out.clear();
  buf.resize(keys.d);
  std::vector<char> kept(cands.size(), 0);
  for (size_t c = 0; c < cands.size() && static_cast<int64_t>(out.size()) < m; ++c) {
    int32_t id = cands[c].second;
    if (id == tgt) continue;
    keys.query(id, buf.data());
    bool occluded = false;
    for (int32_t r : out)
      if (keys.sim(buf.data(), r) > cands[c].first) {
        occluded = true;
        break;
      }
    if (!occluded) out.push_back(id), kept[c] = 1;
  }
  if (!fill) return;
  for (size_t c = 0; c < cands.size() && static_cast<int64_t>(out.size()) < m; ++c)
    if (!kept[c] && cands[c].second != tgt) out.push_back(cands[c].second);
}

// Similarities of node u's key with each id of `ids`, as (ip, id) pairs.
template <typename T>
void with_scores(const Keys<T>& keys, int32_t u, const std::vector<int32_t>& ids,
                 std::vector<std::pair<float, int32_t>>& out, std::vector<float>& buf) {
  buf.resize(keys.d);
  keys.query(u, buf.data());
  out.clear();
  for (int32_t v : ids) out.emplace_back(keys.sim(buf.data(), v), v);
}

// Lists of in-neighbours: for every edge u -> v of `lists`, u is added to in[v], u ascending.
std::vector<std::vector<int32_t>> reverse_lists(const std::vector<std::vector<int32_t>>& lists) {
  std::vector<std::vector<int32_t>> in(lists.size());
  for (size_t u = 0; u < lists.size(); ++u)
    for (int32_t v : lists[u]) in[v].push_back(static_cast<int32_t>(u));
  return in;
}

// Each node's list joined with its in-neighbours (not yet present), re-pruned (with fill) to
// m when longer.
template <typename T>
std::vector<std::vector<int32_t>> add_reverse(const Keys<T>& keys,
                                              const std::vector<std::vector<int32_t>>& lists,
                                              int64_t m) {
  auto in = reverse_lists(lists);
  int64_t n = static_cast<int64_t>(lists.size());
  std::vector<std::vector<int32_t>> out(n);
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    std::vector<std::pair<float, int32_t>> cands;
    std::vector<float> buf;
    for (int64_t u = b; u < e; ++u) {
      std::vector<int32_t> joined = lists[u];
      for (int32_t v : in[u]) {
        if (std::find(joined.begin(), joined.end(), v) == joined.end()) joined.push_back(v);
      }
      if (static_cast<int64_t>(joined.size()) <= m) {
        out[u] = std::move(joined);
        continue;
      }
      with_scores(keys, static_cast<int32_t>(u), joined, cands, buf);
      prune(keys, static_cast<int32_t>(u), cands, m, true, out[u], buf);
    }
  });
  return out;
}

// Length of a row (its entries before the first -1).
inline int64_t row_len(const int32_t* row, int64_t w) {
  int64_t len = 0;
  while (len < w && row[len] >= 0) ++len;
  return len;
}

// Add the edge v -> u: appended when v's row has room, else v's row past its first `keep`
// entries (kept as they are) is re-pruned (with fill) together with u.
template <typename T>
void add_edge(const Keys<T>& keys, int32_t* adj, int64_t w, int32_t v, int32_t u, int64_t keep,
              std::vector<std::pair<float, int32_t>>& cands, std::vector<int32_t>& kept,
              std::vector<float>& buf) {
  int32_t* row = adj + static_cast<int64_t>(v) * w;
  int64_t len = row_len(row, w);
  if (std::find(row, row + len, u) != row + len) return;
  if (len < w) {
    row[len] = u;
    return;
  }
  std::vector<int32_t> tail(row + keep, row + len);
  tail.push_back(u);
  with_scores(keys, v, tail, cands, buf);
  prune(keys, v, cands, w - keep, true, kept, buf);
  std::fill(row + keep, row + w, -1);
  std::copy(kept.begin(), kept.end(), row + keep);
}

// Link node u into the graph adj [*, w]: a best-first search of the nodes below `limit`
// with u's own key from `entry` (u skipped); of the expanded nodes not yet u's neighbours,
// the rule (with fill) keeps at most min(m, room left in u's row), appended to u's row;
// each of them gets the edge back (add_edge, its first keep[v] entries kept; keep may be
// null: none kept).
template <typename T>
void link(const Keys<T>& keys, int32_t* adj, int64_t w, int64_t limit, int32_t u,
          const int64_t* entries, int64_t ne, int64_t m, int64_t ef, const int64_t* keep) {
  thread_local std::vector<std::pair<float, int32_t>> expanded, cands;
  thread_local std::vector<float> q, buf;
  thread_local std::vector<int32_t> out, kept;
  int32_t* urow = adj + static_cast<int64_t>(u) * w;
  const int64_t len = row_len(urow, w);
  q.resize(keys.d);
  keys.query(u, q.data());
  expanded.clear();
  search(keys, adj, limit, w, entries, ne, q.data(), ef, u < limit ? u : -1, tls_pool,
         &expanded);
  expanded.erase(std::remove_if(expanded.begin(), expanded.end(), [&](const auto& c) {
                   return std::find(urow, urow + len, c.second) != urow + len;
                 }),
                 expanded.end());
  prune(keys, u, expanded, std::min(m, w - len), true, out, buf);
  std::copy(out.begin(), out.end(), urow + len);
  for (int32_t v : out) add_edge(keys, adj, w, v, u, keep ? keep[v] : 0, cands, kept, buf);
}

template <typename T>
void build_one(const Keys<T>& keys, int64_t n, const int32_t* knn, int64_t nq, int64_t kq,
               const int64_t* entries, int64_t ne, int64_t m, int64_t ef, int32_t* adj) {
  // (1) projection: the training queries grouped by their top-1 key (queries in order)
  std::vector<std::vector<int32_t>> by_top(n);
  for (int64_t i = 0; i < nq; ++i) {
    int32_t t = knn[i * kq];
    if (t >= 0) by_top[t].push_back(static_cast<int32_t>(i));
  }
  std::vector<std::vector<int32_t>> proj(n);
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    std::vector<int32_t> ids;
    std::vector<std::pair<float, int32_t>> cands;
    std::vector<float> buf;
    for (int64_t t = b; t < e; ++t) {
      if (by_top[t].empty()) continue;
      ids.clear();
      for (int32_t i : by_top[t])
        for (int64_t j = 1; j < kq; ++j) {
          int32_t v = knn[i * kq + j];
          if (v >= 0 && v != t) ids.push_back(v);
        }
      with_scores(keys, static_cast<int32_t>(t), ids, cands, buf);
      prune(keys, static_cast<int32_t>(t), cands, m, true, proj[t], buf);
    }
  });
  // (2) reverse edges
  proj = add_reverse(keys, proj, m);
  // (3) connectivity enhancement: every node, in order, linked into the graph so far
  const int64_t w = 2 * m;
  std::vector<int64_t> keep(n);
  for (int64_t u = 0; u < n; ++u) {
    int32_t* row = adj + u * w;
    std::fill(row, row + w, -1);
    std::copy(proj[u].begin(), proj[u].end(), row);
    keep[u] = static_cast<int64_t>(proj[u].size());
  }
  for (int64_t u = 0; u < n; ++u)
    link(keys, adj, w, n, static_cast<int32_t>(u), entries, ne, m, ef, keep.data());
}

template <typename T>
void insert_one(const Keys<T>& keys, int32_t* adj, int64_t w, int64_t n_old, int64_t n_total,
                const int64_t* entries, int64_t ne, int64_t m, int64_t ef) {
  for (int64_t u = n_old; u < n_total; ++u) {
    std::fill(adj + u * w, adj + (u + 1) * w, -1);
    link(keys, adj, w, u, static_cast<int32_t>(u), entries, ne, m, ef, nullptr);  // nodes < u
  }
}

template <typename F>
void dispatch_dtype(const torch::Tensor& pool, F&& f) {
  switch (pool.scalar_type()) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<at::Half*>(nullptr)); break;
    default:
      RETRO_CHECK(false, "graph index: key dtype ", pool.scalar_type(),
                  " is not supported; accepted: float32, bfloat16, float16");
  }
}

// The graph-level arguments of graph_build / graph_insert, checked: each graph's KV head,
// its entry nodes, and the keys' inverse norms (null: keys related by inner product).
struct GraphArgs {
  torch::Tensor graph_head, entries, inv;
  const int64_t* gh = nullptr;
  const int64_t* ent = nullptr;
  int64_t num_entries = 0;
  const float* invp = nullptr;
  // graph i's keys: its KV head's rows of `rows` ([Hk, n] int64) into `pool`
  template <typename T>
  Keys<T> keys(const torch::Tensor& pool, const torch::Tensor& rows, int64_t i) const {
    const int64_t n = rows.size(1);
    return Keys<T>{pool.data_ptr<T>(), rows.data_ptr<int64_t>() + gh[i] * n, pool.size(1),
                   invp ? invp + gh[i] * n : nullptr};
  }
};

GraphArgs graph_args(const torch::Tensor& graph_head, const torch::Tensor& entries,
                     const c10::optional<torch::Tensor>& inv, const torch::Tensor& rows) {
  GraphArgs a;
  a.graph_head = graph_head.to(torch::kLong).contiguous();
  a.entries = entries.to(torch::kLong).contiguous();
  RETRO_CHECK(a.entries.dim() == 2 && a.entries.size(0) == a.graph_head.size(0),
              "graph index: entries must be [G, E] (E entry nodes per graph)");
  a.gh = a.graph_head.data_ptr<int64_t>();
  a.ent = a.entries.data_ptr<int64_t>();
  a.num_entries = a.entries.size(1);
  if (inv.has_value()) {
    a.inv = inv->to(torch::kFloat).contiguous();
    RETRO_CHECK(a.inv.sizes() == rows.sizes(), "graph index: inv must be [H, N] like rows");
    a.invp = a.inv.data_ptr<float>();
  }
  return a;
}

void check_pool(const torch::Tensor& pool, const torch::Tensor& rows) {
  RETRO_CHECK(pool.device().is_cpu() && pool.dim() == 2 && pool.is_contiguous(),
              "graph index: the key pool must be a contiguous [R, D] CPU tensor");
  RETRO_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 2 &&
                  rows.is_contiguous(),
              "graph index: rows must be a contiguous [H, N] int64 CPU tensor");
}

}  // namespace

// Build one graph per row of `graph_head` (the KV head whose keys it indexes). pool [R, D]
// keys, rows [Hk, N] int64 (node i of KV head h is pool row rows[h, i]), inv: None (keys
// related by inner product) or [Hk, N] fp32 1 / |k| (by cosine), knn [G, Q, K] int32
// (each training query's nearest nodes, best first, -1 padding), entries [G, E] int64
// (entry nodes, -1 padding), degree m, build pool ef. Returns the adjacency [G, N, 2m] int32 (-1 padding).
torch::Tensor graph_build(torch::Tensor pool, torch::Tensor rows, torch::Tensor knn,
                          torch::Tensor graph_head, torch::Tensor entries, int64_t m,
                          int64_t ef, c10::optional<torch::Tensor> inv) {
  check_pool(pool, rows);
  RETRO_CHECK(knn.scalar_type() == at::kInt && knn.dim() == 3 && knn.is_contiguous(),
              "graph_build: knn must be a contiguous [G, Q, K] int32 tensor");
  const int64_t g = knn.size(0), n = rows.size(1);
  auto adj = torch::empty({g, n, 2 * m}, torch::dtype(torch::kInt32));
  const GraphArgs ga = graph_args(graph_head, entries, inv, rows);
  const int64_t *entp = ga.ent, ne = ga.num_entries;
  dispatch_dtype(pool, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // graphs in parallel (their connectivity phase is sequential), each graph's projection
    // in parallel inside when there are fewer graphs than threads
    at::parallel_for(0, g, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const Keys<T> keys = ga.keys<T>(pool, rows, i);
        build_one(keys, n, knn.data_ptr<int32_t>() + i * knn.size(1) * knn.size(2),
                  knn.size(1), knn.size(2), entp + i * ne, ne, m, ef,
                  adj.data_ptr<int32_t>() + i * n * 2 * m);
      }
    });
  });
  return adj;
}

// Insert nodes n_old .. n_total - 1 (their keys at rows[h, i] of pool) into the graphs
// adj [G, >= n_total, W] int32 in place, in order, each linked to at most m out-neighbours
// (keys related as in graph_build: inv None or [Hk, N] 1 / |k|).
void graph_insert(torch::Tensor adj, torch::Tensor pool, torch::Tensor rows,
                  torch::Tensor graph_head, torch::Tensor entries, int64_t n_old,
                  int64_t n_total, int64_t m, int64_t ef, c10::optional<torch::Tensor> inv) {
  check_pool(pool, rows);
  RETRO_CHECK(adj.scalar_type() == at::kInt && adj.dim() == 3 && adj.is_contiguous() &&
                  adj.size(1) >= n_total && rows.size(1) >= n_total,
              "graph_insert: adj must be a contiguous [G, >= n_total, W] int32 tensor");
  const int64_t g = adj.size(0), w = adj.size(2), n = rows.size(1);
  const GraphArgs ga = graph_args(graph_head, entries, inv, rows);
  const int64_t *entp = ga.ent, ne = ga.num_entries;
  dispatch_dtype(pool, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    at::parallel_for(0, g, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const Keys<T> keys = ga.keys<T>(pool, rows, i);
        insert_one(keys, adj.data_ptr<int32_t>() + i * adj.size(1) * w, w, n_old, n_total,
                   entp + i * ne, ne, m, ef);
      }
    });
  });
}

// Best-first search for every (request b, query head j): query queries[b][j] (fp32 [D]) on
// graph j / (Hq / G) of adjs[b] ([G, >= N_b, W]) over the keys of KV head j / (Hq / Hk)
// (pools[b] rows rows[b], [Hk, N_b]) from entries[b][graph] ([G, E]), with a pool of ef. Returns, per
// request, (ids [Hq, ef] int64, scores [Hq, ef] fp32, scored [Hq] int64): the final pool
// best first, -1 / -inf padding when fewer than ef nodes were reached, and how many keys
// each search scored.
std::vector<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>> graph_search(
    std::vector<torch::Tensor> queries, std::vector<torch::Tensor> adjs,
    std::vector<torch::Tensor> pools, std::vector<torch::Tensor> rows,
    std::vector<torch::Tensor> entries, int64_t ef) {
  const int64_t nb = static_cast<int64_t>(queries.size());
  RETRO_CHECK(adjs.size() == queries.size() && pools.size() == queries.size() &&
                  rows.size() == queries.size() && entries.size() == queries.size(),
              "graph_search: one adjacency, pool, rows and entries per query tensor");
  RETRO_CHECK(ef >= 1, "graph_search: ef must be positive");
  std::vector<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>> out;
  std::vector<int64_t> first(nb + 1, 0);
  std::vector<torch::Tensor> ent(nb);
  for (int64_t b = 0; b < nb; ++b) {
    check_pool(pools[b], rows[b]);
    RETRO_CHECK(queries[b].scalar_type() == at::kFloat && queries[b].is_contiguous() &&
                    queries[b].dim() == 2 && queries[b].size(1) == pools[b].size(1),
                "graph_search: queries must be contiguous [Hq, D] float32");
    RETRO_CHECK(adjs[b].scalar_type() == at::kInt && adjs[b].is_contiguous() &&
                    adjs[b].dim() == 3 && adjs[b].size(1) >= rows[b].size(1),
                "graph_search: adjacency must be a contiguous [G, >= N, W] int32 tensor");
    const int64_t hq = queries[b].size(0);
    RETRO_CHECK(hq % adjs[b].size(0) == 0 && hq % rows[b].size(0) == 0,
                "graph_search: query heads must be a multiple of graphs and KV heads");
    out.emplace_back(torch::full({hq, ef}, -1, torch::dtype(torch::kLong)),
                     torch::full({hq, ef}, -std::numeric_limits<float>::infinity(),
                                 torch::dtype(torch::kFloat)),
                     torch::zeros({hq}, torch::dtype(torch::kLong)));
    ent[b] = entries[b].to(torch::kLong).contiguous();
    RETRO_CHECK(ent[b].dim() == 2 && ent[b].size(0) == adjs[b].size(0),
                "graph_search: entries must be [G, E] per request");
    first[b + 1] = first[b] + hq;
  }
  at::parallel_for(0, first[nb], 1, [&](int64_t begin, int64_t end) {
    Pool& pool = tls_pool;
    for (int64_t t = begin; t < end; ++t) {
      int64_t b = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      int64_t j = t - first[b];
      const auto& a = adjs[b];
      const int64_t hq = queries[b].size(0), g = a.size(0), hk = rows[b].size(0);
      const int64_t n = rows[b].size(1), w = a.size(2);
      const int64_t gi = j / (hq / g), hi = j / (hq / hk);
      const int32_t* adj = a.data_ptr<int32_t>() + gi * a.size(1) * w;
      const float* q = queries[b].data_ptr<float>() + j * queries[b].size(1);
      const int64_t ne = ent[b].size(1);
      const int64_t* entry = ent[b].data_ptr<int64_t>() + gi * ne;
      dispatch_dtype(pools[b], [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        Keys<T> keys{pools[b].data_ptr<T>(), rows[b].data_ptr<int64_t>() + hi * n,
                     pools[b].size(1)};
        std::get<2>(out[b]).data_ptr<int64_t>()[j] =
            search(keys, adj, n, w, entry, ne, q, ef, -1, pool, nullptr);
      });
      int64_t* ids = std::get<0>(out[b]).data_ptr<int64_t>() + j * ef;
      float* sc = std::get<1>(out[b]).data_ptr<float>() + j * ef;
      for (int64_t i = 0; i < pool.size; ++i) ids[i] = pool.e[i].id, sc[i] = pool.e[i].s;
    }
  });
  return out;
}

namespace {

// out[i] += p * v[i] (fp32 accumulator, v any storage type)
template <typename T>
inline void axpy(float* out, float p, const T* v, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
}
#ifdef RETRO_GRAPH_AVX2
template <>
inline void axpy<float>(float* out, float p, const float* v, int64_t d) {
  const __m256 pp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i),
                                              _mm256_loadu_ps(out + i)));
  for (; i < d; ++i) out[i] += p * v[i];
}
template <>
inline void axpy<at::BFloat16>(float* out, float p, const at::BFloat16* v, int64_t d) {
  const __m256 pp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, load_bf16(v + i), _mm256_loadu_ps(out + i)));
  for (; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
}
#if defined(__F16C__)
template <>
inline void axpy<at::Half>(float* out, float p, const at::Half* v, int64_t d) {
  const __m256 pp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)));
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, x, _mm256_loadu_ps(out + i)));
  }
  for (; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
}
#endif
#endif

template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off);
}

// One query head's online softmax (fp32): running max m, denominator l, numerator acc.
struct Online {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
  std::vector<float> acc;
  void reset(int64_t d) {
    m = -std::numeric_limits<float>::infinity();
    l = 0.0f;
    acc.assign(d, 0.0f);
  }
  // the weight the value of a logit s gets (rescaling what came before)
  float add(float s) {
    if (s > m) {
      const float c = std::exp(m - s);  // 0 on the first finite logit
      for (float& a : acc) a *= c;
      l *= c;
      m = s;
    }
    const float p = std::exp(s - m);
    l += p;
    return p;
  }
};

// The tokens one KV head reads (ascending), from its G query heads' searches: each head's
// first k ids are members; with budget < 0 the members, else the budget best of all ids
// by (member, the group's summed softmax over the candidates, lower id).
template <typename T>
void choose(const Keys<T>& keys, const std::vector<std::vector<int32_t>>& pools,
            const float* q, int64_t g, int64_t k, int64_t budget, float scale,
            std::vector<int32_t>& chosen) {
  thread_local std::vector<int32_t> cand;
  thread_local std::vector<char> member;
  cand.clear();
  member.clear();
  for (int64_t j = 0; j < g; ++j)
    for (size_t i = 0; i < pools[j].size(); ++i) {
      cand.push_back(pools[j][i]);
      member.push_back(static_cast<int64_t>(i) < k ? 1 : 0);
    }
  // distinct ids, a member if any head has it among its first k
  std::vector<std::pair<int32_t, char>> uniq(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) uniq[i] = {cand[i], static_cast<char>(!member[i])};
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end(),
                         [](const auto& a, const auto& b) { return a.first == b.first; }),
             uniq.end());
  chosen.clear();
  if (budget < 0) {
    for (const auto& u : uniq)
      if (u.second == 0) chosen.push_back(u.first);
    return;
  }
  if (static_cast<int64_t>(uniq.size()) <= budget) {
    for (const auto& u : uniq) chosen.push_back(u.first);
    return;
  }
  const int64_t c = static_cast<int64_t>(uniq.size()), d = keys.d;
  std::vector<float> summed(c, 0.0f), logit(c);
  for (int64_t j = 0; j < g; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < c; ++i) {
      logit[i] = dot_qk(q + j * d, keys.at(uniq[i].first), d) * scale;
      mx = std::max(mx, logit[i]);
    }
    float z = 0.0f;
    for (int64_t i = 0; i < c; ++i) z += (logit[i] = std::exp(logit[i] - mx));
    for (int64_t i = 0; i < c; ++i) summed[i] += logit[i] / z;
  }
  std::vector<int64_t> order(c);
  for (int64_t i = 0; i < c; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (uniq[a].second != uniq[b].second) return uniq[a].second < uniq[b].second;
    return summed[a] > summed[b];
  });
  for (int64_t i = 0; i < budget; ++i) chosen.push_back(uniq[order[i]].first);
  std::sort(chosen.begin(), chosen.end());
}

}  // namespace

// One decode step of graph indexes, fused per (request b, KV head h): each of the KV head's
// query heads searches its graph (pool ef), the group's choice (members: each head's top
// ks[b]; budgets[b] >= 0: that many by the group's summed softmax) is read in place from
// the key / value pools (kpools[b], vpools[b] [R, D], token i at rows[b][h, i]), and every
// query head attends exactly over its steady zone (the pieces steady_k[b][p], steady_v[b][p]
// [Hk, n_p, D], last dim contiguous) and the chosen tokens, one fp32 online softmax. With
// ks[b] or budgets[b] at least the indexed tokens, every one is read (no search).
// queries[b]: [Hq, D] fp32; adjs[b] [G, >= N, W]; entries[b] [G, E]. Returns (out
// [sum Hq, D] fp32, lse [sum Hq] fp32 natural log of the scaled softmax denominator,
// counts [sum Hk] int64 tokens chosen per KV head, chosen: per request [Hk, T_b] int64
// ascending, -1 padding, when want_chosen, else empty).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>>
graph_decode(std::vector<torch::Tensor> queries, std::vector<torch::Tensor> adjs,
             std::vector<torch::Tensor> entries, std::vector<torch::Tensor> rows,
             std::vector<torch::Tensor> kpools, std::vector<torch::Tensor> vpools,
             std::vector<std::vector<torch::Tensor>> steady_k,
             std::vector<std::vector<torch::Tensor>> steady_v, std::vector<int64_t> ks,
             std::vector<int64_t> budgets, int64_t ef, double scale, bool want_chosen) {
  const int64_t nb = static_cast<int64_t>(queries.size());
  RETRO_CHECK(adjs.size() == queries.size() && entries.size() == queries.size() &&
                  rows.size() == queries.size() && kpools.size() == queries.size() &&
                  vpools.size() == queries.size() && steady_k.size() == queries.size() &&
                  steady_v.size() == queries.size() && ks.size() == queries.size() &&
                  budgets.size() == queries.size(),
              "graph_decode: one of each argument per request");
  std::vector<int64_t> q0(nb + 1, 0), h0(nb + 1, 0);
  std::vector<torch::Tensor> ent(nb);
  int64_t d = 0;
  for (int64_t b = 0; b < nb; ++b) {
    check_pool(kpools[b], rows[b]);
    check_pool(vpools[b], rows[b]);
    d = kpools[b].size(1);
    RETRO_CHECK(queries[b].scalar_type() == at::kFloat && queries[b].is_contiguous() &&
                    queries[b].dim() == 2 && queries[b].size(1) == d,
                "graph_decode: queries must be contiguous [Hq, D] float32");
    RETRO_CHECK(kpools[b].scalar_type() == vpools[b].scalar_type(),
                "graph_decode: key and value pools differ in dtype");
    RETRO_CHECK(adjs[b].scalar_type() == at::kInt && adjs[b].is_contiguous() &&
                    adjs[b].dim() == 3 && adjs[b].size(1) >= rows[b].size(1),
                "graph_decode: adjacency must be a contiguous [G, >= N, W] int32 tensor");
    const int64_t hq = queries[b].size(0), hk = rows[b].size(0);
    RETRO_CHECK(hq % adjs[b].size(0) == 0 && hq % hk == 0 && adjs[b].size(0) % hk == 0,
                "graph_decode: query heads must be a multiple of graphs, graphs of KV heads");
    RETRO_CHECK(steady_k[b].size() == steady_v[b].size(), "graph_decode: steady pieces");
    for (size_t p = 0; p < steady_k[b].size(); ++p)
      RETRO_CHECK(steady_k[b][p].dim() == 3 && steady_k[b][p].size(0) == hk &&
                      steady_k[b][p].stride(2) == 1 && steady_v[b][p].stride(2) == 1 &&
                      steady_k[b][p].sizes() == steady_v[b][p].sizes() &&
                      steady_k[b][p].scalar_type() == kpools[b].scalar_type() &&
                      steady_v[b][p].scalar_type() == kpools[b].scalar_type(),
                  "graph_decode: steady pieces must be [Hk, n, D] in the pools' dtype, "
                  "last dim contiguous");
    ent[b] = entries[b].to(torch::kLong).contiguous();
    RETRO_CHECK(ent[b].dim() == 2 && ent[b].size(0) == adjs[b].size(0),
                "graph_decode: entries must be [G, E] per request");
    q0[b + 1] = q0[b] + hq;
    h0[b + 1] = h0[b] + hk;
  }
  auto out = torch::zeros({q0[nb], d}, torch::dtype(torch::kFloat));
  auto lse = torch::full({q0[nb]}, -std::numeric_limits<float>::infinity(),
                         torch::dtype(torch::kFloat));
  auto counts = torch::zeros({h0[nb]}, torch::dtype(torch::kLong));
  std::vector<std::vector<int32_t>> picked(h0[nb]);
  at::parallel_for(0, h0[nb], 1, [&](int64_t begin, int64_t end) {
    std::vector<std::vector<int32_t>> pools;
    std::vector<int32_t> chosen;
    std::vector<Online> heads;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = std::upper_bound(h0.begin(), h0.end(), t) - h0.begin() - 1;
      const int64_t h = t - h0[b];
      const auto& a = adjs[b];
      const int64_t hq = queries[b].size(0), hk = rows[b].size(0), ng = a.size(0);
      const int64_t g = hq / hk, n = rows[b].size(1), w = a.size(2);
      const float* qh = queries[b].data_ptr<float>() + h * g * d;  // the group's queries
      const float sc = static_cast<float>(scale);
      dispatch_dtype(kpools[b], [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        Keys<T> keys{kpools[b].data_ptr<T>(), rows[b].data_ptr<int64_t>() + h * n, d};
        const T* vbase = vpools[b].data_ptr<T>();
        const int64_t* vrows = rows[b].data_ptr<int64_t>() + h * n;
        const int64_t k = ks[b], budget = budgets[b];
        chosen.clear();
        if ((budget < 0 ? k : budget) >= n) {
          for (int64_t i = 0; i < n; ++i) chosen.push_back(static_cast<int32_t>(i));
        } else if ((budget < 0 ? k : budget) > 0) {
          pools.assign(g, {});
          const int64_t pool_ef = std::max(ef, budget < 0 ? k : budget);
          for (int64_t j = 0; j < g; ++j) {
            const int64_t qj = h * g + j, gi = qj / (hq / ng);
            const int64_t ne = ent[b].size(1);
            search(keys, a.data_ptr<int32_t>() + gi * a.size(1) * w, n, w,
                   ent[b].data_ptr<int64_t>() + gi * ne, ne, qh + j * d, pool_ef, -1,
                   tls_pool, nullptr);
            for (int64_t i = 0; i < tls_pool.size; ++i) pools[j].push_back(tls_pool.e[i].id);
          }
          choose(keys, pools, qh, g, budget < 0 ? k : budget, budget, sc, chosen);
        }
        // exact attention of the group's heads: steady pieces, then the chosen tokens
        heads.resize(g);
        for (int64_t j = 0; j < g; ++j) heads[j].reset(d);
        auto attend = [&](const T* kr, const T* vr) {
          for (int64_t j = 0; j < g; ++j) {
            const float p = heads[j].add(dot_qk(qh + j * d, kr, d) * sc);
            axpy(heads[j].acc.data(), p, vr, d);
          }
        };
        for (size_t pi = 0; pi < steady_k[b].size(); ++pi) {
          const auto& sk = steady_k[b][pi];
          const auto& sv = steady_v[b][pi];
          const T* kb = sk.data_ptr<T>() + h * sk.stride(0);
          const T* vb = sv.data_ptr<T>() + h * sv.stride(0);
          for (int64_t i = 0; i < sk.size(1); ++i)
            attend(kb + i * sk.stride(1), vb + i * sv.stride(1));
        }
        constexpr size_t ahead = 8;  // chosen rows are random: fetch a few ahead
        for (size_t c = 0; c < chosen.size(); ++c) {
          if (c + ahead < chosen.size()) {
            prefetch_row(keys.at(chosen[c + ahead]), d);
            prefetch_row(vbase + vrows[chosen[c + ahead]] * d, d);
          }
          attend(keys.at(chosen[c]), vbase + vrows[chosen[c]] * d);
        }
      });
      for (int64_t j = 0; j < g; ++j) {
        const int64_t row = q0[b] + h * g + j;
        if (heads[j].l > 0) {
          float* o = out.data_ptr<float>() + row * d;
          for (int64_t i = 0; i < d; ++i) o[i] = heads[j].acc[i] / heads[j].l;
          lse.data_ptr<float>()[row] = heads[j].m + std::log(heads[j].l);
        }
      }
      counts.data_ptr<int64_t>()[t] = static_cast<int64_t>(chosen.size());
      if (want_chosen) picked[t] = chosen;
    }
  });
  std::vector<torch::Tensor> sel;
  if (want_chosen)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t hk = h0[b + 1] - h0[b];
      size_t width = 0;
      for (int64_t h = 0; h < hk; ++h) width = std::max(width, picked[h0[b] + h].size());
      auto c = torch::full({hk, static_cast<int64_t>(width)}, -1, torch::dtype(torch::kLong));
      int64_t* cp = c.data_ptr<int64_t>();
      for (int64_t h = 0; h < hk; ++h)
        std::copy(picked[h0[b] + h].begin(), picked[h0[b] + h].end(), cp + h * width);
      sel.push_back(c);
    }
  return {out, lse, counts, sel};
}

