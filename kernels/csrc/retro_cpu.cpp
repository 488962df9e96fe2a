// Fused tripartite decode of one attention layer for a whole batch of indexed rows, on CPU.
//
// One call per layer and step: for every (request row b, KV head h) pair, in parallel:
//   1. cluster scoring: logit[g, c] = scale * q_g . C_c for the G query heads of the group,
//      score[c] = log(sum_g softmax_c(logit[g])[c]) (-inf for empty clusters); with 2D-wide
//      scoring rows (Quest's page bounds: each page's key max, then min) the logit is the
//      bound scale * sum_d max(q_d max_d, q_d min_d) = scale * [q+, q-] . [max, min];
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

#include "retro_check.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace {

#define RETRO_INLINE inline __attribute__((always_inline))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kPhases = 5;  // scoring, selection, row lookup, exact attention, estimation
constexpr int kTile = 32;
// Software prefetches of scattered rows (retrieved clusters' values, estimated clusters'
// value sums) go to L2 (locality 1): into L1 they stall on its few miss buffers, and the
// step took 1.19x longer (32K, batch 8, 2 threads; bench/README.md, "Fused CPU kernel").
constexpr int kPrefetchLocality = 1;
// Rows ahead that the AVX512-BF16 scoring loop prefetches (4 KB at D = 128, bf16).
constexpr int64_t kScoreAhead = 16;

template <typename T>
RETRO_INLINE float to_f(T x) { return static_cast<float>(x); }

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
  RETRO_CHECK(t.dim() == 3 && t.stride(2) == 1, "retro_cpu: expected [H, n, D] rows, D contiguous");
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

// The steady zone's counts must lie within its tensors: n_sink sink rows, and n_win window
// rows read from ring row `first` on, wrapping at `cap`.
inline void check_window(int64_t n_sink, int64_t sink_rows, int64_t n_win, int64_t first,
                         int64_t cap) {
  RETRO_CHECK(n_sink >= 0 && n_sink <= sink_rows && n_win >= 0 && n_win <= cap &&
                  (n_win == 0 || (first >= 0 && first < cap)),
              "retro_cpu: steady zone out of range (sinks ", n_sink, " of ", sink_rows,
              ", window ", n_win, " rows from ", first, " of a ring of ", cap, ")");
}

// std::bit_cast for C++17 (torch's cpp_extension may build with -std=c++17); compilers fold
// the memcpy into a register move, also inside `omp simd` loops.
template <typename To, typename From>
RETRO_INLINE To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: sizes differ");
  static_assert(std::is_trivially_copyable_v<To> && std::is_trivially_copyable_v<From>,
                "bits_as: types not trivially copyable");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// ---- vectorisable float math (plain C++; GCC vectorises these inside `omp simd` loops,
// where libm calls would not be). Accuracy: a few ulp, far inside the kernel's 1e-5.

RETRO_INLINE float fast_exp(float x) {  // exp(x); 0 for x < -87 (and -inf)
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = bits_as<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

RETRO_INLINE float fast_log(float x) {  // log(x) for finite x > 0
  const int32_t i = bits_as<int32_t>(x);
  float e = float(((i >> 23) & 0xff) - 127);
  float m = bits_as<float>((i & 0x007fffff) | 0x3f800000);  // [1, 2)
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1.0f : e;
  const float f = m - 1.0f, z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z - 2.12194440e-4f * e - 0.5f * z;
  return f + y + 0.693359375f * e;
}

// erfc(z) = t exp(erfc_poly(t) - z^2) with t = 1 / (1 + z / 2), for z >= 0 (Numerical
// Recipes' erfcc: fractional error < 1.2e-7).
RETRO_INLINE float erfc_poly(float t) {
  return -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f +
         t * (-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f +
         t * (-0.82215223f + t * 0.17087277f))))))));
}

// log(erfc(z)) for z >= 0, in log space so that it never underflows.
RETRO_INLINE float log_erfc_pos(float z) {
  const float t = 1.0f / (1.0f + 0.5f * z);
  return fast_log(t) - z * z + erfc_poly(t);
}

// The tilted estimator's per-cluster constants for deviate a0 (see log_tilt_ref): a =
// max(a0, 1e-3), the truncated variance tv(a) (+inf when a0 <= 0: no correction) and
// log erf(a / sqrt 2). Below a = 0.25 both come from their Taylor series: the closed forms
// there subtract nearly equal numbers (tv = 1 - (1 - a^2 / 3 + ...)), which in fp32 gave tv
// errors of up to 287x at a = 1e-3 (an fp32 emulation; even tv <= 0); the series are
// within 5e-6 relative.
RETRO_INLINE void tilt_const(float a0, float& a, float& tv, float& den) {
  constexpr float kSqrt1_2 = 0.70710678118654752f, kInvSqrt2Pi = 0.39894228040143268f;
  constexpr float k2OverSqrtPi = 1.12837916709551257f;
  a = std::max(a0, 1e-3f);
  const float x = a * kSqrt1_2, x2 = x * x, a2 = a * a;
  const float erf_series = k2OverSqrtPi * x * (1.0f + x2 * (-1.0f / 3 + x2 * (0.1f + x2 * (
                           -1.0f / 42 + x2 * (1.0f / 216)))));
  const float tv_series = a2 * (1.0f / 3) * (1.0f + a2 * (-2.0f / 15 + a2 * 0.006349206f));
  const bool small = a < 0.25f;
  const float erf_a = small ? erf_series : 1.0f - fast_exp(log_erfc_pos(x));
  const float t = small ? tv_series
                        : 1.0f - 2.0f * a * fast_exp(-0.5f * a2) * kInvSqrt2Pi / erf_a;
  tv = a0 > 0 ? t : std::numeric_limits<float>::infinity();
  den = fast_log(erf_a);
}

// log E[exp(sqrt(v) Y)] for Y standard normal truncated to [-a, a], rescaled to unit
// variance (kernels.tripartite_attention.log_tilt_ref): with u = v / tv and s = sqrt(u),
// u / 2 + log(Phi(a - s) - Phi(-a - s)) - den; 0 where v <= 0 or tv is +inf.
//
// Through E1 = erfc(|a - s| / sqrt 2) and E2 = erfc((a + s) / sqrt 2) in erfcc's form, whose
// ratio r = E2 / E1 takes one exponential (the exponents differ by 2 a s, never
// overflowing); then for s > a the difference is E1 (1 - r) / 2, whose log adds
// a (s - a / 2) = u / 2 - (s - a)^2 / 2 to erfc's exponent exactly (no cancellation of two
// large terms), and for s <= a it is 1 - E1 (1 + r) / 2. Two exponentials and two logs, against
// six for log_ndtr twice and log1p(-exp); and within 1e-4 of the fp64 reference where that
// form loses 1e-2 (deviates >= 0.5, v up to 1e4).
RETRO_INLINE float log_tilt(float v, float a, float tv, float den) {
  constexpr float kSqrt1_2 = 0.70710678118654752f;
  const float u = std::max(v, 0.0f) / tv;
  const float s = std::sqrt(u);
  const float z1 = std::fabs(a - s) * kSqrt1_2, z2 = (a + s) * kSqrt1_2;
  const float inv_t1 = 1.0f + 0.5f * z1, t1 = 1.0f / inv_t1;
  const float t2 = 1.0f / (1.0f + 0.5f * z2);
  const float p1 = erfc_poly(t1);
  const float r = t2 * inv_t1 * fast_exp(erfc_poly(t2) - p1 - 2.0f * a * s);
  const float far = fast_log(0.5f * t1 * std::max(1.0f - r, 1e-30f)) + p1 + a * (s - 0.5f * a);
  const float e1 = t1 * fast_exp(p1 - z1 * z1);
  const float near = 0.5f * u + fast_log(1.0f - 0.5f * e1 * (1.0f + r));
  const float out = std::max((s > a ? far : near) - den, 0.0f);
  return u > 0 ? out : 0.0f;
}

