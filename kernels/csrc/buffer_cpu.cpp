// The wave buffer's host-side table work of one (request, layer) step, in one call each:
//
//   buffer_lookup: where every token of the step's retrieval clusters comes from (device
//     block or host page), written straight into the layer's gather plan as runs of
//     consecutive rows, plus the counts the buffer's statistics take; buffer_lookup_batch
//     does it for every store of a layer's step in one call, the stores in parallel (the
//     batched decode path's one lookup per layer step);
//   buffer_update_batch: the cache update of the step (the LRU / LFU stamps, evictions by
//     the policy's order, admissions within each KV head's block budget, the admission
//     copies' plan), on the mapping table's arrays in place, for every store of a layer's
//     step in one call (the worker's one job per layer step; a store alone is a batch of
//     one), the stores' own table work in parallel and their shared free stack in store
//     order.
//
// They are the functions of vllm_retro.buffer.mapping.ClusterMappingTable.lookup and
// WaveBufferStore.update (numpy, the reference; tests compare tables, block pools and plans
// step by step, bit for bit). In numpy each step is ~40 small array operations per request
// and layer (0.16 ms lookup + 0.29 ms update at 32K x 8 KV heads); here the loops touch only
// the step's clusters and the heads' cached clusters. Both run without the GIL, so the update
// (on the buffer's worker thread) does not hold up the decode thread's Python.
//
// Tables are shared with numpy (torch.from_numpy views): records [H, C, 8] int64, one
// 64-byte record per (KV head, cluster) holding page_start, n_pages, size, last_access, reads
// (vllm_retro.buffer.mapping.RECORD_FIELDS, in that order), and cached [H, C] bool.
// page_block [P] int64 is the layer's host page -> device block map (-1 none); the device
// block pool's free list is a stack (free_stack [num_blocks] int64, the first n_free[0]
// entries free, taken from the top).
#include <torch/extension.h>

#include "retro_check.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <cstdint>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

