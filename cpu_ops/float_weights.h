// Float weights held in float16, bfloat16 or float32 (plugins/dense_matmul.py: exact_type), read as float32.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "simd_math.h"

namespace trtbuild_cpu_ops {
enum class Weight { kFloat, kHalf, kBFloat };

// The weight type of a tensor's element type; false for any other type.
inline bool weight_of(ONNXTensorElementDataType type, Weight* w) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: *w = Weight::kHalf; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: *w = Weight::kBFloat; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: *w = Weight::kFloat; return true;
    default: return false;
  }
}

// Floats16: 16 float32 lanes, one per row of a 16-row group (DenseMatMul's tiles): one AVX-512 register, or two AVX2
// ones (with FMA and F16C) on CPUs without AVX-512. The same operations on either, so a tile is written once.
#if defined(__AVX512F__)
#define TRTBUILD_FLOATS16 1
using Floats16 = __m512;
constexpr int kRegistersPer16 = 1;

inline Floats16 zero16() { return _mm512_setzero_ps(); }
inline Floats16 broadcast16(float v) { return _mm512_set1_ps(v); }
inline Floats16 fmadd16(Floats16 a, Floats16 b, Floats16 c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats16 add16(Floats16 a, Floats16 b) { return _mm512_add_ps(a, b); }
inline __mmask16 first_lanes(int64_t rows) { return static_cast<__mmask16>((1u << rows) - 1); }
// the first `rows` (1..16) floats at p; the other lanes 0 (load) or untouched (store)
inline Floats16 load_rows16(const float* p, int64_t rows) { return _mm512_maskz_loadu_ps(first_lanes(rows), p); }
inline void store_rows16(float* p, Floats16 v, int64_t rows) { _mm512_mask_storeu_ps(p, first_lanes(rows), v); }
inline void store16(float* p, Floats16 v) { _mm512_storeu_ps(p, v); }
inline float reduce_add16(Floats16 v) { return _mm512_reduce_add_ps(v); }

template <Weight W>
Floats16 load16(const void* b, int64_t at) {  // 16 weights from element `at`, as float32 (exact)
  if constexpr (W == Weight::kFloat) {
    return _mm512_loadu_ps(static_cast<const float*>(b) + at);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(b) + at));
    if constexpr (W == Weight::kHalf) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TRTBUILD_FLOATS16 1
struct Floats16 {
  __m256 lo, hi;  // rows 0-7, 8-15
};
constexpr int kRegistersPer16 = 2;

inline Floats16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats16 broadcast16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Floats16 fmadd16(Floats16 a, Floats16 b, Floats16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats16 add16(Floats16 a, Floats16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline __m256i first_lanes8(int64_t rows) {  // lanes below `rows` (clamped to 0..8) all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(rows, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Floats16 load_rows16(const float* p, int64_t rows) {
  return {_mm256_maskload_ps(p, first_lanes8(rows)), _mm256_maskload_ps(p + 8, first_lanes8(rows - 8))};
}
inline void store_rows16(float* p, Floats16 v, int64_t rows) {
  _mm256_maskstore_ps(p, first_lanes8(rows), v.lo);
  _mm256_maskstore_ps(p + 8, first_lanes8(rows - 8), v.hi);
}
inline void store16(float* p, Floats16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline float reduce_add16(Floats16 v) { return sum8(_mm256_add_ps(v.lo, v.hi)); }

template <Weight W>
Floats16 load16(const void* b, int64_t at) {
  if constexpr (W == Weight::kFloat) {
    const float* f = static_cast<const float*>(b) + at;
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  } else {
    const __m128i* bits = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(b) + at);
    const __m128i lo = _mm_loadu_si128(bits), hi = _mm_loadu_si128(bits + 1);
    if constexpr (W == Weight::kHalf) return {_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi)};
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
  }
}
#endif
}  // namespace trtbuild_cpu_ops
