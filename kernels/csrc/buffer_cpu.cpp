// The wave buffer's host-side table work of one layer step, in one call: where every token
// of the step's retrieval clusters lies in the layer's host pool, written straight into the
// layer's gather plan as runs (buffer_lookup for one store; buffer_lookup_batch for every
// store of a layer's step, the stores in parallel: the batched decode path's one lookup per
// layer step). These are the functions of vllm_retro.buffer.mapping.ClusterMappingTable.lookup
// (numpy, the reference; tests compare the plans bit for bit). They run without the GIL.
//
// Tables are shared with numpy (torch.from_numpy views): records [H, C, 8] int64, one
// 64-byte record per (KV head, cluster) holding page_start, n_pages, size
// (vllm_retro.buffer.mapping.RECORD_FIELDS, in that order). A cluster's pages are consecutive
// in the host pool, so each cluster is one run.

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
constexpr int64_t kPageStart = 0, kPages = 1, kSize = 2;
constexpr int64_t kWidth = 8;
// clusters ahead whose records the lookup prefetches
constexpr int64_t kAhead = 16;

void check_tables(const torch::Tensor& ids, const torch::Tensor& records) {
  RETRO_CHECK(ids.dim() == 2, "buffer: ids must be [H, R]");
  const int64_t H = ids.size(0);
  RETRO_CHECK(records.dim() == 3 && records.size(0) == H && records.size(2) == kWidth,
              "buffer: records must be [", H, ", C, ", kWidth, "], got ", records.sizes());
}

void check_ids(const int64_t* ids, int64_t n, int64_t C) {
  for (int64_t i = 0; i < n; ++i)
    RETRO_CHECK_VALUE(ids[i] >= 0 && ids[i] < C, "cluster id ", ids[i],
                      " is out of range; accepted: 0 to ", C - 1);
}