namespace {

template <typename T>
T* ptr(const torch::Tensor& t, const char* name, torch::ScalarType type) {
  RETRO_CHECK(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
              "buffer: ", name, " must be a contiguous CPU tensor of ", type);
  return t.data_ptr<T>();
}

// a cluster's record: its fields' positions (mapping.RECORD_FIELDS) and its width
constexpr int64_t kPageStart = 0, kPages = 1, kSize = 2, kLastAccess = 3, kReads = 4;
constexpr int64_t kWidth = 8;
// clusters ahead whose records the lookup prefetches
constexpr int64_t kAhead = 16;

void check_tables(const torch::Tensor& ids, const torch::Tensor& records,
                  const torch::Tensor& cached) {
  RETRO_CHECK(ids.dim() == 2, "buffer: ids must be [H, R]");
  const int64_t H = ids.size(0);
  RETRO_CHECK(records.dim() == 3 && records.size(0) == H && records.size(2) == kWidth,
              "buffer: records must be [", H, ", C, ", kWidth, "], got ", records.sizes());
  RETRO_CHECK(cached.dim() == 2 && cached.size(0) == H && cached.size(1) == records.size(1),
              "buffer: cached must be [H, C] as the records, got ", cached.sizes());
}

void check_ids(const int64_t* ids, int64_t n, int64_t C) {
  for (int64_t i = 0; i < n; ++i)
    RETRO_CHECK_VALUE(ids[i] >= 0 && ids[i] < C, "cluster id ", ids[i],
                      " is out of range; accepted: 0 to ", C - 1);
}

// One store's lookup (see buffer_lookup) into plan entries [at, cap): heads h = 0..H-1 of
// ids ([H, R] int64) go to execution-buffer rows row0 + h. Writes hit / begins ([H * R]),
// totals ([H]) and adds to counts ([4]); returns the entry after the last run written.
int64_t lookup_store(const int64_t* id, int64_t H, int64_t R, const int64_t* rec,
                     const bool* ca, int64_t C, const int64_t* pb, int64_t P,
                     int64_t page_size, int64_t* pl, int64_t at, int64_t cap, int64_t row0,
                     int64_t col0, int64_t t_cap, bool* ho, int64_t* bo, int64_t* to,
                     int64_t* co) {
  int64_t n_runs = at;
  for (int64_t h = 0; h < H; ++h) {
    int64_t slot = 0;
    int64_t* run = nullptr;  // the head's open run, extended while its rows continue
    int64_t next_src = -1;
    for (int64_t r = 0; r < R; ++r) {
      // the tables are cold (every layer's and request's are touched once per step): ask
      // for the clusters ahead (over all heads), records first, then a cached cluster's
      // device blocks
      const int64_t f = h * R + r;
      if (f + kAhead < H * R) {
        const int64_t k2 = (f + kAhead) / R * C + id[f + kAhead];
        __builtin_prefetch(rec + k2 * kWidth);
        __builtin_prefetch(ca + k2);
      }
      if (f + kAhead / 2 < H * R) {
        const int64_t k2 = (f + kAhead / 2) / R * C + id[f + kAhead / 2];
        if (ca[k2]) __builtin_prefetch(pb + rec[k2 * kWidth + kPageStart]);
      }
      const int64_t c = id[h * R + r], k = h * C + c;
      const int64_t* cr = rec + k * kWidth;
      const int64_t n = cr[kSize];
      ho[h * R + r] = ca[k];
      bo[h * R + r] = slot;
      co[2] += ca[k];
      if (!ca[k]) co[3] += cr[kPages];
      RETRO_CHECK(col0 + slot + n <= t_cap, "buffer: the execution buffer has ", t_cap,
                  " slots, the step's tokens need ", col0 + slot + n);
      const int64_t first = cr[kPageStart];
      RETRO_CHECK(first >= 0 && first + cr[kPages] <= P && cr[kPages] * page_size >= n,
                  "buffer: cluster ", c, " of head ", h, " lies outside the host pool");
      // page by page (a cluster starts on a page boundary): no division per token
      // (a cluster not cached has no page mapped: its rows are host rows, unread)
      for (int64_t i0 = 0, page = first; i0 < n; i0 += page_size, ++page) {
        const int64_t block = ca[k] ? pb[page] : -1, m = std::min(page_size, n - i0);
        const int64_t sign = block >= 0 ? 1 : -1;
        const int64_t base = block >= 0 ? block * page_size : page * page_size;
        if (run != nullptr && base == next_src && (run[2] > 0) == (sign > 0)) {
          run[2] += sign * m;
        } else {
          RETRO_CHECK(n_runs < cap, "buffer: the gather plan has room for ", cap, " runs");
          run = pl + 3 * n_runs++;
          run[0] = (row0 + h) * t_cap + col0 + slot + i0;
          run[1] = base;
          run[2] = sign * m;
        }
        next_src = base + m;
        co[block >= 0 ? 0 : 1] += m;
      }
      slot += n;
    }
    to[h] = slot;
  }
  return n_runs;
}

void check_place(const torch::Tensor& plan, int64_t at, int64_t row0, int64_t col0,
                 int64_t t_cap, int64_t page_size) {
  RETRO_CHECK(plan.dim() == 2 && plan.size(1) == 3, "buffer: the gather plan must be [N, 3]");
  RETRO_CHECK(at >= 0 && at <= plan.size(0) && row0 >= 0 && col0 >= 0 && col0 <= t_cap,
              "buffer: the gather plan's place (at ", at, ", row0 ", row0, ", col0 ", col0,
              ", t_cap ", t_cap, ")");
  RETRO_CHECK(page_size > 0, "buffer: page_size ", page_size, "; accepted: >= 1");
}

}  // namespace

