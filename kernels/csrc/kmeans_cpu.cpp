// Nearest-centroid assignment of spherical k-means on CPU: the similarity GEMM and the
// argmax fused, so the [sets, points, clusters] similarity matrix is never written.
//
// For every set s (one (KV head, segment) of a block) and valid point n < n_valid[s]:
//   out[s, n] = the first c < k_valid[s] maximising x[s, n] . centroids[s, c]
// and out[s, n] = -1 for padding points. This is kernels.kmeans.kmeans_assign_ref's function;
// each dot product is one fp32 fused-multiply-add chain in feature order, so results can differ
// from the reference GEMM's rounding only where two clusters tie to ~1e-6.
//
// Layout: each set's centroids are packed transposed ([D, K rounded up to 16], zero padded), so
// a micro-tile of 6 points x 16 centroids keeps its 12 eight-lane accumulators in registers
// while the points' features are broadcast (the usual GEMM register blocking); after each tile
// the lanes update a running (best similarity, first index) per lane, and the 16 lanes are
// reduced once per point at the end.
#include <torch/extension.h>

#include "retro_check.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RETRO_KMEANS_AVX2 1
#endif

namespace {

constexpr int kPoints = 6;     // points per micro-tile
constexpr int kCols = 16;      // centroids per micro-tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The first index of the largest value among lanes (value, index) pairs: larger value wins,
// equal values go to the lower index (argmax's first occurrence).
inline int64_t reduce_lanes(const float* v, const int32_t* idx, int n) {
  float bv = v[0];
  int32_t bi = idx[0];
  for (int l = 1; l < n; ++l)
    if (v[l] > bv || (v[l] == bv && idx[l] < bi)) { bv = v[l]; bi = idx[l]; }
  return bi;
}

// Assign R points (rows of x, D features each) against one set's packed centroids
// ct [D, kp] (kv valid columns).
template <int R>
void assign_points(const float* x, int64_t D, const float* ct, int64_t kp, int64_t kv,
                   int64_t* out) {
#ifdef RETRO_KMEANS_AVX2
  __m256 best[R][2];
  __m256i best_i[R][2];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) {
      best[i][j] = _mm256_set1_ps(kNegInf);
      best_i[i][j] = _mm256_setzero_si256();
    }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k0 = 0; k0 < kv; k0 += kCols) {
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const float* c = ct + k0;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 c0 = _mm256_loadu_ps(c + d * kp), c1 = _mm256_loadu_ps(c + d * kp + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 xb = _mm256_broadcast_ss(x + i * D + d);
        acc[i][0] = _mm256_fmadd_ps(xb, c0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xb, c1, acc[i][1]);
      }
    }
    const __m256i i0 = _mm256_add_epi32(lane, _mm256_set1_epi32(int32_t(k0)));
    const __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
    if (k0 + kCols > kv) {  // the last tile: columns past kv are padding
      const __m256i lim = _mm256_set1_epi32(int32_t(kv));
      const __m256 in0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, i0));
      const __m256 in1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, i1));
      const __m256 ninf = _mm256_set1_ps(kNegInf);
      for (int i = 0; i < R; ++i) {
        acc[i][0] = _mm256_blendv_ps(ninf, acc[i][0], in0);
        acc[i][1] = _mm256_blendv_ps(ninf, acc[i][1], in1);
      }
    }
    for (int i = 0; i < R; ++i) {  // strictly greater: a lane keeps its first maximum
      const __m256 g0 = _mm256_cmp_ps(acc[i][0], best[i][0], _CMP_GT_OQ);
      const __m256 g1 = _mm256_cmp_ps(acc[i][1], best[i][1], _CMP_GT_OQ);
      best[i][0] = _mm256_blendv_ps(best[i][0], acc[i][0], g0);
      best[i][1] = _mm256_blendv_ps(best[i][1], acc[i][1], g1);
      best_i[i][0] = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(best_i[i][0]), _mm256_castsi256_ps(i0), g0));
      best_i[i][1] = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(best_i[i][1]), _mm256_castsi256_ps(i1), g1));
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float v[kCols];
    alignas(32) int32_t idx[kCols];
    _mm256_store_ps(v, best[i][0]);
    _mm256_store_ps(v + 8, best[i][1]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), best_i[i][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx + 8), best_i[i][1]);
    out[i] = reduce_lanes(v, idx, kCols);
  }