// Order-preserving uint32 keys of floats (key(x) < key(y) iff x < y; -0 just below +0),
// and back.
RETRO_INLINE uint32_t order_key(float f) {
  const uint32_t u = bits_as<uint32_t>(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
RETRO_INLINE float key_value(uint32_t k) {
  return bits_as<float>((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The k-th largest of keys[0, n) (1 <= k <= n): a most-significant-digit radix select over
// digits of 11, 11 and 10 bits, each pass over the previous digit's survivors only (copied
// into buf, n entries). Exact, O(n), no data-dependent branches per element; it replaced
// two std::nth_element calls (the selection phase: 1.03 -> 0.61 ms at 32K, batch 8).
uint32_t kth_largest_key(const uint32_t* keys, int64_t n, int64_t k, uint32_t* buf) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kBins[3] = {2048, 2048, 1024};
  int32_t hist[2048];
  const uint32_t* cur = keys;
  int64_t m = n;
  uint32_t prefix = 0;
  for (int p = 0; p < 3; ++p) {
    const int s = kShift[p];
    const uint32_t nb = kBins[p];
    std::fill(hist, hist + nb, 0);
    for (int64_t i = 0; i < m; ++i) ++hist[(cur[i] >> s) & (nb - 1)];
    uint32_t b = nb - 1;
    while (hist[b] < k) {
      k -= hist[b];
      --b;
    }
    prefix |= b << s;
    if (p == 2) break;
    int64_t w = 0;  // the survivors: keys whose digit is b (their earlier digits match)
    for (int64_t i = 0; i < m; ++i) {
      buf[w] = cur[i];
      w += ((cur[i] >> s) & (nb - 1)) == b;
    }
    cur = buf;
    m = w;
  }
  return prefix;
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
  bool split = false;  // scoring rows are [max, min] page bounds (2D wide): Quest's bound
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
  Rows<T> sink_k, sink_v, win_k, win_v;  // the window is a ring of win_cap rows
  int64_t n_sink = 0, n_win = 0, win_first = 0, win_cap = 0;
  int64_t r = 0, e = 0;
  // given selection (optional): the retrieval clusters [H, n_given] chosen by the caller
  // (no scoring, no estimation zone)
  bool has_given = false;
  const int64_t* given = nullptr; int64_t given_h = 0, n_given = 0;
};

template <typename T>
RETRO_INLINE float dot_row(const float* q, const T* k, int D) {
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int d = 0; d < D; ++d) dot += q[d] * to_f(k[d]);
  return dot;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
RETRO_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
RETRO_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
RETRO_INLINE __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Lane i of the result: the sum of the 8 lanes of a[i].
RETRO_INLINE __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#define RETRO_AVX2 1
#endif

#if defined(RETRO_AVX2) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
// Cluster scoring by AVX512-BF16 dot products, chosen at run time (the extension is built
// with AVX2 flags and may be cached in a home directory shared by machines of different
// CPUs). vdpbf16ps multiplies 32 bf16 pairs per instruction, each product exact in fp32
// (8-bit mantissas), and adds them into 16 fp32 lanes, two per lane: the same products as the
// AVX2 path, summed in another order. It needs bf16 operands: the query heads are used as
// bf16 only when they convert exactly (they come from a bf16 query, and the page-bound split
// of it is exact too), else the AVX2 path runs. Scoring only: it streams every centroid, and
// with the AVX2 path it was arithmetic-bound (~6 GB/s per core against ~10 GB/s for a plain
// read of the same rows); fed 16 rows ahead by software prefetches it took 1.05-1.14x less
// time per step (bench/README.md, "On a CPU with AMX"). For the exact keys (tiles of 32
// scattered rows) it measured slower.
#define RETRO_AVX512BF16 1
#define RETRO_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// out[(g0 + k) * ld + i0 + j] for head k < NG of the group and row j < nr of the quad: 4 rows x
// NG heads per pass over D (a multiple of 32), the 4 rows' 64-byte chunks loaded once for
// all heads.
template <int NG>
RETRO_AVX512_TARGET void dots_bf16_quad(const uint16_t* qb, int D, const uint16_t* const* r,
                                        int nr, float scale, const float* bias, float* out,
                                        int64_t ld) {
  __m512 acc[4][4];
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 4; ++j) acc[k][j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    __m512bh rv[4];
    for (int j = 0; j < 4; ++j)
      rv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(r[j] + d));
    for (int k = 0; k < NG; ++k) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qb + size_t(k) * D + d));
      for (int j = 0; j < 4; ++j) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], qv, rv[j]);
    }
  }
  // Reduce the 16 lanes of each (head k, row j): per row, the 4 heads' vectors fold to one
  // whose 128-bit block k holds 4 partial sums of head k; then the 4 rows' folds combine so
  // that block k's lane j is the total of (head k, row j).
  __m512 u[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 a0 = acc[0][j], a1 = acc[1][j], a2 = acc[2][j], a3 = acc[3][j];
    const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                     _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                     _mm512_shuffle_f32x4(a2, a3, 0xEE));
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88),
                         _mm512_shuffle_f32x4(t01, t23, 0xDD));
  }
  // per block: s01 = [x0 + x2, y0 + y2, x1 + x3, y1 + y3] for rows x = 0, y = 1
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512 tot = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  __m512 v = _mm512_mul_ps(tot, _mm512_set1_ps(scale));
  const __mmask16 rows_mask = __mmask16((1u << nr) - 1u);
  if (bias != nullptr)
    v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(__mmask8(rows_mask), bias)));
  alignas(64) float o[16];
  _mm512_store_ps(o, v);
  for (int k = 0; k < NG; ++k)
    _mm_mask_storeu_ps(out + k * ld, __mmask8(rows_mask), _mm_load_ps(o + 4 * k));
}

RETRO_AVX512_TARGET void dots_bf16_512(const uint16_t* qb, int G, int D,
                                       const uint16_t* const* rows, int64_t n, float scale,
                                       const float* bias, float* out, int64_t ld) {
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int nr = int(std::min<int64_t>(4, n - i0));
    const uint16_t* r[4];
    for (int j = 0; j < 4; ++j) r[j] = rows[i0 + std::min(j, nr - 1)];
    if (i0 + kScoreAhead + 4 <= n)  // contiguous rows, but the hardware prefetcher lags
      for (int j = 0; j < 4; ++j)
        for (int d = 0; d < 2 * D; d += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(rows[i0 + kScoreAhead + j]) + d, 0,
                             kPrefetchLocality);
    const float* b = bias != nullptr ? bias + i0 : nullptr;
    for (int g0 = 0; g0 < G; g0 += 4) {
      const uint16_t* q = qb + size_t(g0) * D;
      float* o = out + g0 * ld + i0;
      switch (std::min(4, G - g0)) {
        case 4: dots_bf16_quad<4>(q, D, r, nr, scale, b, o, ld); break;
        case 3: dots_bf16_quad<3>(q, D, r, nr, scale, b, o, ld); break;
        case 2: dots_bf16_quad<2>(q, D, r, nr, scale, b, o, ld); break;
        default: dots_bf16_quad<1>(q, D, r, nr, scale, b, o, ld); break;
      }
    }
  }
}

inline bool cpu_has_avx512bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// Tests and benchmarks cap the scoring path (kScoreAvx512 or kScoreAvx2) to cover both on
// one CPU; serving never sets it.
constexpr int kScoreAvx2 = 0, kScoreAvx512 = 1;
std::atomic<int> g_score_cap{kScoreAvx512};

// The G x D query heads as bf16 bits into qb, if each converts exactly.
inline bool exact_bf16(const float* q, int64_t n, uint16_t* qb) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &q[i], 4);
    if (bits & 0xFFFFu) return false;
    qb[i] = uint16_t(bits >> 16);
  }
  return true;
}
#endif

// out[g * ld + i] = scale * q_g . rows[i] + bias[i] for the G query heads and n rows
// (row i at rows[i], D contiguous elements; bias may be null). Eight rows at a time with
// AVX2 when D is a multiple of 8 (one horizontal reduction per 8 dot products).
// scoring: the rows are a head's centroids (contiguous, all of them), which take the
// AVX512-BF16 path where the CPU has it.
template <typename T>
void dots(const float* q, int G, int D, const T* const* rows, int64_t n, float scale,
          const float* bias, float* out, int64_t ld, bool scoring = false) {
  int64_t i0 = 0;
#ifdef RETRO_AVX512BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (scoring && D % 32 == 0 && n > 0 && cpu_has_avx512bf16() &&
        g_score_cap.load(std::memory_order_relaxed) >= kScoreAvx512) {
      thread_local std::vector<uint16_t> qb;
      qb.resize(size_t(G) * D);
      if (exact_bf16(q, int64_t(G) * D, qb.data())) {
        dots_bf16_512(qb.data(), G, D, reinterpret_cast<const uint16_t* const*>(rows), n,
                      scale, bias, out, ld);
        return;
      }
    }
  }
#endif
#ifdef RETRO_AVX2
  if (D % 8 == 0) {
    // the 8 rows converted to fp32 once (L1-resident), then reused by every query head;
    // no software prefetch: centroids are contiguous, and so are a cluster's keys, which
    // the hardware prefetcher follows (prefetching the next 8 rows measured no faster)
    thread_local std::vector<float> tile;
    tile.resize(size_t(8) * D);
    for (; i0 + 8 <= n; i0 += 8) {
      const T* const* r = rows + i0;
      for (int i = 0; i < 8; ++i)
        for (int d = 0; d < D; d += 8)
          _mm256_storeu_ps(tile.data() + size_t(i) * D + d, load8(r[i] + d));
      for (int g = 0; g < G; ++g) {
        const float* qg = q + size_t(g) * D;
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          for (int i = 0; i < 8; ++i)
            acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tile.data() + size_t(i) * D + d),
                                     acc[i]);
        }
        __m256 v = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));
        if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i0));
        _mm256_storeu_ps(out + g * ld + i0, v);
      }
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i)
    for (int g = 0; g < G; ++g)
      out[g * ld + i] = dot_row(q + size_t(g) * D, rows[i], D) * scale +
                        (bias != nullptr ? bias[i] : 0.f);
}

// acc[g] += (p[g * ld] * mult) * row for the G query heads (acc [G, D] fp32): the row is
// loaded and converted once for all heads.
template <typename T>
RETRO_INLINE void add_weighted(float* acc, int G, int D, const float* p, int64_t ld, float mult,
                               const T* row) {
#ifdef RETRO_AVX2
  if (D % 8 == 0 && G <= 16) {
    __m256 w[16];
    for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(p[g * ld] * mult);
    for (int d = 0; d < D; d += 8) {
      const __m256 v = load8(row + d);
      for (int g = 0; g < G; ++g) {
        float* ag = acc + size_t(g) * D + d;
        _mm256_storeu_ps(ag, _mm256_fmadd_ps(w[g], v, _mm256_loadu_ps(ag)));
      }
    }
    return;
  }
#endif
  for (int g = 0; g < G; ++g) {
    const float pg = p[g * ld] * mult;
    float* ag = acc + size_t(g) * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) ag[d] += pg * to_f(row[d]);
  }
}