// Locate every token of the clusters ids[h, :] ([H, R] int64), in order, for KV head h, and
// write them into a layer's gather plan (kernels/gather.py) as runs from entry `at` of plan
// ([N, 3] int64): (destination row (row0 + h) * t_cap + col0 + slot, source row, signed
// count: > 0 device-pool rows of cached pages, < 0 host-pool rows), one run per maximal
// stretch of a head's consecutive slots whose source rows are consecutive in one pool (a
// missed cluster is one run: its pages are consecutive; a cached one, one per stretch of
// consecutive blocks). Returns (cached [H, R] bool: the cluster is cached, begins [H, R]
// int64: its first slot among the head's tokens, totals [H] int64: tokens per head, counts
// [4] int64: hit tokens, miss tokens, cached clusters, host pages of the clusters not
// cached, and the number of runs written).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t> buffer_lookup(
    torch::Tensor ids, torch::Tensor records, torch::Tensor cached, torch::Tensor page_block,
    int64_t page_size, torch::Tensor plan, int64_t at, int64_t row0, int64_t col0,
    int64_t t_cap) {
  check_tables(ids, records, cached);
  const int64_t H = ids.size(0), R = ids.size(1), C = records.size(1);
  const int64_t* id = ptr<int64_t>(ids, "ids", torch::kInt64);
  const int64_t* rec = ptr<int64_t>(records, "records", torch::kInt64);
  const bool* ca = ptr<bool>(cached, "cached", torch::kBool);
  const int64_t* pb = ptr<int64_t>(page_block, "page_block", torch::kInt64);
  int64_t* pl = ptr<int64_t>(plan, "plan", torch::kInt64);
  check_place(plan, at, row0, col0, t_cap, page_size);
  check_ids(id, H * R, C);
  auto hit = torch::empty({H, R}, torch::kBool);
  auto begins = torch::empty({H, R}, torch::kInt64);
  auto totals = torch::empty({H}, torch::kInt64);
  auto counts = torch::zeros({4}, torch::kInt64);
  const int64_t end = lookup_store(id, H, R, rec, ca, C, pb, page_block.numel(), page_size, pl,
                                   at, plan.size(0), row0, col0, t_cap, hit.data_ptr<bool>(),
                                   begins.data_ptr<int64_t>(), totals.data_ptr<int64_t>(),
                                   counts.data_ptr<int64_t>());
  return {hit, begins, totals, counts, end - at};
}

