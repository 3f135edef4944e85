// PagedAttention's AVX-512 path (cpu_ops/paged_attention.cc): head sizes of 16 to 128 in steps of 16, and 256;
// 16 keys scored at once (one accumulator per key, summed across lanes by one transpose), exp of 16 scores at a time,
// and the weighted sum of the values kept in registers for up to 16 / (head size / 16) query heads.
#pragma once
#include "attention_task.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
namespace trtbuild_cpu_ops::attention {
template <int DV, typename T>
inline void prefetch(const T* row, int hint) {
  constexpr int kLines = (16 * DV * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int i = 0; i < kLines; ++i) {
    const char* at = reinterpret_cast<const char*>(row) + 64 * i;
    hint == _MM_HINT_T0 ? _mm_prefetch(at, _MM_HINT_T0) : _mm_prefetch(at, _MM_HINT_T1);
  }
}
constexpr int64_t kAhead = 16;  // value rows prefetched ahead of the weighted sum

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// out[h] = sum_j probs[h][j] v_j * inv[h] for `hp` <= HP heads, accumulated in registers; the first `pooled` values
// come from the pool (prefetched ahead).
template <typename T, int DV, int HP>
void weighted_values(const T* const* values, int64_t visible, int64_t pooled, const float* probs, int64_t stride,
                     const float* inv, int64_t hp, float* out) {
  __m512 acc[HP][DV];
  for (int h = 0; h < HP; ++h)
    for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < visible; ++j) {
    if (j + kAhead < pooled) prefetch<DV>(values[j + kAhead], _MM_HINT_T0);
    __m512 v[DV];
#pragma GCC unroll 8
    for (int i = 0; i < DV; ++i) v[i] = widen16(values[j] + 16 * i);
#pragma GCC unroll 16
    for (int h = 0; h < HP; ++h) {
      if (h >= hp) break;
      const __m512 w = _mm512_set1_ps(probs[h * stride + j]);
#pragma GCC unroll 8
      for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_fmadd_ps(w, v[i], acc[h][i]);
    }
  }
  for (int h = 0; h < hp; ++h)
    for (int i = 0; i < DV; ++i)
      _mm512_storeu_ps(out + h * 16 * DV + 16 * i, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])));
}

// scores[h * stride + j] = scale * (query h . key j) for 16 keys of R (float, or float16 bits) and nh query heads.
// NOTE: at most 8 registers of the query are held at once (beside 16 accumulators): a 256-wide head (Gemma) is
// scored in two passes over its halves, where holding all 16 would spill the accumulators.
template <typename R, int DV>
inline void score16(const R* const* keys, const float* q, int64_t nh, __m512 scale, float* scores, int64_t stride) {
  constexpr int kQ = DV < 8 ? DV : 8;
  static_assert(DV % kQ == 0, "head sizes past 128 are multiples of 128");
  for (int64_t h = 0; h < nh; ++h) {
    __m512 acc[16];
#pragma GCC unroll 2
    for (int i0 = 0; i0 < DV; i0 += kQ) {
      __m512 qv[kQ];
#pragma GCC unroll 8
      for (int i = 0; i < kQ; ++i) qv[i] = _mm512_loadu_ps(q + h * 16 * DV + 16 * (i0 + i));
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        int i = 0;
        if (i0 == 0) acc[j] = _mm512_mul_ps(qv[i++], widen16(keys[j]));
#pragma GCC unroll 8
        for (; i < kQ; ++i) acc[j] = _mm512_fmadd_ps(qv[i], widen16(keys[j] + 16 * (i0 + i)), acc[j]);
      }
    }
    _mm512_storeu_ps(scores + h * stride, _mm512_mul_ps(scale, transpose_sum16(acc)));
  }
}