// acc[g] += sum_t (p[g * ld + t] * mult[t]) * rows[t] for the G query heads (acc [G, D]
// fp32) and n rows (mult null: 1; rows with mult 0 skipped). With AVX2 the accumulators of
// up to 4 heads x 16 dims stay in registers while the rows stream past, so each (g, d) sums
// its rows in order exactly as add_weighted row by row would (bit-identical).
#ifdef RETRO_AVX2
template <int GN, typename T>
void add_rows_avx2(float* acc, int D, const float* p, int64_t ld, const float* mult,
                   const T* const* rows, int64_t n) {
  for (int d = 0; d < D; d += 16) {
    __m256 a0[GN], a1[GN];
    for (int g = 0; g < GN; ++g) {
      a0[g] = _mm256_loadu_ps(acc + size_t(g) * D + d);
      a1[g] = _mm256_loadu_ps(acc + size_t(g) * D + d + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const float m = mult != nullptr ? mult[t] : 1.0f;
      if (m == 0.f) continue;
      const __m256 v0 = load8(rows[t] + d), v1 = load8(rows[t] + d + 8);
      for (int g = 0; g < GN; ++g) {
        const __m256 w = _mm256_set1_ps(p[g * ld + t] * m);
        a0[g] = _mm256_fmadd_ps(w, v0, a0[g]);
        a1[g] = _mm256_fmadd_ps(w, v1, a1[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      _mm256_storeu_ps(acc + size_t(g) * D + d, a0[g]);
      _mm256_storeu_ps(acc + size_t(g) * D + d + 8, a1[g]);
    }
  }
}
#endif

template <typename T>
void add_rows(float* acc, int G, int D, const float* p, int64_t ld, const float* mult,
              const T* const* rows, int64_t n) {
#ifdef RETRO_AVX2
  if (D % 16 == 0) {
    for (int g0 = 0; g0 < G; g0 += 4) {
      float* ag = acc + size_t(g0) * D;
      const float* pg = p + g0 * ld;
      switch (std::min(4, G - g0)) {
        case 1: add_rows_avx2<1>(ag, D, pg, ld, mult, rows, n); break;
        case 2: add_rows_avx2<2>(ag, D, pg, ld, mult, rows, n); break;
        case 3: add_rows_avx2<3>(ag, D, pg, ld, mult, rows, n); break;
        default: add_rows_avx2<4>(ag, D, pg, ld, mult, rows, n); break;
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float m = mult != nullptr ? mult[t] : 1.0f;
    if (m != 0.f) add_weighted(acc, G, D, p + t, ld, m, rows[t]);
  }
}

// max(x[0, n)): -inf for n = 0, NaNs skipped (as std::max(mx, x[i]) skips them). GCC left
// `omp simd reduction(max)` scalar: a chain of dependent vmaxss, one per element (the
// scoring softmax's max over C logits per head was 16% of run_head's samples at 16K).
RETRO_INLINE float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float mx = kNegInf;
#ifdef RETRO_AVX2
  if (n >= 32) {
    __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 32 <= n; i += 32) {  // vmaxps returns its second operand where either is NaN
      m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
      m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
      m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
      m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (float v : lanes) mx = std::max(mx, v);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// A block of n pseudo- or real tokens already scored: logits [G, ld] (row g at g * ld).
// Folds them into the online softmax, leaving each logit's probability (relative to the
// raised running max) in its place for the caller's value sum.
void fold_block(Softmax& sm, float* logits, int64_t ld, int64_t n, const float* spread) {
  const int G = sm.G;
  for (int g = 0; g < G; ++g) {
    float* lg = logits + g * ld;
    const float mx = max_of(lg, n);
    if (mx == kNegInf) {
      for (int64_t i = 0; i < n; ++i) lg[i] = 0.f;
      continue;
    }
    sm.raise(g, mx);
    const float m = sm.m[g];
    float sum = 0.f, sw = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      lg[i] = fast_exp(lg[i] - m);
      sum += lg[i];
    }
    if (spread != nullptr) {
#pragma omp simd reduction(+ : sw)
      for (int64_t i = 0; i < n; ++i) sw += lg[i] * spread[i];
    }
    sm.l[g] += sum;
    sm.sw[g] += sw;
  }
}

// Fold n exact tokens (keys kp[i], values vp[i], D contiguous elements each) into the
// online softmax of the G query heads q [G, D], in tiles of kTile rows (each tile's keys and
// values prefetched in one burst: spread over the previous tile's sums instead, they took
// 1.1x as long, with fewer misses in flight).
template <typename T>
void attend_exact(Softmax& sm, const float* q, int G, int D, float scale, const T* const* kp,
                  const T* const* vp, int64_t n) {
  float tile[16 * kTile];
  std::vector<float> tile_big;
  float* tl = tile;
  if (G > 16) {
    tile_big.resize(size_t(G) * kTile);
    tl = tile_big.data();
  }
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int nt = int(std::min<int64_t>(kTile, n - t0));
    // the tile's keys and values requested at once, before its first key is read (keys
    // left to demand loads: exact attention at 128K x 8 took 1.1x as long)
    for (int t = 0; t < nt; ++t)
      for (int d = 0; d < D * int(sizeof(T)); d += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kp[t0 + t]) + d, 0, kPrefetchLocality);
        __builtin_prefetch(reinterpret_cast<const char*>(vp[t0 + t]) + d, 0, kPrefetchLocality);
      }
    dots(q, G, D, kp + t0, nt, scale, nullptr, tl, kTile);
    fold_block(sm, tl, kTile, nt, nullptr);
    add_rows(sm.acc.data(), G, D, tl, kTile, nullptr, vp + t0, nt);
  }
}

// out[g * out_stride] = acc[g] / l[g] (zeros when nothing was attended), lse[g] = m + log l.
template <typename T>
void write_output(const Softmax& sm, int G, int D, T* out, int64_t out_stride, float* lse) {
  for (int g = 0; g < G; ++g) {
    T* o = out + g * out_stride;
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
void run_head(const RowArgs<T>& a, int64_t h, const T* q_in, int64_t q_head_stride, int G,
              int D, float scale, bool tilted, T* out, int64_t out_head_stride, float* lse,
              int64_t* sel, int64_t S, int64_t* phase_ns) {
  // phase_ns (optional, kPhases counters): nanoseconds spent in each phase for this head
  using clock = std::chrono::steady_clock;
  auto mark_t = phase_ns ? clock::now() : clock::time_point();
  auto mark = [&](int phase) {
    if (!phase_ns) return;
    const auto now = clock::now();
    phase_ns[phase] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark_t).count();
    mark_t = now;
  };
  std::vector<float> q(size_t(G) * D);
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[size_t(g) * D + d] = to_f(q_in[g * q_head_stride + d]);

  // ---- 1-2: scoring and selection (ranked by the group's summed softmax probability,
  // the exponential of the reference's log score: the same order)
  const int64_t C = a.C;
  const bool given = a.has_given;
  const int64_t k = given ? a.n_given : std::min<int64_t>(a.r + a.e, C);
  const int64_t r = given ? a.n_given : std::min<int64_t>(a.r, k);
  const int32_t* sz = a.sizes + h * a.sizes_h;
  std::vector<int64_t> order;
  // per-thread scratch, reused across calls (a fresh 100+ KB vector per call is an mmap +
  // page faults). logits [G, C] = scale * q_g . C_c, kept for the estimation zone, whose
  // pseudo-token logits are these plus log(size).
  thread_local std::vector<float> logits;
  if (given) {
    order.assign(a.given + h * a.given_h, a.given + h * a.given_h + k);
    if (sel != nullptr)
      for (int64_t i = 0; i < S; ++i) sel[i] = i < k ? order[i] : -1;
  } else if (C > 0 && k > 0) {
    thread_local std::vector<const void*> cptr_raw;
    thread_local std::vector<float> probs;
    logits.resize(size_t(G) * C);
    probs.resize(size_t(G) * C);
    cptr_raw.resize(C);
    const T** cptr = reinterpret_cast<const T**>(cptr_raw.data());
    for (int64_t c = 0; c < C; ++c) cptr[c] = a.cent + h * a.cent_h + c * a.cent_c;
    if (a.split) {
      // max(q_d max_d, q_d min_d) is q_d max_d where q_d >= 0, else q_d min_d
      thread_local std::vector<float> qs;
      qs.resize(size_t(G) * 2 * D);
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
          const float x = q[size_t(g) * D + d];
          qs[size_t(g) * 2 * D + d] = x > 0.f ? x : 0.f;
          qs[size_t(g) * 2 * D + D + d] = x < 0.f ? x : 0.f;
        }
      dots(qs.data(), G, 2 * D, cptr, C, scale, nullptr, logits.data(), C, true);
    } else {
      dots(q.data(), G, D, cptr, C, scale, nullptr, logits.data(), C, true);
    }
    for (int64_t c = 0; c < C; ++c)
      if (sz[c * a.sizes_c] <= 0)
        for (int g = 0; g < G; ++g) logits[size_t(g) * C + c] = kNegInf;
    thread_local std::vector<float> score;
    score.assign(C, 0.f);
    for (int g = 0; g < G; ++g) {
      const float* lg = logits.data() + size_t(g) * C;
      float* pg = probs.data() + size_t(g) * C;
      const float mx = max_of(lg, C);
      if (mx == kNegInf) continue;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < C; ++c) {
        pg[c] = fast_exp(lg[c] - mx);
        sum += pg[c];
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) score[c] += pg[c] * inv;
    }
    for (int64_t c = 0; c < C; ++c)
      if (sz[c * a.sizes_c] <= 0) score[c] = kNegInf;
    mark(0);
    // The top k by (score desc, id asc), split into the first r (retrieval) and the rest
    // (estimation), each listed in ascending cluster id (memory order, so zone reads
    // stream; the sums are order-independent up to fp32 rounding). No sort: the k-th
    // largest score comes from a radix select over the order-preserving bit keys of all C,
    // the r-th from one over the >= k keys at or above it only; then one branch-free pass
    // in id order admits clusters above each threshold and, in id order, as many ties at
    // it as the ranking would (selection at 128K, batch 8: 2.40 -> 1.99 ms a step).
    thread_local std::vector<uint32_t> keys, kbuf, top;
    thread_local std::vector<int64_t> ret_ids, est_ids;
    keys.resize(C);
    kbuf.resize(C);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) keys[c] = order_key(score[c]);
    const uint32_t key_k = kth_largest_key(keys.data(), C, k, kbuf.data());
    float thr_r = std::numeric_limits<float>::infinity();
    if (r > 0) {
      top.resize(C);
      int64_t m = 0;
      for (int64_t c = 0; c < C; ++c) {
        top[m] = keys[c];
        m += keys[c] >= key_k;
      }
      thr_r = key_value(kth_largest_key(top.data(), m, r, kbuf.data()));
    }
    const float thr_k = key_value(key_k);
    int64_t above_r = 0, above_k = 0;
#pragma omp simd reduction(+ : above_r, above_k)
    for (int64_t c = 0; c < C; ++c) {
      above_r += score[c] > thr_r;
      above_k += score[c] > thr_k;
    }
    const int64_t ties_r = r - above_r, ties_k = k - above_k;
    // each pass writes one slot past its last admission. Zeroed: with NaN scores (a NaN
    // query head) nothing is admitted and the zones name cluster 0, not a stale id of
    // another row; k + 1 long, a bound for any mix of NaN and finite scores.
    ret_ids.assign(r + 1, 0);
    est_ids.assign(k + 1, 0);
    int64_t nr = 0, ne_ = 0, tr = 0, tk = 0;
    for (int64_t c = 0; c < C; ++c) {
      const float sc = score[c];
      const int64_t tie_r = sc == thr_r, tie_k = sc == thr_k;
      const int64_t is_r = (sc > thr_r) | (tie_r & (tr < ties_r));
      const int64_t is_e = (1 - is_r) & ((sc > thr_k) | (tie_k & (tk < ties_k)));
      tr += tie_r & is_r;
      tk += tie_k & (is_r | is_e);
      ret_ids[nr] = c;
      nr += is_r;
      est_ids[ne_] = c;
      ne_ += is_e;
    }
    order.resize(k);
    std::copy(ret_ids.begin(), ret_ids.begin() + r, order.begin());
    std::copy(est_ids.begin(), est_ids.begin() + (k - r), order.begin() + r);
    if (sel != nullptr) {  // the ranking itself (tests, diagnostics)
      // by the scores' order keys: the same order as the floats' (scores are never -0),
      // and a strict weak one with NaNs too, which std::sort needs not to read out of range
      std::vector<int64_t> ranked(order);
      std::sort(ranked.begin(), ranked.end(), [&](int64_t x, int64_t y) {
        return keys[x] > keys[y] || (keys[x] == keys[y] && x < y);
      });
      for (int64_t i = 0; i < S; ++i) sel[i] = i < k ? ranked[i] : -1;
    }
  } else if (sel != nullptr) {
    for (int64_t i = 0; i < S; ++i) sel[i] = -1;
  }
  mark(1);

  // ---- 3: attention. The exact tokens (sinks, window, retrieval clusters) as one list of
  // row pointers, scored and folded in tiles of kTile rows across zone and cluster
  // boundaries (so the next rows are prefetched while the current ones are used).
  Softmax sm(G, D);
  thread_local std::vector<const void*> kp_raw, vp_raw;
  kp_raw.clear();
  vp_raw.clear();
  auto push = [&](const T* k_row, const T* v_row) {
    kp_raw.push_back(k_row);
    vp_raw.push_back(v_row);
  };
  for (int64_t i = 0; i < a.n_sink; ++i) push(a.sink_k.row(h, i), a.sink_v.row(h, i));
  for (int64_t i = 0, j = a.win_first; i < a.n_win; ++i, j = j + 1 == a.win_cap ? 0 : j + 1)
    push(a.win_k.row(h, j), a.win_v.row(h, j));
  // every retrieved cluster's start requested at once (r is small: 19 at 16K), so their
  // misses overlap instead of surfacing one per cluster in the loop below
  for (int64_t j = 0; j < r; ++j)
    __builtin_prefetch(a.cstart + h * a.cstart_h + order[j] * a.cstart_c);
  for (int64_t j = 0; j < r; ++j) {
    const int64_t c = order[j];
    const int64_t n = sz[c * a.sizes_c];
    const int64_t first =
        n > 0 ? h * a.head_rows + a.cstart[h * a.cstart_h + c * a.cstart_c] * a.start_mult : 0;
    for (int64_t i = 0; i < n; ++i)
      push(a.kv_k + (first + i) * a.kv_row, a.kv_v + (first + i) * a.kv_row);
  }
  const T* const* kp = reinterpret_cast<const T* const*>(kp_raw.data());
  const T* const* vp = reinterpret_cast<const T* const*>(vp_raw.data());
  const int64_t n_exact = int64_t(kp_raw.size());
  mark(2);
  attend_exact(sm, q.data(), G, D, scale, kp, vp, n_exact);

  mark(3);
  // estimation zone: one block of pseudo-tokens (centroid key, log(size) bias, mean value;
  // tilted: + log-tilt mass correction and spread * vshift value correction)
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
#pragma omp simd reduction(+ : s)
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
    // pseudo-token logits: the scoring logits of the estimated clusters plus log(size)
    std::vector<float> est(size_t(G) * ne), inv_n(ne), spread(ne, 0.f);
    std::vector<float> ta(ne), ttv(ne), tden(ne);
    std::vector<float> bias(ne);
    for (int64_t j = 0; j < ne; ++j) {
      const int64_t n = sz[order[r + j] * a.sizes_c];
      bias[j] = n > 0 ? std::log(float(n)) : kNegInf;
    }
    for (int g = 0; g < G; ++g) {
      const float* lg = logits.data() + size_t(g) * C;
      float* eg = est.data() + size_t(g) * ne;
      for (int64_t j = 0; j < ne; ++j) eg[j] = lg[order[r + j]] + bias[j];
    }
    for (int64_t j = 0; j < ne; ++j) {
      const int64_t c = order[r + j];
      const int64_t n = sz[c * a.sizes_c];
      inv_n[j] = n > 0 ? 1.0f / float(n) : 0.f;
      if (tilted) {
        spread[j] = a.spreads[h * a.spreads_h + c * a.spreads_c];
        ta[j] = n > 0 ? a.deviates[h * a.dev_h + c * a.dev_c] : 0.f;
      }
    }
    if (tilted) {
#pragma omp simd
      for (int64_t j = 0; j < ne; ++j) tilt_const(ta[j], ta[j], ttv[j], tden[j]);
    }
    if (tilted) {
      for (int g = 0; g < G; ++g) {
        float* lg = est.data() + size_t(g) * ne;
        const float qv = qvar[g];
#pragma omp simd
        for (int64_t j = 0; j < ne; ++j)
          lg[j] += log_tilt(qv * spread[j], ta[j], ttv[j], tden[j]);
      }
    }
    fold_block(sm, est.data(), ne, ne, tilted ? spread.data() : nullptr);
    thread_local std::vector<const void*> vrow_raw;
    vrow_raw.resize(ne);
    const T** vrow = reinterpret_cast<const T**>(vrow_raw.data());
    for (int64_t j = 0; j < ne; ++j) vrow[j] = a.vsum + h * a.vsum_h + order[r + j] * a.vsum_c;
    for (int64_t j0 = 0; j0 < ne; j0 += kTile) {  // the next tile's rows prefetched
      const int64_t nt = std::min<int64_t>(kTile, ne - j0);
      for (int64_t j = j0 + kTile; j < std::min<int64_t>(j0 + 2 * kTile, ne); ++j)
        for (int d = 0; d < D * int(sizeof(T)); d += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vrow[j]) + d, 0, kPrefetchLocality);
      add_rows(sm.acc.data(), G, D, est.data() + j0, ne, inv_n.data() + j0, vrow + j0, nt);
    }
    if (tilted) {
      for (int g = 0; g < G; ++g) {
        float* acc = sm.acc.data() + size_t(g) * D;
        const float* vs = vshift.data() + size_t(g) * D;
        for (int d = 0; d < D; ++d) acc[d] += sm.sw[g] * vs[d];
      }
    }
  }
  write_output(sm, G, D, out, out_head_stride, lse);
  mark(4);
}