// buffer_lookup for every store of a layer's step in one call: store j's ids[j] ([H, R_j]
// int64; every store has H heads) over its tables records[j] / cached[j], all in one host
// pool (page_block), its head h going to execution-buffer row j * H + h from slot col0[j].
// The stores are looked up in parallel (on `threads` OpenMP threads), store j writing its runs
// into its own region of plan (entries from j * H * t_cap: a head's runs are at most its
// slots), then the regions are closed up so that the plan's first sum(n_runs) entries hold
// every store's runs in store order. Returns (cached [sum_j H * R_j] bool and begins (same)
// int64, store after store, each store's [H, R_j] row-major; totals [B, H] int64; counts
// [B, 4] int64; n_runs [B] int64).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
buffer_lookup_batch(std::vector<torch::Tensor> ids, std::vector<torch::Tensor> records,
                    std::vector<torch::Tensor> cached, torch::Tensor page_block,
                    int64_t page_size, torch::Tensor plan, std::vector<int64_t> col0,
                    int64_t t_cap, int64_t threads) {
  const int64_t B = int64_t(ids.size());
  RETRO_CHECK(threads >= 1, "buffer: threads ", threads, "; accepted: >= 1");
  RETRO_CHECK(int64_t(records.size()) == B && int64_t(cached.size()) == B &&
                  int64_t(col0.size()) == B,
              "buffer: ids, records, cached and col0 must have one entry per store, got ", B,
              ", ", records.size(), ", ", cached.size(), ", ", col0.size());
  const int64_t H = B && ids[0].dim() == 2 ? ids[0].size(0) : 0;
  std::vector<int64_t> first(B + 1, 0);  // store j's cached / begins from first[j]
  for (int64_t j = 0; j < B; ++j) {
    RETRO_CHECK(ids[j].dim() == 2 && ids[j].size(0) == H, "buffer: store ", j, "'s ids are ",
                ids[j].sizes(), "; every store has store 0's ", H, " heads");
    check_tables(ids[j], records[j], cached[j]);
    ptr<int64_t>(ids[j], "ids", torch::kInt64);
    ptr<int64_t>(records[j], "records", torch::kInt64);
    ptr<bool>(cached[j], "cached", torch::kBool);
    check_ids(ids[j].data_ptr<int64_t>(), ids[j].numel(), records[j].size(1));
    check_place(plan, 0, j * H, col0[j], t_cap, page_size);
    first[j + 1] = first[j] + ids[j].numel();
  }
  const int64_t* pb = ptr<int64_t>(page_block, "page_block", torch::kInt64);
  int64_t* pl = ptr<int64_t>(plan, "plan", torch::kInt64);
  const int64_t region = H * t_cap;
  RETRO_CHECK(plan.size(0) >= B * region, "buffer: the gather plan has room for ",
              plan.size(0), " runs, the batch needs room for ", B * region);
  auto hit = torch::empty({first[B]}, torch::kBool);
  auto begins = torch::empty({first[B]}, torch::kInt64);
  auto totals = torch::empty({B, H}, torch::kInt64);
  auto counts = torch::zeros({B, 4}, torch::kInt64);
  auto n_runs = torch::empty({B}, torch::kInt64);
  bool* ho = hit.data_ptr<bool>();
  int64_t* bo = begins.data_ptr<int64_t>();
  int64_t* to = totals.data_ptr<int64_t>();
  int64_t* co = counts.data_ptr<int64_t>();
  int64_t* no = n_runs.data_ptr<int64_t>();
  const int64_t P = page_block.numel();
  // an OpenMP team of its own (torch's intra-op threads may be 1 while serving); a store's
  // error is rethrown after the team, the first store's first, as a loop would
  std::vector<std::exception_ptr> errors(B);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && B > 1)
  for (int64_t j = 0; j < B; ++j) {
    try {
      const auto& rj = records[j];
      const int64_t end = lookup_store(
          ids[j].data_ptr<int64_t>(), H, ids[j].size(1), rj.data_ptr<int64_t>(),
          cached[j].data_ptr<bool>(), rj.size(1), pb, P, page_size, pl, j * region,
          (j + 1) * region, j * H, col0[j], t_cap, ho + first[j], bo + first[j], to + j * H,
          co + 4 * j);
      no[j] = end - j * region;
    } catch (...) {
      errors[j] = std::current_exception();
    }
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  // close the regions up (store order; each region moves down, never past the next one)
  int64_t at = no[0];
  for (int64_t j = 1; j < B; ++j) {
    std::memmove(pl + 3 * at, pl + 3 * j * region, sizeof(int64_t) * 3 * no[j]);
    at += no[j];
  }
  return {hit, begins, totals, counts, n_runs};
}

