// Float weights held in float16, bfloat16 or float32 (plugins/dense_matmul.py: exact_type), read as float32.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "cpu_ops.h"

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

#if defined(__AVX512F__)
template <Weight W>
__m512 load16(const void* b, int64_t at) {  // 16 weights from element `at`, as float32 (exact)
  if constexpr (W == Weight::kFloat) {
    return _mm512_loadu_ps(static_cast<const float*>(b) + at);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(b) + at));
    if constexpr (W == Weight::kHalf) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}
#endif
}  // namespace trtbuild_cpu_ops
