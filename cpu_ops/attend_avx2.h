// PagedAttention's AVX2 path (cpu_ops/paged_attention.cc) for head sizes that are multiples of 8: 8 keys scored at
// once (one accumulator per key, summed across lanes by one transpose), and the weighted sum of the values
// accumulated in registers, two query heads and 32 of a head's values at a time, over blocks of keys that stay in L1.
// NOTE: AVX2 has 16 vector registers, not AVX-512's 32: a head of 64 values would take 8 of them, so neither the
// query (scores) nor the accumulators (weighted sum) are held whole; each pass holds 4 (32 values) of them beside 8
// score accumulators, or 2 heads x 4 accumulators beside 4 values.
#pragma once
#include "attention_task.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace trtbuild_cpu_ops::attention {

// 8 floats from float32, or from float16 (bits in uint16_t) widened exactly
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int64_t kChunk = 32;      // a head's values one pass holds: 4 registers
constexpr int64_t kKeyBlock = 128;  // keys whose values one block of the weighted sum reads (<= 16 KiB at head 64)

// acc[j] += q[off .. off + 8C) . key j's same values, for 8 keys of R (float, or float16 bits)
template <typename R, int C>
inline void dot8_chunk(const R* const* keys, const float* q, int64_t off, __m256* acc) {
  __m256 qv[C];
  for (int i = 0; i < C; ++i) qv[i] = _mm256_loadu_ps(q + off + 8 * i);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < C; ++i) acc[j] = _mm256_fmadd_ps(qv[i], widen8(keys[j] + off + 8 * i), acc[j]);
}

// scores[h * stride + j] = scale * (query h . key j) for 8 keys and nh query heads of size d
template <typename R>
void score8(const R* const* keys, const float* q, int64_t nh, int64_t d, float scale, float* scores, int64_t stride) {
  for (int64_t h = 0; h < nh; ++h) {
    __m256 acc[8];
    for (__m256& x : acc) x = _mm256_setzero_ps();
    const float* qh = q + h * d;
    int64_t off = 0;
    for (; off + kChunk <= d; off += kChunk) dot8_chunk<R, 4>(keys, qh, off, acc);
    switch ((d - off) / 8) {
      case 3: dot8_chunk<R, 3>(keys, qh, off, acc); break;
      case 2: dot8_chunk<R, 2>(keys, qh, off, acc); break;
      case 1: dot8_chunk<R, 1>(keys, qh, off, acc); break;
      default: break;
    }
    _mm256_storeu_ps(scores + h * stride, _mm256_mul_ps(_mm256_set1_ps(scale), transpose_sum8(acc)));
  }
}

// out[h][off .. off + 8C) += sum_j probs[h][j] v_j's same values, for keys j0 .. j1 - 1 and HP heads
template <typename T, int C, int HP>
inline void weigh_chunk(const T* const* values, int64_t j0, int64_t j1, const float* probs, int64_t stride,
                        int64_t off, float* out, int64_t d) {
  __m256 acc[HP][C];
  for (int h = 0; h < HP; ++h)
    for (int i = 0; i < C; ++i) acc[h][i] = _mm256_loadu_ps(out + h * d + off + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 v[C];
    for (int i = 0; i < C; ++i) v[i] = widen8(values[j] + off + 8 * i);
    for (int h = 0; h < HP; ++h) {
      const __m256 w = _mm256_broadcast_ss(probs + h * stride + j);
      for (int i = 0; i < C; ++i) acc[h][i] = _mm256_fmadd_ps(w, v[i], acc[h][i]);
    }
  }
  for (int h = 0; h < HP; ++h)
    for (int i = 0; i < C; ++i) _mm256_storeu_ps(out + h * d + off + 8 * i, acc[h][i]);
}

template <typename T, int HP>
void weigh_heads(const T* const* values, int64_t j0, int64_t j1, const float* probs, int64_t stride, float* out,
                 int64_t d) {
  int64_t off = 0;
  for (; off + kChunk <= d; off += kChunk) weigh_chunk<T, 4, HP>(values, j0, j1, probs, stride, off, out, d);
  switch ((d - off) / 8) {
    case 3: return weigh_chunk<T, 3, HP>(values, j0, j1, probs, stride, off, out, d);
    case 2: return weigh_chunk<T, 2, HP>(values, j0, j1, probs, stride, off, out, d);
    case 1: return weigh_chunk<T, 1, HP>(values, j0, j1, probs, stride, off, out, d);
    default: return;
  }
}