namespace {

// One store's update step: its arguments, checked (see buffer_update_batch).
struct UpdateStep {
  const int64_t* id;
  const bool* hi;
  const int64_t* be;
  int64_t* rec;
  bool* ca;
  const int64_t* cap;
  int64_t H, R, C, n_steady, clock;
  // field f of cluster c of head h
  int64_t& F(int64_t h, int64_t c, int64_t f) const { return rec[(h * C + c) * kWidth + f]; }
};

// What the first phase decided: the pages each read wants admitted (need, [H * R], 0: none),
// in all `total` blocks, the plan's `entries` (one per admitted page); the blocks its
// evictions gave back, in order.
struct UpdateDecision {
  std::vector<int64_t> need, given;
  int64_t total = 0, entries = 0, evicted = 0;
};

UpdateStep update_step(const torch::Tensor& ids, const torch::Tensor& hit,
                       const torch::Tensor& begins, int64_t n_steady, int64_t clock,
                       const torch::Tensor& records, const torch::Tensor& cached,
                       const torch::Tensor& capacity) {
  check_tables(ids, records, cached);
  const int64_t H = ids.size(0), R = ids.size(1), C = records.size(1);
  RETRO_CHECK(hit.sizes() == ids.sizes() && begins.sizes() == ids.sizes() &&
                  capacity.numel() == H, "buffer: update shapes");
  UpdateStep st{ptr<int64_t>(ids, "ids", torch::kInt64), ptr<bool>(hit, "hit", torch::kBool),
                ptr<int64_t>(begins, "begins", torch::kInt64),
                ptr<int64_t>(records, "records", torch::kInt64),
                ptr<bool>(cached, "cached", torch::kBool),
                ptr<int64_t>(capacity, "capacity", torch::kInt64), H, R, C, n_steady, clock};
  check_ids(st.id, H * R, C);
  return st;
}

// Phase 1 (touches only the store's own tables and its own pages' entries of pb): stamp the
// reads, decide each head's admissions and evict for them, unmapping the evicted pages.
UpdateDecision update_decide(const UpdateStep& s, int64_t* pb, int64_t P, int64_t page_size,
                             int64_t policy) {
  const int64_t H = s.H, R = s.R, C = s.C;
  const int64_t* id = s.id;
  const bool* hi = s.hi;
  bool* ca = s.ca;
  const int64_t* cap = s.cap;
  auto F = [&](int64_t h, int64_t c, int64_t f) -> int64_t& { return s.F(h, c, f); };
  UpdateDecision d;

  // the stamps, as numpy's fancy assignment makes them (every value from the old table,
  // the last of repeated ids wins)
  std::vector<int64_t> new_reads(R);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t* ih = id + h * R;
    for (int64_t r = 0; r < R; ++r) new_reads[r] = F(h, ih[r], kReads) + hi[h * R + r];
    for (int64_t r = 0; r < R; ++r) {
      F(h, ih[r], kLastAccess) = s.clock + 1 + r;
      F(h, ih[r], kReads) = new_reads[r];
    }
  }
  // each head's cached clusters (ascending ids; head h's from held_from[h]): found by a
  // scan of the flags, then their records read with the ones kAhead further asked for (the
  // records are cold and scattered: one line per cached cluster)
  std::vector<int64_t> held_ids, held_from(H + 1, 0);
  for (int64_t h = 0; h < H; ++h) {
    held_from[h] = int64_t(held_ids.size());
    const bool* row = ca + h * C;
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {  // 8 flags (bytes 0 / 1) at a time: most words are all 0
      uint64_t w;
      std::memcpy(&w, row + c, 8);
      for (; w != 0; w &= w - 1) held_ids.push_back(c + __builtin_ctzll(w) / 8);
    }
    for (; c < C; ++c)
      if (row[c]) held_ids.push_back(c);
  }
  held_from[H] = int64_t(held_ids.size());