#else
  float best[R][kCols];
  int32_t best_i[R][kCols];
  for (int i = 0; i < R; ++i)
    for (int l = 0; l < kCols; ++l) { best[i][l] = kNegInf; best_i[i][l] = 0; }
  for (int64_t k0 = 0; k0 < kv; k0 += kCols) {
    float acc[R][kCols] = {};
    const float* c = ct + k0;
    for (int64_t d = 0; d < D; ++d)
      for (int i = 0; i < R; ++i) {
        const float xv = x[i * D + d];
        for (int l = 0; l < kCols; ++l) acc[i][l] = std::fma(xv, c[d * kp + l], acc[i][l]);
      }
    for (int i = 0; i < R; ++i)
      for (int l = 0; l < kCols; ++l)
        if (k0 + l < kv && acc[i][l] > best[i][l]) {
          best[i][l] = acc[i][l];
          best_i[i][l] = int32_t(k0 + l);
        }
  }
  for (int i = 0; i < R; ++i) out[i] = reduce_lanes(best[i], best_i[i], kCols);
#endif
}

using AssignFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t*);
constexpr AssignFn kAssign[kPoints + 1] = {nullptr,          assign_points<1>, assign_points<2>,
                                           assign_points<3>, assign_points<4>, assign_points<5>,
                                           assign_points<6>};

}  // namespace

// x [S, N, D] fp32, centroids [S, K, D] fp32 (both contiguous), n_valid / k_valid [S] int64;
// writes out [S, N] int64. See the header comment.
void kmeans_assign(torch::Tensor x, torch::Tensor centroids, torch::Tensor n_valid,
                   torch::Tensor k_valid, torch::Tensor out) {
  RETRO_CHECK(x.dim() == 3 && centroids.dim() == 3 && x.size(0) == centroids.size(0) &&
                  x.size(2) == centroids.size(2),
              "retro_cpu.kmeans_assign: x must be [S, N, D] and centroids [S, K, D]");
  RETRO_CHECK(x.scalar_type() == torch::kFloat && centroids.scalar_type() == torch::kFloat &&
                  x.is_contiguous() && centroids.is_contiguous(),
              "retro_cpu.kmeans_assign: x and centroids must be contiguous float32");
  RETRO_CHECK(n_valid.scalar_type() == torch::kLong && k_valid.scalar_type() == torch::kLong &&
                  n_valid.is_contiguous() && k_valid.is_contiguous() &&
                  n_valid.numel() == x.size(0) && k_valid.numel() == x.size(0),
              "retro_cpu.kmeans_assign: n_valid and k_valid must be [S] int64");
  RETRO_CHECK(out.scalar_type() == torch::kLong && out.is_contiguous() &&
                  out.size(0) == x.size(0) && out.size(1) == x.size(1),
              "retro_cpu.kmeans_assign: out must be [S, N] int64");
  const int64_t S = x.size(0), N = x.size(1), D = x.size(2), K = centroids.size(1);
  const int64_t kp = (K + kCols - 1) / kCols * kCols;
  const int64_t* nv = n_valid.data_ptr<int64_t>();
  const int64_t* kv = k_valid.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    RETRO_CHECK(nv[s] >= 0 && nv[s] <= N && kv[s] >= 0 && kv[s] <= K,
                "retro_cpu.kmeans_assign: set ", s, " has n_valid ", nv[s], " (accepted 0..", N,
                ") and k_valid ", kv[s], " (accepted 0..", K, ")");
  std::vector<float> packed(size_t(S) * D * kp, 0.f);
  const float* cp = centroids.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      float* ct = packed.data() + size_t(s) * D * kp;
      const float* c = cp + s * K * D;
      for (int64_t k = 0; k < kv[s]; ++k)
        for (int64_t d = 0; d < D; ++d) ct[d * kp + k] = c[k * D + d];
    }
  });
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t tiles = (N + kPoints - 1) / kPoints;
  at::parallel_for(0, S * tiles, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t s = t / tiles, n0 = (t % tiles) * kPoints;
      int64_t* o = op + s * N + n0;
      const int64_t valid = std::min<int64_t>(std::max<int64_t>(nv[s] - n0, 0),
                                              std::min<int64_t>(kPoints, N - n0));
      if (valid > 0)
        kAssign[valid](xp + (s * N + n0) * D, D, packed.data() + size_t(s) * D * kp, kp, kv[s], o);
      for (int64_t i = valid; i < std::min<int64_t>(kPoints, N - n0); ++i) o[i] = -1;
    }
  });
}