// One store's lookup (see buffer_lookup) into plan entries [at, cap): heads h = 0..H-1 of
// ids ([H, R] int64) go to execution-buffer rows row0 + h. Writes begins ([H * R]), totals
// ([H]) and adds to counts ([2]); returns the entry after the last run written.
int64_t lookup_store(const int64_t* id, int64_t H, int64_t R, const int64_t* rec, int64_t C,
                     int64_t P, int64_t page_size, int64_t* pl, int64_t at, int64_t cap,
                     int64_t row0, int64_t col0, int64_t t_cap, int64_t* bo, int64_t* to,
                     int64_t* co) {
  int64_t n_runs = at;
  for (int64_t h = 0; h < H; ++h) {
    int64_t slot = 0;
    int64_t* run = nullptr;  // the head's open run, extended while its rows continue
    int64_t next_src = -1;
    for (int64_t r = 0; r < R; ++r) {
      // the tables are cold (every layer's and request's are touched once per step): ask
      // for the records of the clusters ahead (over all heads)
      const int64_t f = h * R + r;
      if (f + kAhead < H * R)
        __builtin_prefetch(rec + ((f + kAhead) / R * C + id[f + kAhead]) * kWidth);
      const int64_t c = id[f];
      const int64_t* cr = rec + (h * C + c) * kWidth;
      const int64_t n = cr[kSize];
      bo[f] = slot;
      co[1] += cr[kPages];
      RETRO_CHECK(col0 + slot + n <= t_cap, "buffer: the execution buffer has ", t_cap,
                  " slots, the step's tokens need ", col0 + slot + n);
      const int64_t first = cr[kPageStart];
      RETRO_CHECK(first >= 0 && first + cr[kPages] <= P && cr[kPages] * page_size >= n,
                  "buffer: cluster ", c, " of head ", h, " lies outside the host pool");
      const int64_t base = first * page_size;
      if (n > 0) {
        if (run != nullptr && base == next_src) {
          run[2] -= n;
        } else {
          RETRO_CHECK(n_runs < cap, "buffer: the gather plan has room for ", cap, " runs");
          run = pl + 3 * n_runs++;
          run[0] = (row0 + h) * t_cap + col0 + slot;
          run[1] = base;
          run[2] = -n;
        }
        next_src = base + n;
      }
      co[0] += n;
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

// Locate every token of the clusters ids[h, :] ([H, R] int64), in order, for KV head h, in
// a host pool of `pages` pages, and write them into a layer's gather plan (kernels/gather.py)
// as runs from entry `at` of plan ([N, 3] int64): (destination row (row0 + h) * t_cap + col0
// + slot, first host-pool row, -count), one run per maximal stretch of a head's consecutive
// slots whose source rows are consecutive (at least one per cluster: its pages are
// consecutive). Returns (begins [H, R] int64: each cluster's first slot among the head's
// tokens, totals [H] int64: tokens per head, counts [2] int64: tokens read, host pages of the
// clusters read, and the number of runs written).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t> buffer_lookup(
    torch::Tensor ids, torch::Tensor records, int64_t pages, int64_t page_size,
    torch::Tensor plan, int64_t at, int64_t row0, int64_t col0, int64_t t_cap) {
  check_tables(ids, records);
  const int64_t H = ids.size(0), R = ids.size(1), C = records.size(1);
  const int64_t* id = ptr<int64_t>(ids, "ids", torch::kInt64);
  const int64_t* rec = ptr<int64_t>(records, "records", torch::kInt64);
  int64_t* pl = ptr<int64_t>(plan, "plan", torch::kInt64);
  check_place(plan, at, row0, col0, t_cap, page_size);
  check_ids(id, H * R, C);
  auto begins = torch::empty({H, R}, torch::kInt64);
  auto totals = torch::empty({H}, torch::kInt64);
  auto counts = torch::zeros({2}, torch::kInt64);
  const int64_t end = lookup_store(id, H, R, rec, C, pages, page_size, pl, at, plan.size(0),
                                   row0, col0, t_cap, begins.data_ptr<int64_t>(),
                                   totals.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  return {begins, totals, counts, end - at};
}

// buffer_lookup for every store of a layer's step in one call: store j's ids[j] ([H, R_j]
// int64; every store has H heads) over its table records[j], all in one host pool of
// `pages` pages, its head h going to execution-buffer row j * H + h from slot col0[j]. The
// stores are looked up in parallel (on `threads` OpenMP threads), store j writing its runs
// into its own region of plan (entries from j * H * t_cap: a head's runs are at most its
// slots), then the regions are closed up so that the plan's first sum(n_runs) entries hold
// every store's runs in store order. Returns (begins [sum_j H * R_j] int64, store after
// store, each store's [H, R_j] row-major; totals [B, H] int64; counts [B, 2] int64; n_runs
// [B] int64).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> buffer_lookup_batch(
    std::vector<torch::Tensor> ids, std::vector<torch::Tensor> records, int64_t pages,
    int64_t page_size, torch::Tensor plan, std::vector<int64_t> col0, int64_t t_cap,
    int64_t threads) {
  const int64_t B = int64_t(ids.size());
  RETRO_CHECK(threads >= 1, "buffer: threads ", threads, "; accepted: >= 1");
  RETRO_CHECK(int64_t(records.size()) == B && int64_t(col0.size()) == B,
              "buffer: ids, records and col0 must have one entry per store, got ", B, ", ",
              records.size(), ", ", col0.size());
  const int64_t H = B && ids[0].dim() == 2 ? ids[0].size(0) : 0;
  std::vector<int64_t> first(B + 1, 0);  // store j's begins from first[j]
  for (int64_t j = 0; j < B; ++j) {
    RETRO_CHECK(ids[j].dim() == 2 && ids[j].size(0) == H, "buffer: store ", j, "'s ids are ",
                ids[j].sizes(), "; every store has store 0's ", H, " heads");
    check_tables(ids[j], records[j]);
    ptr<int64_t>(ids[j], "ids", torch::kInt64);
    ptr<int64_t>(records[j], "records", torch::kInt64);
    check_ids(ids[j].data_ptr<int64_t>(), ids[j].numel(), records[j].size(1));
    check_place(plan, 0, j * H, col0[j], t_cap, page_size);
    first[j + 1] = first[j] + ids[j].numel();
  }
  int64_t* pl = ptr<int64_t>(plan, "plan", torch::kInt64);
  const int64_t region = H * t_cap;
  RETRO_CHECK(plan.size(0) >= B * region, "buffer: the gather plan has room for ",
              plan.size(0), " runs, the batch needs room for ", B * region);
  auto begins = torch::empty({first[B]}, torch::kInt64);
  auto totals = torch::empty({B, H}, torch::kInt64);
  auto counts = torch::zeros({B, 2}, torch::kInt64);
  auto n_runs = torch::empty({B}, torch::kInt64);
  int64_t* bo = begins.data_ptr<int64_t>();
  int64_t* to = totals.data_ptr<int64_t>();
  int64_t* co = counts.data_ptr<int64_t>();
  int64_t* no = n_runs.data_ptr<int64_t>();
  // an OpenMP team of its own (torch's intra-op threads may be 1 while serving); a store's
  // error is rethrown after the team, the first store's first, as a loop would
  std::vector<std::exception_ptr> errors(B);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && B > 1)
  for (int64_t j = 0; j < B; ++j) {
    try {
      const auto& rj = records[j];
      const int64_t end = lookup_store(ids[j].data_ptr<int64_t>(), H, ids[j].size(1),
                                       rj.data_ptr<int64_t>(), rj.size(1), pages, page_size,
                                       pl, j * region, (j + 1) * region, j * H, col0[j], t_cap,
                                       bo + first[j], to + j * H, co + 2 * j);
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
  return {begins, totals, counts, n_runs};
}