  // what each head wants: its misses that fit its budget at all, in read order
  std::vector<int64_t>& need = d.need;
  need.assign(H * R, 0);
  std::vector<int64_t> room(H), want(H, 0);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = F(h, id[h * R + r], kPages);
      if (!hi[h * R + r] && n > 0 && n <= cap[h]) need[h * R + r] = n;
      want[h] += need[h * R + r];
    }
    int64_t held = 0;
    for (int64_t i = held_from[h]; i < held_from[h + 1]; ++i) {
      if (i + kAhead < held_from[h + 1]) __builtin_prefetch(&F(h, held_ids[i + kAhead], 0));
      held += F(h, held_ids[i], kPages);
    }
    room[h] = cap[h] - held;
  }

  // evictions, head by head in head order, each head's in the policy's order: the unread
  // cached clusters' sort keys are copied out (their records are warm from the scan above)
  // into a min-heap, popped only until the deficit is freed (a few of hundreds, usually)
  struct Victim {
    int64_t first, second, c;  // LRU: (last access, 0); LFU: (reads, last access); then id
    bool operator>(const Victim& o) const {
      if (first != o.first) return first > o.first;
      return second != o.second ? second > o.second : c > o.c;
    }
  };
  std::vector<char> read_now(C);
  std::vector<Victim> heap;
  std::vector<int64_t>& given = d.given;
  for (int64_t h = 0; h < H; ++h) {
    if (want[h] <= room[h]) continue;
    std::fill(read_now.begin(), read_now.end(), 0);
    for (int64_t r = 0; r < R; ++r) read_now[id[h * R + r]] = 1;
    heap.clear();
    int64_t evictable = 0;
    for (int64_t i = held_from[h]; i < held_from[h + 1]; ++i) {
      const int64_t c = held_ids[i];
      if (read_now[c]) continue;
      evictable += F(h, c, kPages);
      const int64_t last = F(h, c, kLastAccess);
      heap.push_back(policy == 0 ? Victim{last, 0, c} : Victim{F(h, c, kReads), last, c});
    }
    const int64_t budget = room[h] + evictable;
    if (want[h] > budget) {  // admit greedily in read order: each miss that still fits
      int64_t used = 0;
      for (int64_t r = 0; r < R; ++r) {
        int64_t& n = need[h * R + r];
        if (n == 0) continue;
        if (used + n <= budget) used += n;
        else n = 0;
      }
      want[h] = used;
    }
    const int64_t deficit = want[h] - room[h];
    if (deficit <= 0) continue;
    std::make_heap(heap.begin(), heap.end(), std::greater<Victim>());
    int64_t freed = 0;
    while (freed < deficit && !heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<Victim>());
      const int64_t c = heap.back().c;
      heap.pop_back();
      const int64_t first = F(h, c, kPageStart), pages = F(h, c, kPages);
      for (int64_t p = first; p < first + pages; ++p) {
        RETRO_CHECK(p < P && pb[p] >= 0, "buffer: cached cluster ", c, " of head ", h,
                    " has an unmapped page ", p);
        given.push_back(pb[p]);
        pb[p] = -1;
      }
      ca[h * C + c] = false;
      F(h, c, kReads) = 0;
      freed += pages;
    }
    d.evicted += freed;
  }
  d.total = std::accumulate(need.begin(), need.end(), int64_t{0});
  for (int64_t i = 0; i < H * R; ++i)
    if (need[i]) d.entries += (F(i / R, id[i], kSize) + page_size - 1) / page_size;
  return d;
}

// The free stack's part (serial: the stores share it): give the evicted blocks back, then
// take the admissions' blocks off the top (copied out: a later store's evictions overwrite
// the stack above n_free).
std::vector<int64_t> update_take(const UpdateDecision& d, int64_t* fs, int64_t* nf,
                                 int64_t stack_cap) {
  RETRO_CHECK(nf[0] + int64_t(d.given.size()) <= stack_cap, "buffer: the free list overflows (",
              nf[0], " + ", d.given.size(), " blocks, ", stack_cap, " in the pool)");
  std::copy(d.given.begin(), d.given.end(), fs + nf[0]);
  nf[0] += int64_t(d.given.size());
  RETRO_CHECK(d.total <= nf[0], "device block pool: ", d.total, " blocks asked, ", nf[0],
              " free (budgets overcommitted)");
  std::vector<int64_t> blocks(fs + nf[0] - d.total, fs + nf[0]);
  nf[0] -= d.total;
  return blocks;
}