template <typename T>
void run_rows(const std::vector<RowArgs<T>>& rows, const torch::Tensor& query,
              torch::Tensor& out, torch::Tensor& lse, torch::Tensor& sel, double scale,
              bool tilted, int64_t* phase_ns, int64_t H);

template <typename T>
void decode_rows_impl(const torch::Tensor& query, torch::Tensor& out, torch::Tensor& lse,
                      torch::Tensor& sel, double scale, const std::vector<torch::Tensor>& meta,
                      const std::vector<torch::Tensor>& tilt,
                      const std::vector<torch::Tensor>& kv,
                      const std::vector<torch::Tensor>& steady,
                      const std::vector<int64_t>& ints, bool tilted,
                      const std::vector<torch::Tensor>& given, int64_t* phase_ns) {
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t H = meta.empty() ? 0 : meta[0].size(0);
  RETRO_CHECK(H > 0 && Hq % H == 0, "retro_cpu: query heads ", Hq, " not a multiple of KV heads ", H);
  std::vector<RowArgs<T>> rows(B);
  for (int64_t b = 0; b < B; ++b) {
    RowArgs<T>& a = rows[b];
    const torch::Tensor& cent = meta[5 * b], &vsum = meta[5 * b + 1], &sz = meta[5 * b + 2],
                         &sp = meta[5 * b + 3], &dv = meta[5 * b + 4];
    RETRO_CHECK(cent.size(0) == H && (cent.size(2) == D || cent.size(2) == 2 * D) &&
                    cent.stride(2) == 1, "retro_cpu: centroids");
    RETRO_CHECK(vsum.stride(2) == 1 && sz.scalar_type() == torch::kInt32, "retro_cpu: value sums / sizes");
    a.C = cent.size(1);
    a.cent = cent.data_ptr<T>(); a.cent_h = cent.stride(0); a.cent_c = cent.stride(1);
    a.vsum = vsum.data_ptr<T>(); a.vsum_h = vsum.stride(0); a.vsum_c = vsum.stride(1);
    a.sizes = sz.data_ptr<int32_t>(); a.sizes_h = sz.stride(0); a.sizes_c = sz.stride(1);
    if (tilted) {
      a.spreads = sp.data_ptr<float>(); a.spreads_h = sp.stride(0); a.spreads_c = sp.stride(1);
      a.deviates = dv.data_ptr<float>(); a.dev_h = dv.stride(0); a.dev_c = dv.stride(1);
      const torch::Tensor &prof = tilt[3 * b], &kf = tilt[3 * b + 1], &vf = tilt[3 * b + 2];
      RETRO_CHECK(prof.is_contiguous() && kf.is_contiguous() && vf.is_contiguous(),
                  "retro_cpu: residual model terms must be contiguous");
      a.profile = prof.data_ptr<float>(); a.kfac = kf.data_ptr<float>();
      a.vfac = vf.data_ptr<float>(); a.rank = kf.size(2);
    }
    const torch::Tensor &kk = kv[3 * b], &vv = kv[3 * b + 1], &cs = kv[3 * b + 2];
    RETRO_CHECK(kk.stride(-1) == 1 && kk.size(-1) == D, "retro_cpu: KV pool rows");
    a.kv_k = kk.data_ptr<T>(); a.kv_v = vv.data_ptr<T>(); a.kv_row = kk.stride(-2);
    if (a.C > 0) {
      RETRO_CHECK(cs.scalar_type() == torch::kInt64 && cs.size(1) >= a.C, "retro_cpu: cluster starts");
      a.cstart = cs.data_ptr<int64_t>(); a.cstart_h = cs.stride(0); a.cstart_c = cs.stride(1);
    }
    a.head_rows = ints[7 * b]; a.start_mult = ints[7 * b + 1];
    a.n_sink = ints[7 * b + 2]; a.n_win = ints[7 * b + 3]; a.win_first = ints[7 * b + 4];
    a.r = ints[7 * b + 5]; a.e = ints[7 * b + 6];
    a.split = cent.size(2) == 2 * D;
    RETRO_CHECK(!a.split || a.e == 0, "retro_cpu: page bounds [H, C, 2D] estimate nothing; "
                "rows scored by them need e = 0, got ", a.e);
    a.sink_k = rows3<T>(steady[4 * b]); a.sink_v = rows3<T>(steady[4 * b + 1]);
    a.win_k = rows3<T>(steady[4 * b + 2]); a.win_v = rows3<T>(steady[4 * b + 3]);
    a.win_cap = steady[4 * b + 2].size(1);
    check_window(a.n_sink, steady[4 * b].size(1), a.n_win, a.win_first, a.win_cap);
    if (!given.empty()) {
      const torch::Tensor& gv = given[b];
      RETRO_CHECK(gv.scalar_type() == torch::kInt64 && gv.dim() == 2 && gv.size(0) == H &&
                      (gv.size(1) == 0 || gv.stride(1) == 1),
                  "retro_cpu: a given selection must be int64 [H, n]");
      if (gv.numel()) {
        const auto [lo, hi] = gv.aminmax();
        RETRO_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < sz.size(1),
                    "retro_cpu: a given cluster id is out of range; accepted: 0 to ",
                    sz.size(1) - 1);
        RETRO_CHECK(cs.scalar_type() == torch::kInt64 && cs.size(1) >= sz.size(1),
                    "retro_cpu: cluster starts");
        a.cstart = cs.data_ptr<int64_t>(); a.cstart_h = cs.stride(0); a.cstart_c = cs.stride(1);
      }
      a.has_given = true;
      a.given = gv.data_ptr<int64_t>(); a.given_h = gv.stride(0); a.n_given = gv.size(1);
    }
  }
  run_rows<T>(rows, query, out, lse, sel, scale, tilted, phase_ns, H);
}

