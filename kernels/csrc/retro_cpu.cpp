// Fused tripartite decode of one attention layer for a whole batch of indexed rows, on CPU.
//
// One call per layer and step: for every (request row b, KV head h) pair, in parallel:
//   1. cluster scoring: logit[g, c] = scale * q_g . C_c for the G query heads of the group,
//      score[c] = log(sum_g softmax_c(logit[g])[c]) (-inf for empty clusters);
//   2. selection: the top (r_b + e_b) clusters by score, the first r_b retrieved exactly, the
//      next e_b estimated;
//   3. attention with one online softmax (fp32) over the steady zone (sinks, window), the
//      retrieval clusters' tokens read in place (cluster-contiguous rows of the row's KV pool)
//      and the estimated clusters as pseudo-tokens (log(size) bias, mean value, optionally
//      the tilted estimator's mass and value corrections).
// The plain-torch reference of the same computation is kernels.cpu_decode.decode_rows_ref.
// Each row's state is passed as its own tensors (no copies into a padded batch); rows may
// differ in cluster count, steady-zone length and budgets.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTile = 32;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Row view of a [H, n, D] (or [rows, D] with head stride) tensor of scalar type T.
template <typename T>
struct Rows {
  const T* base = nullptr;
  int64_t head_stride = 0;  // elements
  int64_t row_stride = 0;   // elements
  const T* row(int64_t h, int64_t i) const { return base + h * head_stride + i * row_stride; }
};

template <typename T>
Rows<T> rows3(const torch::Tensor& t) {  // [H, n, D]
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, "retro_cpu: expected [H, n, D] rows, D contiguous");
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

double log_ndtr(double x) {
  const double t = x * M_SQRT1_2;
  if (x > 6.0) return std::log1p(-0.5 * std::erfc(t));
  if (x > -20.0) return std::log(0.5 * std::erfc(-t));
  const double x2 = x * x;
  return -0.5 * x2 - std::log(-x) - 0.5 * std::log(2.0 * M_PI) +
         std::log1p(-1.0 / x2 + 3.0 / (x2 * x2) - 15.0 / (x2 * x2 * x2));
}

// Per-cluster constants of log_tilt for deviate a: (truncated variance, log erf(a/sqrt2)).
struct TiltConst {
  double tv = 1.0, den = 0.0, a = 0.0;
  bool on = false;
};

TiltConst tilt_const(double a) {
  TiltConst c;
  c.a = std::max(a, 1e-3);
  c.on = a > 0;
  c.tv = 1.0 - 2.0 * c.a * std::exp(-c.a * c.a / 2) / std::sqrt(2.0 * M_PI) /
                   std::erf(c.a * M_SQRT1_2);
  c.den = std::log(std::erf(c.a * M_SQRT1_2));
  return c;
}

// log E[exp(sqrt(v) Y)], Y standard normal truncated to [-a, a] rescaled to unit variance
// (kernels.tripartite_attention.log_tilt_ref), computed in double, returned as float.
float log_tilt(double v, const TiltConst& c) {
  if (!c.on || v <= 0) return 0.0f;
  const double u = v / c.tv;
  if (!(u > 0)) return 0.0f;
  const double su = std::sqrt(u);
  const double l1 = log_ndtr(c.a - su);
  const double l2 = log_ndtr(-c.a - su);
  const double num = l1 + std::log1p(-std::exp(l2 - l1));
  const double out = u / 2 + num - c.den;
  return static_cast<float>(std::max(out, 0.0));
}

// Online softmax over G query heads of one KV head.
struct Softmax {
  int G, D;
  std::vector<float> m, l, acc, sw;  // [G], [G], [G * D], [G] (spread weight for vshift)
  Softmax(int g, int d) : G(g), D(d), m(g, kNegInf), l(g, 0.f), acc(size_t(g) * d, 0.f),
                          sw(g, 0.f) {}
  // Raise the running max of head g to at least mx, rescaling its sums.
  void raise(int g, float mx) {
    if (mx <= m[g]) return;
    const float f = (m[g] == kNegInf) ? 0.f : std::exp(m[g] - mx);
    l[g] *= f;
    sw[g] *= f;
    float* a = acc.data() + size_t(g) * D;
    for (int d = 0; d < D; ++d) a[d] *= f;
    m[g] = mx;
  }
};