// Phase 3 (the store's own tables and pages again): map the admitted clusters' pages to
// `blocks` (head-major, read order) and write the copies' plan (d.entries entries each: one
// per page, its first slot and first device row, and its tokens).
void update_admit(const UpdateStep& s, const UpdateDecision& d, const int64_t* blocks,
                  int64_t* pb, int64_t page_size, int64_t* ho, int64_t* so, int64_t* ro,
                  int64_t* co) {
  const int64_t H = s.H, R = s.R;
  int64_t b = 0, t = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = d.need[h * R + r];
      if (n == 0) continue;
      const int64_t c = s.id[h * R + r];
      for (int64_t p = 0; p < n; ++p) pb[s.F(h, c, kPageStart) + p] = blocks[b + p];
      s.ca[h * s.C + c] = true;
      s.F(h, c, kReads) = 1;
      const int64_t size = s.F(h, c, kSize), slot0 = s.n_steady + s.be[h * R + r];
      for (int64_t i0 = 0, p = 0; i0 < size; i0 += page_size, ++p, ++t) {
        ho[t] = h;
        so[t] = slot0 + i0;
        ro[t] = blocks[b + p] * page_size;
        co[t] = std::min(page_size, size - i0);
      }
      b += n;
    }
}

void check_update_args(int64_t policy, int64_t page_size) {
  RETRO_CHECK(policy == 0 || policy == 1, "buffer: policy ", policy,
              "; accepted: 0 (lru), 1 (lfu)");
  RETRO_CHECK(page_size > 0, "buffer: page_size ", page_size, "; accepted: >= 1");
}

}  // namespace

// The cache updates of every store of a layer's step in one call (the worker's one job per
// layer step; a store alone is a batch of one). Each store's update (see
// WaveBufferStore.update, the numpy reference): stamp the reads (last_access = clock + 1 + r
// in read order, reads += 1 for cached clusters), then per KV head admit the clusters not
// cached that fit its budget capacity[h] (evicting unread cached clusters by the policy's
// order: 0 LRU (oldest stamp first), 1 LFU (fewest reads, then oldest); ties by cluster id;
// admitting greedily in read order when even evicting everything evictable is short), taking
// device blocks off the free stack after the evicted ones went back on it; its plan of the
// admission copies has one entry per admitted page (head-major, read order): (KV head, first
// execution-buffer slot n_steady + begins[h, r] + i0, first device-pool row, tokens).
//
// The result is that of updating the stores one after another in store order: store j's
// arguments are entry j of each list, all in one host pool (page_block) and one device block
// pool (free_stack, n_free). The first and last phases (stamps, evictions; the admissions'
// mapping and plan) touch only a store's own tables and pages and run in parallel on
// `threads` OpenMP threads; between them the free stack is given and taken in store order.
// A store that fails does not stop the others (as separate updates): its error is returned
// in its place (error_kinds[j]: 0 none, 1 a bad value, 2 another error; errors[j] the
// message) and it returns empty plans. Returns (heads, slots, rows, counts: each store's
// plan, admitted [B] and evicted [B] pages, error_kinds [B], errors).
std::tuple<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
           std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor,
           std::vector<std::string>>