// The (row, KV head) pairs of `rows` (H heads each) run in parallel into out, lse and sel
// (see decode_rows).
template <typename T>
void run_rows(const std::vector<RowArgs<T>>& rows, const torch::Tensor& query,
              torch::Tensor& out, torch::Tensor& lse, torch::Tensor& sel, double scale,
              bool tilted, int64_t* phase_ns, int64_t H) {
  const int64_t B = query.size(0), D = query.size(2);
  const int G = int(query.size(1) / H);
  const T* qp = query.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  int64_t* sp = sel.numel() ? sel.data_ptr<int64_t>() : nullptr;
  const int64_t S = sel.numel() ? sel.size(2) : 0;
  const float sc = float(scale);
  // (row, KV head) tasks taken one at a time by whichever thread is free: their costs differ
  // (rows of different lengths, zones of different sizes), and a static split left threads
  // waiting at the join
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next_task++; i < B * H; i = next_task++) {
      const int64_t b = i / H, h = i % H;
      run_head<T>(rows[b], h, qp + b * query.stride(0) + h * G * query.stride(1),
                  query.stride(1), G, int(D), sc, tilted,
                  op + b * out.stride(0) + h * G * out.stride(1), out.stride(1),
                  lp + b * lse.stride(0) + h * G,
                  sp ? sp + b * sel.stride(0) + h * sel.stride(1) : nullptr, S,
                  phase_ns ? phase_ns + i * kPhases : nullptr);
    }
  });
}

// PQCache's step for one (row, KV head), see pq_decode below.
template <typename T>
void pq_head(const float* q, int G, int D, float scale, const uint8_t* codes, int64_t n, int m,
             const float* books, int64_t K, int64_t k, const int64_t* tok_cluster,
             const int64_t* tok_offset, const int64_t* starts, int64_t head_base,
             int64_t mult, const T* pk, const T* pv, int64_t ld, const Rows<T>& sink_k,
             const Rows<T>& sink_v, int64_t n_sink, const Rows<T>& win_k,
             const Rows<T>& win_v, int64_t n_win, int64_t win_first, int64_t win_cap,
             int64_t h, T* out, int64_t out_stride,
             float* lse, int64_t* sel) {
  const int ds = D / m;
  // lookup tables lut[g][s][c] = scale * q_g,s . codeword_s,c
  thread_local std::vector<float> lut, logit, score, vals;
  lut.resize(size_t(G) * m * K);
  for (int g = 0; g < G; ++g)
    for (int sub = 0; sub < m; ++sub)
      for (int64_t c = 0; c < K; ++c) {
        const float* w = books + (size_t(sub) * K + c) * ds;
        const float* qs = q + size_t(g) * D + size_t(sub) * ds;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < ds; ++d) dot += qs[d] * w[d];
        lut[(size_t(g) * m + sub) * K + c] = dot * scale;
      }
  // score[i] = sum_g softmax_i(logit[g])[i]
  score.assign(n, 0.f);
  logit.resize(n);
  for (int g = 0; g < G; ++g) {
    const float* lg = lut.data() + size_t(g) * m * K;
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* ci = codes + i * m;
      float l = 0.f;
      for (int sub = 0; sub < m; ++sub) l += lg[sub * K + ci[sub]];
      logit[i] = l;
      mx = std::max(mx, l);
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      logit[i] = fast_exp(logit[i] - mx);
      sum += logit[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) score[i] += logit[i] * inv;
  }
  // the top k by (score desc, index asc), listed in index order
  thread_local std::vector<const void*> kp, vp;
  kp.clear();
  vp.clear();
  for (int64_t t = 0; t < n_sink; ++t) {
    kp.push_back(sink_k.row(h, t));
    vp.push_back(sink_v.row(h, t));
  }
  for (int64_t t = 0, j = win_first; t < n_win; ++t, j = j + 1 == win_cap ? 0 : j + 1) {
    kp.push_back(win_k.row(h, j));
    vp.push_back(win_v.row(h, j));
  }
  if (k > 0) {
    vals.assign(score.begin(), score.end());
    std::nth_element(vals.begin(), vals.begin() + (k - 1), vals.end(), std::greater<float>());
    const float thr = vals[k - 1];
    int64_t above = 0;
    for (int64_t i = 0; i < n; ++i) above += score[i] > thr;
    int64_t ties = k - above, taken = 0;
    for (int64_t i = 0; i < n && taken < k; ++i) {
      const bool tie = score[i] == thr;
      if (!(score[i] > thr || (tie && ties > 0))) continue;
      ties -= tie;
      const int64_t row = head_base + starts[tok_cluster[i]] * mult + tok_offset[i];
      kp.push_back(pk + row * ld);
      vp.push_back(pv + row * ld);
      if (sel != nullptr) sel[taken] = i;
      ++taken;
    }
  }
  Softmax sm(G, D);
  attend_exact(sm, q, G, D, scale, reinterpret_cast<const T* const*>(kp.data()),
               reinterpret_cast<const T* const*>(vp.data()), int64_t(kp.size()));
  write_output(sm, G, D, out, out_stride, lse);
}