// the cache lines of one row of d values of T, into L1 (keys about to be scored) or L2 (values for the weighted sum)
template <_mm_hint kHint, typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* at = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < d * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(at + i, kHint);
}

inline float max_of(const float* p, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + j));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  float result = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  for (; j < n; ++j) result = std::max(result, p[j]);
  return result;
}

inline bool avx2_attends(int64_t d) { return d % 8 == 0; }

// A task whose head size is a multiple of 8, over a pool of T (float, or float16 bits).
template <typename T>
void attend_avx2(const Task& a) {
  const int64_t d = a.s.d, nh = a.nh;
  const int64_t visible = a.visible - a.first, stride = (visible + 7) / 8 * 8;  // keys a.first .. as 0 ..
  thread_local std::vector<float> probs;    // [nh, stride]: scores, then probabilities
  thread_local std::vector<const T*> rows;  // keys (padded to 8 with a row of zeros), then values
  thread_local std::vector<T> zeros;
  thread_local std::vector<float> widened;  // 8 float16 keys as float32
  probs.resize(static_cast<size_t>(nh * stride));
  rows.resize(static_cast<size_t>(stride + visible));
  zeros.assign(static_cast<size_t>(d), T{});
  const T** values = rows.data() + stride;
  a.rows(rows.data(), values);
  for (int64_t j = visible; j < stride; ++j) rows[j] = zeros.data();
  const float* q = a.queries();
  // NOTE: the pool's rows are scattered over a pool far larger than the caches, a few KiB per block: while 8 keys
  // are scored, the next 16 are fetched and their values brought into L2 for the weighted sum
  const int64_t pooled = std::max<int64_t>(0, std::min(a.past, a.visible) - a.first);  // of keys first ..
  for (int64_t j = 0; j < std::min<int64_t>(16, pooled); ++j) prefetch_row<_MM_HINT_T0>(rows[j], d);
  for (int64_t j0 = 0; j0 < visible; j0 += 8) {
    for (int64_t j = j0; j < std::min(j0 + 8, pooled); ++j) {
      prefetch_row<_MM_HINT_T1>(values[j], d);
      if (j + 16 < pooled) prefetch_row<_MM_HINT_T0>(rows[j + 16], d);
    }
    if (std::is_same_v<T, float> || nh == 1) {
      score8<T>(rows.data() + j0, q, nh, d, a.s.scale, probs.data() + j0, stride);
    } else {  // NOTE: widen the 8 float16 keys once for all the task's query heads, not once per head
      widened.resize(static_cast<size_t>(8 * d));
      const float* keys[8];
      for (int64_t j = 0; j < 8; ++j) {
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(widened.data() + j * d + i, widen8(rows[j0 + j] + i));
        keys[j] = widened.data() + j * d;
      }
      score8<float>(keys, q, nh, d, a.s.scale, probs.data() + j0, stride);
    }
  }
  const float cap = a.s.softcap;
  float* out = a.out();
  for (int64_t h = 0; h < nh; ++h) {
    float* p = probs.data() + h * stride;
    if (cap > 0.0f) soft_cap(p, visible, cap);
    const float inv = inverse_denominator(a, h, max_of(p, visible),
                                          [&](float max_score) { return exp_shifted(p, visible, max_score); });
    for (int64_t j = 0; j < visible; ++j) p[j] *= inv;
  }
  std::fill(out, out + nh * d, 0.0f);
  for (int64_t j0 = 0; j0 < visible; j0 += kKeyBlock) {
    const int64_t j1 = std::min(visible, j0 + kKeyBlock);
    int64_t h = 0;
    for (; h + 2 <= nh; h += 2) weigh_heads<T, 2>(values, j0, j1, probs.data() + h * stride, stride, out + h * d, d);
    if (h < nh) weigh_heads<T, 1>(values, j0, j1, probs.data() + h * stride, stride, out + h * d, d);
  }
}
}  // namespace trtbuild_cpu_ops::attention
#endif
