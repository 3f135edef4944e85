// Vector math shared by the ops (AVX-512; AVX2 or scalar fallbacks where an op has a generic path).
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace trtbuild_cpu_ops {
#if defined(__AVX512F__)
// e^x of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial for e^r (relative error
// < 2e-7), and 2^n applied by scalef: 0 below float's range; x is capped at 88 (e^88 = 1.65e38), so never inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// tanh of 16 floats: 1 - 2 / (e^2x + 1), where exp16 caps e^2x at e^88 and flushes it to 0 far below, so the result
// stays within [-1, 1] for any finite x. NOTE: near 0 that difference cancels (absolute error ~1e-7, a large
// relative one), so |x| < 1/4 takes tanh's odd Taylor polynomial to x^9 instead (relative error < 1e-8 there).
inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f), x2 = _mm512_mul_ps(x, x);
  const __m512 e = exp16(_mm512_add_ps(x, x));
  const __m512 far = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  __m512 p = _mm512_set1_ps(62.0f / 2835.0f);
  for (const float c : {-17.0f / 315.0f, 2.0f / 15.0f, -1.0f / 3.0f}) p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(c));
  const __m512 near = _mm512_fmadd_ps(_mm512_mul_ps(x, x2), p, x);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(0.25f), _CMP_LT_OQ), far, near);
}

// Lane j of the result is the sum of v[j]'s 16 lanes: pairs, then quads, then 128-bit lanes are added in place of
// a transpose, so 16 dot products cost 45 shuffles and adds instead of 16 horizontal sums.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 floats from float32, or from float16 (bits in uint16_t) widened exactly
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  const __m512 wv = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 sum = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, sum);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane j of the result is the sum of v[j]'s 8 lanes (transpose_sum16's pairs and quads, then one 128-bit swap).
inline __m256 transpose_sum8(const __m256* v) {
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

// e^x of 8 floats, as exp16 computes it, with 2^n made in the exponent bits: x is kept within [-87, 88] so that n
// stays within float's normal exponents (e^-87 = 1.6e-38 stands for anything smaller).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// tanh of 8 floats, as tanh16 computes it (exp8 keeps e^2x within float's range, so the result stays in [-1, 1])
inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f), x2 = _mm256_mul_ps(x, x);
  const __m256 e = exp8(_mm256_add_ps(x, x));
  const __m256 far = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
  for (const float c : {-17.0f / 315.0f, 2.0f / 15.0f, -1.0f / 3.0f}) p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(c));
  const __m256 near = _mm256_fmadd_ps(_mm256_mul_ps(x, x2), p, x);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  return _mm256_blendv_ps(far, near, _mm256_cmp_ps(magnitude, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
}

// NOTE: without -ffast-math the compiler keeps a scalar sum's order and so never vectorizes it: one add at a time,
// each waiting for the last. With that and std::exp, the generic attention took 1.35-2.3x as long (Qwen2.5-0.5B
// shape, decode and prefill steps: benchmarks/paged_attention.py --compare-library, AMD EPYC Zen 3).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  if (i + 8 <= n) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    i += 8;
  }
  float sum = sum8(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += w * x[i];
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}
#endif

// p[j] = cap * tanh(p[j] / cap) for j < n (attention's soft-capping)
inline void soft_cap(float* p, int64_t n, float cap) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(p + j, _mm512_mul_ps(_mm512_set1_ps(cap),
                                          tanh16(_mm512_div_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(cap)))));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_set1_ps(cap),
                                          tanh8(_mm256_div_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(cap)))));
#endif
  for (; j < n; ++j) p[j] = cap * std::tanh(p[j] / cap);
}

// p[j] = e^(p[j] - m) for j < n; returns their sum (eight at a time with AVX2 alone: AVX-512's attention has its own).
inline float exp_shifted(float* p, int64_t n, float m) {
  float sum = 0.0f;
  int64_t j = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = sum8(acc);
#endif
  for (; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  return sum;
}
// n float16 values (bits in uint16_t) widened exactly to float32 (F16C; the pool readers refuse a float16 pool on a
// build without it, kReadsHalf in cpu_ops.h).
inline void widen_half(const uint16_t* from, float* to, int64_t n) {
#if defined(__F16C__)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  for (; i < n; ++i) to[i] = _cvtsh_ss(from[i]);
#else
  (void)from, (void)to, (void)n;
#endif
}

}  // namespace trtbuild_cpu_ops