template <typename T>
struct RowArgs {
  // per (row) state
  const T* cent = nullptr; int64_t cent_h = 0, cent_c = 0;
  const T* vsum = nullptr; int64_t vsum_h = 0, vsum_c = 0;
  const int32_t* sizes = nullptr; int64_t sizes_h = 0, sizes_c = 0;
  const float* spreads = nullptr; int64_t spreads_h = 0, spreads_c = 0;
  const float* deviates = nullptr; int64_t dev_h = 0, dev_c = 0;
  const float* profile = nullptr;   // [H, D]
  const float* kfac = nullptr;      // [H, D, rank]
  const float* vfac = nullptr;      // [H, D, rank]
  int64_t rank = 0;
  int64_t C = 0;
  const T* kv_k = nullptr; const T* kv_v = nullptr; int64_t kv_row = 0;  // [rows, D]
  const int64_t* cstart = nullptr; int64_t cstart_h = 0, cstart_c = 0;
  int64_t head_rows = 0, start_mult = 1;
  Rows<T> sink_k, sink_v, win_k, win_v;
  int64_t n_sink = 0, n_win = 0;
  int64_t r = 0, e = 0;
};

template <typename T>
void run_head(const RowArgs<T>& a, int64_t h, const T* q_in, int64_t q_head_stride, int G,
              int D, float scale, bool tilted, T* out, int64_t out_head_stride, float* lse,
              int64_t* sel, int64_t S) {
  std::vector<float> q(size_t(G) * D);
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[size_t(g) * D + d] = to_f(q_in[g * q_head_stride + d]);

  // ---- 1-2: scoring and selection
  const int64_t C = a.C;
  const int64_t k = std::min<int64_t>(a.r + a.e, C);
  const int64_t r = std::min<int64_t>(a.r, k);
  std::vector<int64_t> order;
  if (C > 0 && k > 0) {
    std::vector<float> logits(size_t(G) * C);
    std::vector<float> lmax(G, kNegInf);
    const int32_t* sz = a.sizes + h * a.sizes_h;
    for (int64_t c = 0; c < C; ++c) {
      const bool valid = sz[c * a.sizes_c] > 0;
      const T* cc = a.cent + h * a.cent_h + c * a.cent_c;
      for (int g = 0; g < G; ++g) {
        float s = kNegInf;
        if (valid) {
          const float* qg = q.data() + size_t(g) * D;
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += qg[d] * to_f(cc[d]);
          s = dot * scale;
          lmax[g] = std::max(lmax[g], s);
        }
        logits[size_t(g) * C + c] = s;
      }
    }
    std::vector<float> lse_g(G, 0.f);
    for (int g = 0; g < G; ++g) {
      if (lmax[g] == kNegInf) continue;
      double sum = 0;
      const float* lg = logits.data() + size_t(g) * C;
      for (int64_t c = 0; c < C; ++c) sum += std::exp(lg[c] - lmax[g]);
      lse_g[g] = lmax[g] + static_cast<float>(std::log(sum));
    }
    std::vector<float> score(C);
    for (int64_t c = 0; c < C; ++c) {
      if (sz[c * a.sizes_c] <= 0) { score[c] = kNegInf; continue; }
      double s = 0;
      for (int g = 0; g < G; ++g) s += std::exp(logits[size_t(g) * C + c] - lse_g[g]);
      score[c] = s > 0 ? static_cast<float>(std::log(s)) : kNegInf;
    }
    order.resize(C);
    std::iota(order.begin(), order.end(), 0);
    auto better = [&](int64_t x, int64_t y) {
      return score[x] > score[y] || (score[x] == score[y] && x < y);
    };
    if (k < C) std::nth_element(order.begin(), order.begin() + k, order.end(), better);
    order.resize(k);
    std::sort(order.begin(), order.end(), better);
  }
  if (sel != nullptr) {
    for (int64_t i = 0; i < S; ++i) sel[i] = i < int64_t(order.size()) ? order[i] : -1;
  }

  // ---- 3: attention
  Softmax sm(G, D);
  std::vector<float> tile(size_t(G) * kTile);
  auto segment = [&](auto&& key_row, auto&& val_row, int64_t n) {
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int nt = int(std::min<int64_t>(kTile, n - t0));
      for (int t = 0; t < nt; ++t) {
        const T* kr = key_row(t0 + t);
        for (int g = 0; g < G; ++g) {
          const float* qg = q.data() + size_t(g) * D;
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += qg[d] * to_f(kr[d]);
          tile[size_t(g) * kTile + t] = dot * scale;
        }
      }
      for (int g = 0; g < G; ++g) {
        float* tg = tile.data() + size_t(g) * kTile;
        float mx = kNegInf;
        for (int t = 0; t < nt; ++t) mx = std::max(mx, tg[t]);
        sm.raise(g, mx);
        for (int t = 0; t < nt; ++t) {
          tg[t] = std::exp(tg[t] - sm.m[g]);
          sm.l[g] += tg[t];
        }
      }
      for (int t = 0; t < nt; ++t) {
        const T* vr = val_row(t0 + t);
        for (int g = 0; g < G; ++g) {
          const float p = tile[size_t(g) * kTile + t];
          float* acc = sm.acc.data() + size_t(g) * D;
          for (int d = 0; d < D; ++d) acc[d] += p * to_f(vr[d]);
        }
      }
    }
  };
  segment([&](int64_t i) { return a.sink_k.row(h, i); },
          [&](int64_t i) { return a.sink_v.row(h, i); }, a.n_sink);
  segment([&](int64_t i) { return a.win_k.row(h, i); },
          [&](int64_t i) { return a.win_v.row(h, i); }, a.n_win);
  for (int64_t j = 0; j < r; ++j) {
    const int64_t c = order[j];
    const int64_t n = a.sizes[h * a.sizes_h + c * a.sizes_c];
    if (n <= 0) continue;
    const int64_t first = h * a.head_rows + a.cstart[h * a.cstart_h + c * a.cstart_c] * a.start_mult;
    segment([&](int64_t i) { return a.kv_k + (first + i) * a.kv_row; },
            [&](int64_t i) { return a.kv_v + (first + i) * a.kv_row; }, n);
  }
  // estimation zone: pseudo-tokens
  const int64_t ne = k - r;
  if (ne > 0) {
    std::vector<float> qvar(G, 0.f), vshift;
    if (tilted) {
      vshift.assign(size_t(G) * D, 0.f);
      const float* prof = a.profile + h * D;
      const float* kf = a.kfac + h * D * a.rank;
      const float* vf = a.vfac + h * D * a.rank;
      std::vector<float> kq(a.rank);
      for (int g = 0; g < G; ++g) {
        const float* qg = q.data() + size_t(g) * D;
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += qg[d] * qg[d] * prof[d];
        qvar[g] = s * scale * scale;
        std::fill(kq.begin(), kq.end(), 0.f);
        for (int d = 0; d < D; ++d)
          for (int64_t j = 0; j < a.rank; ++j) kq[j] += qg[d] * kf[d * a.rank + j];
        float* vs = vshift.data() + size_t(g) * D;
        for (int d = 0; d < D; ++d) {
          float s2 = 0.f;
          for (int64_t j = 0; j < a.rank; ++j) s2 += vf[d * a.rank + j] * kq[j];
          vs[d] = s2 * scale;
        }
      }
    }
    std::vector<float> vmean(D);
    for (int64_t j = r; j < k; ++j) {
      const int64_t c = order[j];
      const int64_t n = a.sizes[h * a.sizes_h + c * a.sizes_c];
      if (n <= 0) continue;
      const T* cc = a.cent + h * a.cent_h + c * a.cent_c;
      const T* vv = a.vsum + h * a.vsum_h + c * a.vsum_c;
      const float inv = 1.0f / float(n);
      for (int d = 0; d < D; ++d) vmean[d] = to_f(vv[d]) * inv;
      const float bias = std::log(float(n));
      float spread = 0.f;
      TiltConst tc;
      if (tilted) {
        spread = a.spreads[h * a.spreads_h + c * a.spreads_c];
        tc = tilt_const(a.deviates[h * a.dev_h + c * a.dev_c]);
      }
      for (int g = 0; g < G; ++g) {
        const float* qg = q.data() + size_t(g) * D;
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qg[d] * to_f(cc[d]);
        float logit = dot * scale + bias;
        if (tilted) logit += log_tilt(double(qvar[g]) * double(spread), tc);
        sm.raise(g, logit);
        const float p = std::exp(logit - sm.m[g]);
        sm.l[g] += p;
        float* acc = sm.acc.data() + size_t(g) * D;
        for (int d = 0; d < D; ++d) acc[d] += p * vmean[d];
        sm.sw[g] += p * spread;
      }
    }
    if (tilted) {
      for (int g = 0; g < G; ++g) {
        float* acc = sm.acc.data() + size_t(g) * D;
        const float* vs = vshift.data() + size_t(g) * D;
        for (int d = 0; d < D; ++d) acc[d] += sm.sw[g] * vs[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    T* o = out + g * out_head_stride;
    const float* acc = sm.acc.data() + size_t(g) * D;
    if (sm.l[g] > 0) {
      const float inv = 1.0f / sm.l[g];
      for (int d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
      lse[g] = sm.m[g] + std::log(sm.l[g]);
    } else {
      for (int d = 0; d < D; ++d) o[d] = static_cast<T>(0.f);
      lse[g] = kNegInf;
    }
  }
}

template <typename T>
void decode_rows_impl(const torch::Tensor& query, torch::Tensor& out, torch::Tensor& lse,
                      torch::Tensor& sel, double scale, const std::vector<torch::Tensor>& meta,
                      const std::vector<torch::Tensor>& tilt,
                      const std::vector<torch::Tensor>& kv,
                      const std::vector<torch::Tensor>& steady,
                      const std::vector<int64_t>& ints, bool tilted) {
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t H = meta.empty() ? 0 : meta[0].size(0);
  TORCH_CHECK(H > 0 && Hq % H == 0, "retro_cpu: query heads ", Hq, " not a multiple of KV heads ", H);
  const int G = int(Hq / H);
  std::vector<RowArgs<T>> rows(B);
  for (int64_t b = 0; b < B; ++b) {
    RowArgs<T>& a = rows[b];
    const torch::Tensor& cent = meta[5 * b], &vsum = meta[5 * b + 1], &sz = meta[5 * b + 2],
                         &sp = meta[5 * b + 3], &dv = meta[5 * b + 4];
    TORCH_CHECK(cent.size(0) == H && cent.size(2) == D && cent.stride(2) == 1, "retro_cpu: centroids");
    TORCH_CHECK(vsum.stride(2) == 1 && sz.scalar_type() == torch::kInt32, "retro_cpu: value sums / sizes");
    a.C = cent.size(1);
    a.cent = cent.data_ptr<T>(); a.cent_h = cent.stride(0); a.cent_c = cent.stride(1);
    a.vsum = vsum.data_ptr<T>(); a.vsum_h = vsum.stride(0); a.vsum_c = vsum.stride(1);
    a.sizes = sz.data_ptr<int32_t>(); a.sizes_h = sz.stride(0); a.sizes_c = sz.stride(1);
    if (tilted) {
      a.spreads = sp.data_ptr<float>(); a.spreads_h = sp.stride(0); a.spreads_c = sp.stride(1);
      a.deviates = dv.data_ptr<float>(); a.dev_h = dv.stride(0); a.dev_c = dv.stride(1);
      const torch::Tensor &prof = tilt[3 * b], &kf = tilt[3 * b + 1], &vf = tilt[3 * b + 2];
      TORCH_CHECK(prof.is_contiguous() && kf.is_contiguous() && vf.is_contiguous(),
                  "retro_cpu: residual model terms must be contiguous");
      a.profile = prof.data_ptr<float>(); a.kfac = kf.data_ptr<float>();
      a.vfac = vf.data_ptr<float>(); a.rank = kf.size(2);
    }
    const torch::Tensor &kk = kv[3 * b], &vv = kv[3 * b + 1], &cs = kv[3 * b + 2];
    TORCH_CHECK(kk.stride(-1) == 1 && kk.size(-1) == D, "retro_cpu: KV pool rows");
    a.kv_k = kk.data_ptr<T>(); a.kv_v = vv.data_ptr<T>(); a.kv_row = kk.stride(-2);
    if (a.C > 0) {
      TORCH_CHECK(cs.scalar_type() == torch::kInt64 && cs.size(1) >= a.C, "retro_cpu: cluster starts");
      a.cstart = cs.data_ptr<int64_t>(); a.cstart_h = cs.stride(0); a.cstart_c = cs.stride(1);
    }
    a.head_rows = ints[6 * b]; a.start_mult = ints[6 * b + 1];
    a.n_sink = ints[6 * b + 2]; a.n_win = ints[6 * b + 3];
    a.r = ints[6 * b + 4]; a.e = ints[6 * b + 5];
    a.sink_k = rows3<T>(steady[4 * b]); a.sink_v = rows3<T>(steady[4 * b + 1]);
    a.win_k = rows3<T>(steady[4 * b + 2]); a.win_v = rows3<T>(steady[4 * b + 3]);
  }
  const T* qp = query.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  int64_t* sp = sel.numel() ? sel.data_ptr<int64_t>() : nullptr;
  const int64_t S = sel.numel() ? sel.size(2) : 0;
  const float sc = float(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      run_head<T>(rows[b], h, qp + b * query.stride(0) + h * G * query.stride(1),
                  query.stride(1), G, int(D), sc, tilted,
                  op + b * out.stride(0) + h * G * out.stride(1), out.stride(1),
                  lp + b * lse.stride(0) + h * G,
                  sp ? sp + b * sel.stride(0) + h * sel.stride(1) : nullptr, S);
    }
  });
}

}  // namespace