template <typename T>
void pq_decode_impl(const torch::Tensor& query, torch::Tensor& out, torch::Tensor& lse,
                    torch::Tensor& sel, double scale, const std::vector<torch::Tensor>& pq,
                    const std::vector<torch::Tensor>& pools,
                    const std::vector<torch::Tensor>& steady,
                    const std::vector<int64_t>& ints) {
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t H = pq[0].size(0);
  RETRO_CHECK(Hq % H == 0, "retro_cpu: query heads ", Hq, " not a multiple of KV heads ", H);
  const int G = int(Hq / H);
  for (int64_t b = 0; b < B; ++b) {
    const torch::Tensor &codes = pq[5 * b], &books = pq[5 * b + 1], &tc = pq[5 * b + 2],
                        &to = pq[5 * b + 3], &st = pq[5 * b + 4];
    RETRO_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 3 && codes.size(0) == H &&
                    codes.stride(2) == 1 && codes.stride(1) == codes.size(2),
                "retro_cpu: codes must be uint8 [H, N, m], rows contiguous");
    RETRO_CHECK(books.scalar_type() == torch::kFloat && books.is_contiguous() &&
                    books.dim() == 4 && books.size(1) == codes.size(2) &&
                    books.size(1) * books.size(3) == D,
                "retro_cpu: codebooks must be contiguous fp32 [H, m, K, D / m]");
    RETRO_CHECK(tc.scalar_type() == torch::kInt64 && to.scalar_type() == torch::kInt64 &&
                    tc.numel() >= codes.size(1) && to.numel() >= codes.size(1) &&
                    st.scalar_type() == torch::kInt64 && st.is_contiguous(),
                "retro_cpu: token maps and cluster starts must be int64");
    RETRO_CHECK(pools[2 * b].stride(1) == 1 && pools[2 * b].size(1) == D,
                "retro_cpu: pools must be [rows, D] with D contiguous");
    check_window(steady[4 * b].size(1), steady[4 * b].size(1), ints[5 * b + 3],
                 ints[5 * b + 4], steady[4 * b + 2].size(1));
  }
  const T* qp = query.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  int64_t* sp = sel.numel() ? sel.data_ptr<int64_t>() : nullptr;
  const float sc = float(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(size_t(G) * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const torch::Tensor &codes = pq[5 * b], &books = pq[5 * b + 1], &st = pq[5 * b + 4];
      const torch::Tensor &pk = pools[2 * b], &pv = pools[2 * b + 1];
      const T* qb = qp + b * query.stride(0) + h * G * query.stride(1);
      for (int g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) q[size_t(g) * D + d] = to_f(qb[g * query.stride(1) + d]);
      const int64_t n = codes.size(1), m = codes.size(2), K = books.size(2);
      const int64_t k = std::min<int64_t>(ints[5 * b], n);
      pq_head<T>(q.data(), G, int(D), sc, codes.data_ptr<uint8_t>() + h * codes.stride(0), n,
                 int(m), books.data_ptr<float>() + h * books.stride(0), K, k,
                 pq[5 * b + 2].data_ptr<int64_t>(), pq[5 * b + 3].data_ptr<int64_t>(),
                 st.data_ptr<int64_t>() + h * st.stride(0), ints[5 * b + 1] * h,
                 ints[5 * b + 2], pk.data_ptr<T>(), pv.data_ptr<T>(), pk.stride(0),
                 rows3<T>(steady[4 * b]), rows3<T>(steady[4 * b + 1]), steady[4 * b].size(1),
                 rows3<T>(steady[4 * b + 2]), rows3<T>(steady[4 * b + 3]), ints[5 * b + 3],
                 ints[5 * b + 4], steady[4 * b + 2].size(1), h,
                 op + b * out.stride(0) + h * G * out.stride(1), out.stride(1),
                 lp + b * lse.stride(0) + h * G,
                 sp ? sp + b * sel.stride(0) + h * sel.stride(1) : nullptr);
    }
  });
}

}  // namespace

// PQCache's decode step for a batch of rows, on the CPU, one call per layer: per (row b,
// KV head h), in parallel, the lookup tables of the G query heads, every indexed token's
// score (the group's summed softmax of its lookup-table logits), the top k_b tokens by
// (score desc, index asc), and exact attention over the steady zone and those tokens, read
// in place from the row's pool. Per row b (lists in row order):
//   pq[5b..5b+4]     codes [H, N, m] uint8, codebooks [H, m, K, D / m] f32, token ->
//                    cluster [N] int64, token -> offset in its cluster [N] int64, cluster
//                    starts [H, >=C] int64
//   pools[2b..2b+1]  keys, values [rows, D]: token i of head h is row head_rows * h +
//                    starts[h, cluster[i]] * start_mult + offset[i]
//   steady[4b..4b+3] sink keys, values [H, n_sink, D], window ring keys, values [H, cap, D]
//   ints[5b..5b+4]   k, head_rows, start_mult, n_win, win_first (the window: n_win ring rows
//                    from row win_first on, wrapping at cap)
// sel: empty, or int64 [B, H, >= max k] receiving each (row, head)'s chosen token indices
// in ascending order. The plain-torch reference is vllm_retro.index.pq_index (torch path).
void pq_decode(torch::Tensor query, torch::Tensor out, torch::Tensor lse, torch::Tensor sel,
               double scale, std::vector<torch::Tensor> pq, std::vector<torch::Tensor> pools,
               std::vector<torch::Tensor> steady, std::vector<int64_t> ints) {
  RETRO_CHECK(query.dim() == 3 && query.stride(2) == 1, "retro_cpu: query must be [B, Hq, D]");
  RETRO_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.stride(2) == 1, "retro_cpu: out must match query");
  const int64_t B = query.size(0);
  RETRO_CHECK(int64_t(pq.size()) == 5 * B && int64_t(pools.size()) == 2 * B &&
                  int64_t(steady.size()) == 4 * B && int64_t(ints.size()) == 5 * B,
              "retro_cpu: per-row argument lists do not match the batch");
  if (B == 0) return;
  switch (query.scalar_type()) {
    case torch::kFloat:
      pq_decode_impl<float>(query, out, lse, sel, scale, pq, pools, steady, ints);
      break;
    case torch::kBFloat16:
      pq_decode_impl<c10::BFloat16>(query, out, lse, sel, scale, pq, pools, steady, ints);
      break;
    case torch::kHalf:
      pq_decode_impl<c10::Half>(query, out, lse, sel, scale, pq, pools, steady, ints);
      break;
    default:
      RETRO_CHECK(false, "retro_cpu: dtype ", query.scalar_type(),
                  " is not supported; accepted: float32, bfloat16, float16");
  }
}

// See the header comment. Per row b (all lists in row order):
//   meta[5b..5b+4]   centroids [H, C, D] (or Quest's page bounds [H, C, 2D]: each page's key
//                    max then min, scored by their bound; then e = 0), value sums [H, C, D],
//                    sizes [H, C] int32,
//                    spreads [H, C] f32, deviates [H, C] f32
//   tilt[3b..3b+2]   profile [H, D], key factor [H, D, rank], value factor [H, D, rank] f32
//                    (empty list when not tilted)
//   kv[3b..3b+2]     KV pool keys, values [rows, D] (or [.., D]), cluster starts [H, >=C] int64
//   steady[4b..4b+3] sink keys, values [H, >= n_sink, D], window ring keys, values [H, cap, D]
//   ints[7b..7b+6]   head_rows, start_mult, n_sink, n_win, win_first, r, e (the window: n_win
//                    ring rows from row win_first on, wrapping at cap)
//   given[b]         (an empty list: none) int64 [H, n]: the retrieval clusters of each head,
//                    chosen by the caller; then no scoring and no estimation zone (the meta
//                    index needs only sizes and cluster starts)
// Cluster c of KV head h occupies pool rows head_rows * h + starts[h, c] * start_mult, + size.
// phase_ns: empty, or int64 [B * H, kPhases] zeroed by the caller, receiving each (row, KV
// head)'s nanoseconds in scoring, selection, row lookup, exact attention, estimation.
void decode_rows(torch::Tensor query, torch::Tensor out, torch::Tensor lse, torch::Tensor sel,
                 double scale, std::vector<torch::Tensor> meta, std::vector<torch::Tensor> tilt,
                 std::vector<torch::Tensor> kv, std::vector<torch::Tensor> steady,
                 std::vector<int64_t> ints, bool tilted, std::vector<torch::Tensor> given,
                 torch::Tensor phase_ns) {
  RETRO_CHECK(query.dim() == 3 && query.stride(2) == 1, "retro_cpu: query must be [B, Hq, D]");
  RETRO_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(2) == 1,
              "retro_cpu: out must match query");
  const int64_t B = query.size(0);
  RETRO_CHECK(int64_t(meta.size()) == 5 * B && int64_t(kv.size()) == 3 * B &&
                  int64_t(steady.size()) == 4 * B && int64_t(ints.size()) == 7 * B &&
                  (!tilted || int64_t(tilt.size()) == 3 * B) &&
                  (given.empty() || int64_t(given.size()) == B),
              "retro_cpu: per-row argument lists do not match the batch");
  if (B == 0) return;
  int64_t* ph = nullptr;
  if (phase_ns.numel()) {
    RETRO_CHECK(phase_ns.scalar_type() == torch::kInt64 && phase_ns.is_contiguous() &&
                    phase_ns.numel() == B * meta[0].size(0) * kPhases,
                "retro_cpu: phase_ns must be int64 [B * H, ", kPhases, "]");
    ph = phase_ns.data_ptr<int64_t>();
  }
  switch (query.scalar_type()) {
    case torch::kFloat:
      decode_rows_impl<float>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints, tilted,
                              given, ph);
      break;
    case torch::kBFloat16:
      decode_rows_impl<c10::BFloat16>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints,
                                      tilted, given, ph);
      break;
    case torch::kHalf:
      decode_rows_impl<c10::Half>(query, out, lse, sel, scale, meta, tilt, kv, steady, ints,
                                  tilted, given, ph);
      break;
    default:
      RETRO_CHECK(false, "retro_cpu: dtype ", query.scalar_type(),
                  " is not supported; accepted: float32, bfloat16, float16");
  }
}

// A layer's pools as decode_plan reads them (kernels.resident_attention.LayerPools' fields,
// in that order).
enum PoolField {
  kKeys, kValues, kScoring, kValueSums, kSizes, kStarts, kSpreads, kDeviates, kProfile,
  kKeyFactor, kValueFactor, kSteadyK, kSteadyV, kPoolFields
};
// The rows of a step plan (kernels.step_plan.PLAN_FIELDS).
enum PlanField {
  kSlot, kSteadySlot, kClusters, kRetrieval, kEstimation, kSinks, kRingStart, kWindow,
  kStep, kMetaRow, kMetaStride, kPlanFields
};