// A task whose head size is 16 * DV, over a pool of T (float, or float16 bits).
template <typename T, int DV>
void attend_vectorized(const Task& a) {
  constexpr int64_t kD = 16 * DV, kHeadsPerPass = 16 / DV;
  // keys first .. a.visible - 1 as rows 0 .. visible - 1 here
  const int64_t visible = a.visible - a.first, stride = (visible + 15) / 16 * 16;
  thread_local std::vector<float> probs;  // [nh, stride]: scores, then unnormalized probabilities
  thread_local std::vector<const T*> rows;  // keys, then values
  thread_local std::vector<float> inv;
  probs.resize(static_cast<size_t>(a.nh * stride));
  rows.resize(static_cast<size_t>(stride + visible));  // keys (padded to 16 with a row of zeros), then values
  inv.resize(static_cast<size_t>(a.nh));
  alignas(64) static const T zeros[16 * DV] = {};
  const T** values = rows.data() + stride;
  a.rows(rows.data(), values);
  for (int64_t j = visible; j < stride; ++j) rows[j] = zeros;
  const float* q = a.queries();
  const __m512 scale = _mm512_set1_ps(a.s.scale);
  const float cap = a.s.softcap;
  // NOTE: the pool's rows come from a pool far larger than the caches, a few KiB per block: while 16 keys are
  // scored, the next 16 are fetched and their values brought into L2 for the weighted sum (the step's own new rows
  // are in cache already)
  const int64_t pooled = std::max<int64_t>(0, std::min(a.past, a.visible) - a.first);  // of keys first ..
  for (int64_t j = 0; j < std::min<int64_t>(16, pooled); ++j) prefetch<DV>(rows[j], _MM_HINT_T0);
  for (int64_t j0 = 0; j0 < visible; j0 += 16) {
    for (int64_t j = j0; j < std::min(j0 + 16, pooled); ++j) {
      prefetch<DV>(values[j], _MM_HINT_T1);
      if (j + 16 < pooled) prefetch<DV>(rows[j + 16], _MM_HINT_T0);
    }
    float* scores = probs.data() + j0;
    if (std::is_same_v<T, float> || a.nh == 1) {
      score16<T, DV>(rows.data() + j0, q, a.nh, scale, scores, stride);
    } else {  // NOTE: widen the 16 float16 keys once for all the task's query heads, not once per head
      alignas(64) float widened[16 * kD];
      const float* keys[16];
      for (int j = 0; j < 16; ++j) {
        for (int i = 0; i < DV; ++i) _mm512_store_ps(widened + j * kD + 16 * i, widen16(rows[j0 + j] + 16 * i));
        keys[j] = widened + j * kD;
      }
      score16<float, DV>(keys, q, a.nh, scale, scores, stride);
    }
  }
  for (int64_t h = 0; h < a.nh; ++h) {
    float* p = probs.data() + h * stride;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j0 = 0; j0 < visible; j0 += 16) {
      __m512 x = _mm512_loadu_ps(p + j0);
      if (cap > 0.0f) {
        x = _mm512_mul_ps(_mm512_set1_ps(cap), tanh16(_mm512_div_ps(x, _mm512_set1_ps(cap))));
        _mm512_storeu_ps(p + j0, x);
      }
      top = _mm512_mask_max_ps(top, first(visible - j0), top, x);
    }
    inv[h] = inverse_denominator(a, h, _mm512_reduce_max_ps(top), [&](float max_score) {
      const __m512 m = _mm512_set1_ps(max_score);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < visible; j0 += 16) {
        const __m512 e = _mm512_maskz_mov_ps(first(visible - j0), exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j0), m)));
        _mm512_storeu_ps(p + j0, e);
        sum = _mm512_add_ps(sum, e);
      }
      return _mm512_reduce_add_ps(sum);
    });
  }
  for (int64_t h = 0; h < a.nh; h += kHeadsPerPass)
    weighted_values<T, DV, kHeadsPerPass>(values, visible, pooled, probs.data() + h * stride, stride,
                                       inv.data() + h, std::min(kHeadsPerPass, a.nh - h), a.out() + h * kD);
}

inline bool avx512_attends(int64_t d) { return (d >= 16 && d <= 128 && d % 16 == 0) || d == 256; }

template <typename T>
void attend_avx512(const Task& a) {
  switch (a.s.d) {
    case 16: return attend_vectorized<T, 1>(a);
    case 32: return attend_vectorized<T, 2>(a);
    case 48: return attend_vectorized<T, 3>(a);
    case 64: return attend_vectorized<T, 4>(a);
    case 80: return attend_vectorized<T, 5>(a);
    case 96: return attend_vectorized<T, 6>(a);
    case 112: return attend_vectorized<T, 7>(a);
    case 128: return attend_vectorized<T, 8>(a);
    default: return attend_vectorized<T, 16>(a);
  }
}
}  // namespace trtbuild_cpu_ops::attention
#endif