// See the header comment. Per row b (all lists in row order):
//   meta[5b..5b+4]   centroids [H, C, D], value sums [H, C, D], sizes [H, C] int32,
//                    spreads [H, C] f32, deviates [H, C] f32
//   tilt[3b..3b+2]   profile [H, D], key factor [H, D, rank], value factor [H, D, rank] f32
//                    (empty list when not tilted)
//   kv[3b..3b+2]     KV pool keys, values [rows, D] (or [.., D]), cluster starts [H, >=C] int64
//   steady[4b..4b+3] sink keys, values, window keys, values, each [H, n, D]
//   ints[6b..6b+5]   head_rows, start_mult, n_sink, n_win, r, e
// Cluster c of KV head h occupies pool rows head_rows * h + starts[h, c] * start_mult, + size.
void decode_rows(torch::Tensor query, torch::Tensor out, torch::Tensor lse, torch::Tensor sel,
                 double scale, std::vector<torch::Tensor> meta, std::vector<torch::Tensor> tilt,
                 std::vector<torch::Tensor> kv, std::vector<torch::Tensor> steady,
                 std::vector<int64_t> ints, bool tilted) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "retro_cpu: query must be [B, Hq, D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(2) == 1,
              "retro_cpu: out must match query");
  const int64_t B = query.size(0);
  TORCH_CHECK(int64_t(meta.size()) == 5 * B && int64_t(kv.size()) == 3 * B &&
                  int64_t(steady.size()) == 4 * B && int64_t(ints.size()) == 6 * B &&
                  (!tilted || int64_t(tilt.size()) == 3 * B),
              "retro_cpu: per-row argument lists do not match the batch");
  if (B == 0) return;
  switch (query.scalar_type()) {
    case torch::kFloat:
      decode_rows_impl<float>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints, tilted);
      break;
    case torch::kBFloat16:
      decode_rows_impl<c10::BFloat16>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints, tilted);
      break;
    case torch::kHalf:
      decode_rows_impl<c10::Half>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints, tilted);
      break;
    default:
      TORCH_CHECK(false, "retro_cpu: dtype ", query.scalar_type(),
                  " is not supported; accepted: float32, bfloat16, float16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_rows", &decode_rows, "Fused tripartite decode of a batch of rows (CPU)");
}