template <typename T>
void decode_plan_impl(const torch::Tensor& query, torch::Tensor& out, double scale,
                      const std::vector<torch::Tensor>& pools, const torch::Tensor& plan,
                      int64_t sink_cap, bool tilted, const torch::Tensor& given) {
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const torch::Tensor &keys = pools[kKeys], &values = pools[kValues],
                      &scoring = pools[kScoring], &vsum = pools[kValueSums],
                      &sizes = pools[kSizes], &starts = pools[kStarts],
                      &spreads = pools[kSpreads], &deviates = pools[kDeviates],
                      &profile = pools[kProfile], &kfac = pools[kKeyFactor],
                      &vfac = pools[kValueFactor], &stk = pools[kSteadyK], &stv = pools[kSteadyV];
  RETRO_CHECK(stk.dim() == 4 && stk.is_contiguous() && stv.sizes() == stk.sizes() &&
                  stv.is_contiguous() && stk.size(3) == D && stk.scalar_type() == query.scalar_type(),
              "retro_cpu: the steady pool must be contiguous [S, sinks + ring, H, ", D, "] ",
              query.scalar_type());
  const int64_t H = stk.size(2), S = stk.size(0), ring = stk.size(1) - sink_cap;
  RETRO_CHECK(H > 0 && Hq % H == 0, "retro_cpu: query heads ", Hq, " not a multiple of KV heads ", H);
  RETRO_CHECK(sink_cap >= 0 && ring >= 0, "retro_cpu: sink_cap ", sink_cap, " of ", stk.size(1),
              " steady rows");
  const int64_t W = scoring.size(-1);
  for (const torch::Tensor* t : {&scoring, &vsum, &sizes, &spreads, &deviates, &starts, &keys,
                                 &values})
    RETRO_CHECK(t->is_contiguous(), "retro_cpu: the layer's pools must be contiguous");
  RETRO_CHECK((W == D || W == 2 * D) && scoring.scalar_type() == query.scalar_type() &&
                  vsum.size(-1) == D && vsum.scalar_type() == query.scalar_type() &&
                  sizes.scalar_type() == torch::kInt32 && spreads.scalar_type() == torch::kFloat &&
                  deviates.scalar_type() == torch::kFloat,
              "retro_cpu: meta rows: scoring [M, ", D, " or ", 2 * D, "] and value sums [M, ", D,
              "] in the query's dtype, sizes int32, spreads and deviates float32");
  // rows of each meta field seen flat
  const int64_t m_score = scoring.numel() / W, m_vsum = vsum.numel() / D, m_sizes = sizes.numel(),
                m_spreads = spreads.numel(), m_dev = deviates.numel();
  RETRO_CHECK(starts.dim() == 2 && starts.scalar_type() == torch::kInt64,
              "retro_cpu: cluster starts must be int64 [rows, C]");
  const int64_t P = starts.size(0), C_cap = starts.size(1);
  // in place: one pool [M, D] that every row shares (starts absolute); else [P, N, D], a
  // region of N rows per pool row (starts relative to it)
  const bool shared = keys.dim() == 2;
  RETRO_CHECK((keys.dim() == 2 || (keys.dim() == 3 && keys.size(0) == P)) && keys.size(-1) == D &&
                  values.sizes() == keys.sizes() && keys.scalar_type() == query.scalar_type() &&
                  values.scalar_type() == query.scalar_type(),
              "retro_cpu: the cluster pool must be [M, ", D, "] or [", P, ", N, ", D,
              "] in the query's dtype");
  const int64_t N = shared ? 0 : keys.size(1);
  int64_t rank = 0;
  if (tilted) {
    RETRO_CHECK(profile.is_contiguous() && kfac.is_contiguous() && vfac.is_contiguous() &&
                    profile.scalar_type() == torch::kFloat && kfac.scalar_type() == torch::kFloat &&
                    vfac.scalar_type() == torch::kFloat && profile.sizes() == at::IntArrayRef({P, D}) &&
                    kfac.dim() == 3 && kfac.size(0) == P && kfac.size(1) == D &&
                    vfac.sizes() == kfac.sizes(),
                "retro_cpu: the residual model must be float32 [", P, ", ", D, "] and [", P, ", ",
                D, ", rank], contiguous");
    rank = kfac.size(2);
  }
  RETRO_CHECK(plan.dim() == 2 && plan.size(0) == kPlanFields && plan.size(1) == B &&
                  plan.scalar_type() == torch::kInt64 && plan.is_contiguous() && !plan.is_cuda(),
              "retro_cpu: the plan must be int64 [", int64_t(kPlanFields), ", ", B,
              "] on the CPU, contiguous");
  const bool has_given = given.numel() > 0;
  RETRO_CHECK(!has_given || (given.dim() == 3 && given.size(0) == B && given.size(1) == H &&
                             given.scalar_type() == torch::kInt64 && given.is_contiguous()),
              "retro_cpu: given clusters must be int64 [", B, ", ", H, ", W], contiguous");
  const int64_t* pl = plan.data_ptr<int64_t>();
  auto field = [&](PlanField f, int64_t b) { return pl[f * B + b]; };
  std::vector<RowArgs<T>> rows(B);
  for (int64_t b = 0; b < B; ++b) {
    RowArgs<T>& a = rows[b];
    const int64_t slot = field(kSlot, b), st = field(kSteadySlot, b), C = field(kClusters, b);
    const int64_t m0 = field(kMetaRow, b), stride = field(kMetaStride, b);
    a.C = C; a.r = field(kRetrieval, b); a.e = field(kEstimation, b);
    a.n_sink = field(kSinks, b); a.win_first = field(kRingStart, b); a.n_win = field(kWindow, b);
    RETRO_CHECK(slot >= 0 && (slot + 1) * H <= P && st >= 0 && st < S && C >= 0 && C <= C_cap &&
                    a.r >= 0 && a.e >= 0,
                "retro_cpu: plan column ", b, ": slot ", slot, " (layer rows ", P, "), steady slot ",
                st, " (of ", S, "), ", C, " clusters (at most ", C_cap, "), zones ", a.r, " + ", a.e);
    const int64_t last = m0 + (H - 1) * stride + C;  // one past the row's last meta row
    const bool scored = !has_given && C > 0 && a.r + a.e > 0, estimated = !has_given && a.e > 0;
    RETRO_CHECK(m0 >= 0 && (H == 1 || stride >= C) && last <= m_sizes &&
                    (!scored || last <= m_score) && (!estimated || last <= m_vsum) &&
                    (!(estimated && tilted) || (last <= m_spreads && last <= m_dev)),
                "retro_cpu: plan column ", b, ": meta rows ", m0, " + h * ", stride, " + ", C,
                " lie outside the meta pool");
    a.cent = scoring.data_ptr<T>() + m0 * W; a.cent_h = stride * W; a.cent_c = W;
    a.split = W == 2 * D;
    RETRO_CHECK(!a.split || a.e == 0 || has_given, "retro_cpu: page bounds [M, 2D] estimate "
                "nothing; rows scored by them need e = 0, got ", a.e);
    a.vsum = vsum.data_ptr<T>() + (estimated ? m0 * D : 0); a.vsum_h = stride * D; a.vsum_c = D;
    a.sizes = sizes.data_ptr<int32_t>() + m0; a.sizes_h = stride; a.sizes_c = 1;
    if (tilted && estimated) {
      a.spreads = spreads.data_ptr<float>() + m0; a.spreads_h = stride; a.spreads_c = 1;
      a.deviates = deviates.data_ptr<float>() + m0; a.dev_h = stride; a.dev_c = 1;
    }
    if (tilted) {
      a.profile = profile.data_ptr<float>() + slot * H * D;
      a.kfac = kfac.data_ptr<float>() + slot * H * D * rank;
      a.vfac = vfac.data_ptr<float>() + slot * H * D * rank;
      a.rank = rank;
    }
    a.kv_k = keys.data_ptr<T>() + (shared ? 0 : slot * H * N * D);
    a.kv_v = values.data_ptr<T>() + (shared ? 0 : slot * H * N * D);
    a.kv_row = D;
    a.head_rows = N; a.start_mult = 1;
    a.cstart = starts.data_ptr<int64_t>() + slot * H * C_cap; a.cstart_h = C_cap; a.cstart_c = 1;
    const int64_t row_elems = H * D;  // a steady pool row: every head's token
    const T* slot_k = stk.data_ptr<T>() + st * stk.stride(0);
    const T* slot_v = stv.data_ptr<T>() + st * stv.stride(0);
    a.sink_k = {slot_k, D, row_elems}; a.sink_v = {slot_v, D, row_elems};
    a.win_k = {slot_k + sink_cap * row_elems, D, row_elems};
    a.win_v = {slot_v + sink_cap * row_elems, D, row_elems};
    a.win_cap = ring;
    check_window(a.n_sink, sink_cap, a.n_win, a.win_first, ring);
    if (has_given) {
      RETRO_CHECK(a.r <= given.size(2), "retro_cpu: plan column ", b, ": ", a.r,
                  " given clusters of ", given.size(2));
      const int64_t* gv = given.data_ptr<int64_t>() + b * H * given.size(2);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < a.r; ++i) {
          const int64_t c = gv[h * given.size(2) + i];
          RETRO_CHECK(c >= 0 && c < C, "retro_cpu: a given cluster id is out of range: ", c,
                      " (row ", b, ", head ", h, "); accepted: 0 to ", C - 1);
        }
      a.has_given = true; a.given = gv; a.given_h = given.size(2); a.n_given = a.r;
    }
  }
  torch::Tensor lse = torch::empty({B, Hq}, torch::kFloat);
  torch::Tensor sel = torch::empty({0}, torch::kLong);
  run_rows<T>(rows, query, out, lse, sel, scale, tilted, nullptr, H);
}