buffer_update_batch(std::vector<torch::Tensor> ids, std::vector<torch::Tensor> hit,
                    std::vector<torch::Tensor> begins, std::vector<int64_t> n_steady,
                    std::vector<int64_t> clock, std::vector<torch::Tensor> records,
                    std::vector<torch::Tensor> cached, std::vector<torch::Tensor> capacity,
                    torch::Tensor page_block, int64_t page_size, torch::Tensor free_stack,
                    torch::Tensor n_free, int64_t policy, int64_t threads) {
  const int64_t B = int64_t(ids.size());
  RETRO_CHECK(threads >= 1, "buffer: threads ", threads, "; accepted: >= 1");
  for (const size_t n : {hit.size(), begins.size(), n_steady.size(), clock.size(),
                         records.size(), cached.size(), capacity.size()})
    RETRO_CHECK(int64_t(n) == B, "buffer: every argument list needs one entry per store (", B,
                "), got ", n);
  check_update_args(policy, page_size);
  RETRO_CHECK(n_free.numel() == 1, "buffer: update shapes");
  int64_t* pb = ptr<int64_t>(page_block, "page_block", torch::kInt64);
  int64_t* fs = ptr<int64_t>(free_stack, "free_stack", torch::kInt64);
  int64_t* nf = ptr<int64_t>(n_free, "n_free", torch::kInt64);
  const int64_t P = page_block.numel();
  std::vector<UpdateStep> steps(B);
  std::vector<UpdateDecision> dec(B);
  std::vector<std::vector<int64_t>> blocks(B);
  auto kinds = torch::zeros({B}, torch::kInt64);
  int64_t* kind = kinds.data_ptr<int64_t>();
  std::vector<std::string> errors(B);
  auto guarded = [&](int64_t j, auto&& fn) {  // a store's error, kept in its place
    if (kind[j]) return;
    try {
      fn();
    } catch (const c10::ValueError& e) {
      kind[j] = 1;
      errors[j] = e.what_without_backtrace();
    } catch (const std::invalid_argument& e) {  // RETRO_CHECK_VALUE
      kind[j] = 1;
      errors[j] = e.what();
    } catch (const c10::Error& e) {
      kind[j] = 2;
      errors[j] = e.what_without_backtrace();
    } catch (const std::exception& e) {
      kind[j] = 2;
      errors[j] = e.what();
    }
  };
  for (int64_t j = 0; j < B; ++j)
    guarded(j, [&] {
      steps[j] = update_step(ids[j], hit[j], begins[j], n_steady[j], clock[j], records[j],
                             cached[j], capacity[j]);
    });
  std::vector<torch::Tensor> heads(B), slots(B), rows(B), counts(B);
  auto admitted = torch::zeros({B}, torch::kInt64);
  auto evicted = torch::zeros({B}, torch::kInt64);
  auto plan_outputs = [&](int64_t j) {  // store j's plan tensors and counts
    const int64_t n = kind[j] ? 0 : dec[j].entries;
    heads[j] = torch::empty({n}, torch::kInt64);
    slots[j] = torch::empty({n}, torch::kInt64);
    rows[j] = torch::empty({n}, torch::kInt64);
    counts[j] = torch::empty({n}, torch::kInt64);
    if (!kind[j]) {
      admitted.data_ptr<int64_t>()[j] = dec[j].total;
      evicted.data_ptr<int64_t>()[j] = dec[j].evicted;
    }
  };
  auto decide = [&](int64_t j) {
    guarded(j, [&] { dec[j] = update_decide(steps[j], pb, P, page_size, policy); });
  };
  auto take = [&](int64_t j) {
    guarded(j, [&] { blocks[j] = update_take(dec[j], fs, nf, free_stack.numel()); });
  };
  auto admit = [&](int64_t j) {
    guarded(j, [&] {
      update_admit(steps[j], dec[j], blocks[j].data(), pb, page_size,
                   heads[j].data_ptr<int64_t>(), slots[j].data_ptr<int64_t>(),
                   rows[j].data_ptr<int64_t>(), counts[j].data_ptr<int64_t>());
    });
  };
  if (threads == 1 || B == 1) {  // one store after another, each while its tables are warm
    for (int64_t j = 0; j < B; ++j) {
      decide(j);
      take(j);
      plan_outputs(j);
      admit(j);
    }
  } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t j = 0; j < B; ++j) decide(j);
    for (int64_t j = 0; j < B; ++j) {
      take(j);
      plan_outputs(j);
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t j = 0; j < B; ++j) admit(j);
  }
  return {heads, slots, rows, counts, admitted, evicted, kinds, errors};
}