// The fused decode of a layer's batch read from the layer's pools by a step plan
// (vllm_retro.index.device_layer: the CPU's device step, one call per layer step):
//   pools  the layer's tensors in PoolField order: the cluster pool's keys and values ([M, D]
//          shared, starts absolute; or [P, N, D], starts relative to the pool row's region),
//          the meta rows seen flat (scoring rows [M, D] or Quest's page bounds [M, 2D], value
//          sums [M, D], sizes [M] int32, spreads and deviates [M] f32: cluster c of KV head h
//          of plan column b at row meta_row + h * meta_stride + c), cluster starts [P, C_cap]
//          int64 (pool row slot * H + h), the residual model ([P, D], [P, D, rank], [P, D,
//          rank] f32), the steady pool's keys and values [S, sink_cap + ring, H, D];
//   plan   int64 [kPlanFields, B] (kernels.step_plan.PLAN_FIELDS);
//   given  (empty: none) int64 [B, H, W]: each head's retrieval clusters, the first
//          `retrieval` of plan column b, chosen by the caller (no scoring, no estimation).
// Pool rows and meta rows the plan does not name are never read.
void decode_plan(torch::Tensor query, torch::Tensor out, double scale,
                 std::vector<torch::Tensor> pools, torch::Tensor plan, int64_t sink_cap,
                 bool tilted, torch::Tensor given) {
  RETRO_CHECK(query.dim() == 3 && query.stride(2) == 1 && !query.is_cuda(),
              "retro_cpu: query must be [B, Hq, D] on the CPU");
  RETRO_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.stride(2) == 1, "retro_cpu: out must match query");
  RETRO_CHECK(int64_t(pools.size()) == kPoolFields, "retro_cpu: ", int64_t(kPoolFields),
              " pool tensors expected, got ", int64_t(pools.size()));
  if (query.size(0) == 0) return;
  switch (query.scalar_type()) {
    case torch::kFloat:
      decode_plan_impl<float>(query, out, scale, pools, plan, sink_cap, tilted, given);
      break;
    case torch::kBFloat16:
      decode_plan_impl<c10::BFloat16>(query, out, scale, pools, plan, sink_cap, tilted, given);
      break;
    case torch::kHalf:
      decode_plan_impl<c10::Half>(query, out, scale, pools, plan, sink_cap, tilted, given);
      break;
    default:
      RETRO_CHECK(false, "retro_cpu: dtype ", query.scalar_type(),
                  " is not supported; accepted: float32, bfloat16, float16");
  }
}

// The step's new token of every row of a layer's steady pool in one call:
// pool_k[slots[i], rows[i]] = keys[i] (and pool_v from values) for i < B. Pools [S, R, H, D]
// contiguous; keys, values [B, H, D] with D contiguous (views of the step's QKV); slots,
// rows int64 [B]. Every index is checked before anything is written. It replaces two
// index_put_ calls through the dispatcher, which cost ~20 us each with the caches as a
// decode step leaves them (bench/README.md, "Python around the kernel").
void steady_write(torch::Tensor pool_k, torch::Tensor pool_v, torch::Tensor slots,
                  torch::Tensor rows, torch::Tensor keys, torch::Tensor values) {
  RETRO_CHECK(pool_k.dim() == 4 && pool_k.is_contiguous() && pool_v.is_contiguous() &&
                  pool_v.sizes() == pool_k.sizes(),
              "retro_cpu: steady pools must be contiguous [slots, rows, H, D], K and V alike");
  const int64_t S = pool_k.size(0), R = pool_k.size(1), H = pool_k.size(2), D = pool_k.size(3);
  const auto dt = pool_k.scalar_type();
  RETRO_CHECK(keys.dim() == 3 && keys.size(1) == H && keys.size(2) == D && keys.stride(2) == 1 &&
                  values.sizes() == keys.sizes() && values.stride(2) == 1,
              "retro_cpu: new tokens must be [B, ", H, ", ", D, "] with the last dim contiguous");
  RETRO_CHECK(keys.scalar_type() == dt && values.scalar_type() == dt && pool_v.scalar_type() == dt,
              "retro_cpu: new tokens must be in the pool's dtype ", dt);
  const int64_t B = keys.size(0);
  RETRO_CHECK(slots.scalar_type() == torch::kInt64 && rows.scalar_type() == torch::kInt64 &&
                  slots.dim() == 1 && rows.dim() == 1 && slots.size(0) == B && rows.size(0) == B,
              "retro_cpu: slots and rows must be int64 [", B, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t s0 = slots.stride(0), r0 = rows.stride(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = sp[b * s0], r = rp[b * r0];
    RETRO_CHECK(s >= 0 && s < S && r >= 0 && r < R, "retro_cpu: steady row (slot ", s, ", row ",
                r, ") is outside the pool; accepted: slots 0 to ", S - 1, ", rows 0 to ", R - 1);
  }
  const int64_t esz = pool_k.element_size(), row_bytes = D * esz;
  char* pk = static_cast<char*>(pool_k.data_ptr());
  char* pv = static_cast<char*>(pool_v.data_ptr());
  const char* kp = static_cast<const char*>(keys.data_ptr());
  const char* vp = static_cast<const char*>(values.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t dst = (sp[b * s0] * R + rp[b * r0]) * H * row_bytes;
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(pk + dst + h * row_bytes, kp + (b * keys.stride(0) + h * keys.stride(1)) * esz,
                  row_bytes);
      std::memcpy(pv + dst + h * row_bytes, vp + (b * values.stride(0) + h * values.stride(1)) * esz,
                  row_bytes);
    }
  }
}

// The tilted estimator's correction, log_tilt(v, tilt_const(a)), elementwise over float32
// tensors of one shape: the fused kernel's own code, for tests against log_tilt_ref.
torch::Tensor log_tilt_grid(const torch::Tensor& v, const torch::Tensor& a) {
  RETRO_CHECK(v.scalar_type() == torch::kFloat && a.scalar_type() == torch::kFloat &&
                  v.sizes() == a.sizes(),
              "retro_cpu: log_tilt_grid takes float32 v and a of one shape");
  const torch::Tensor vc = v.contiguous(), ac = a.contiguous();
  torch::Tensor out = torch::empty_like(vc);
  const float* pv = vc.data_ptr<float>();
  const float* pa = ac.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < vc.numel(); ++i) {
    float at, tv, den;
    tilt_const(pa[i], at, tv, den);
    po[i] = log_tilt(pv[i], at, tv, den);
  }
  return out;
}

// kmeans_cpu.cpp
void kmeans_assign(torch::Tensor x, torch::Tensor centroids, torch::Tensor n_valid,
                   torch::Tensor k_valid, torch::Tensor out);

// graph_cpu.cpp (RetrievalAttention's graph index)
torch::Tensor graph_build(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>);
void graph_insert(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                  int64_t, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>);
std::vector<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>> graph_search(
    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
    std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>> graph_decode(
    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
    std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>,
    std::vector<int64_t>, std::vector<int64_t>, int64_t, double, bool);

// buffer_cpu.cpp (the wave buffer's table work)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t> buffer_lookup(
    torch::Tensor, torch::Tensor, int64_t, int64_t, torch::Tensor, int64_t, int64_t, int64_t,
    int64_t);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> buffer_lookup_batch(
    std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, int64_t, torch::Tensor,
    std::vector<int64_t>, int64_t, int64_t);

// The instruction set cluster scoring of bf16 rows uses on this CPU (tests, benchmarks),
// under the cap set_scoring_isa put on it.
std::string scoring_isa() {
#ifdef RETRO_AVX512BF16
  if (g_score_cap.load() >= kScoreAvx512 && cpu_has_avx512bf16()) return "avx512bf16";
#endif
#ifdef RETRO_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

// Caps the bf16 scoring path at isa ("avx512bf16" or "avx2"; the CPU may offer less) for
// tests and benchmarks that compare the paths; returns the path now in use.
std::string set_scoring_isa(const std::string& isa) {
#ifdef RETRO_AVX512BF16
  const int cap = isa == "avx512bf16" ? kScoreAvx512 : isa == "avx2" ? kScoreAvx2 : -1;
  RETRO_CHECK(cap >= 0, "retro_cpu: scoring isa must be one of 'avx512bf16', 'avx2', got '",
              isa, "'");
  g_score_cap.store(cap);
#endif
  return scoring_isa();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_scoring_isa", &set_scoring_isa, "Cap the bf16 scoring path (tests, benchmarks)");
  m.def("scoring_isa", &scoring_isa, "Instruction set of bf16 cluster scoring on this CPU");
  m.def("decode_rows", &decode_rows, "Fused tripartite decode of a batch of rows (CPU)");
  m.def("decode_plan", &decode_plan,
        "Fused tripartite decode of a layer's batch from its pools by a step plan (CPU)");
  m.def("steady_write", &steady_write, "A step's new token of every row of a steady pool (CPU)");
  m.def("log_tilt_grid", &log_tilt_grid, "The fused kernel's tilted correction (CPU, tests)");
  m.def("pq_decode", &pq_decode, "PQCache decode step of a batch of rows (CPU)");
  m.def("kmeans_assign", &kmeans_assign, "Fused nearest-centroid assignment (CPU)");
  m.def("graph_build", &graph_build, "RoarGraph-style projected graph over keys (CPU)");
  m.def("graph_insert", &graph_insert, "Insert nodes into graph indexes (CPU)");
  m.def("graph_search", &graph_search, "Best-first graph search per query head (CPU)");
  m.def("graph_decode", &graph_decode, "Graph index decode step: search, choose, attend (CPU)");
  // the table work runs without the GIL
  m.def("buffer_lookup", &buffer_lookup, "Wave buffer: one store's mapping-table lookup",
        py::call_guard<py::gil_scoped_release>());
  m.def("buffer_lookup_batch", &buffer_lookup_batch,
        "Wave buffer: the lookups of every store of a layer's step, in parallel",
        py::call_guard<py::gil_scoped_release>());
}
