// Activations quantized to int8 in blocks of 32, once per call of trtbuild::BlockQuantMatMul (block_matmul.cc):
// llama.cpp's way, as the kernel's dot products take them.
#pragma once
#include "packed_table.h"

#include <immintrin.h>

#include <cstdint>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#define TRTBUILD_NO_VNNI 1
#endif

namespace trtbuild_cpu_ops {

// x quantized for one call, in blocks of 32: int8 codes [M, K] in x's order; per token and block, the dot
// products' start values for its two halves (-zp x the sum of the half's codes), the activation scale and (for
// minimums) the sums of x as quantized: the scale times the sums of the halves' codes (made once here, not per
// group of rows in the tiles). NOTE: not x's exact
// sums: then y = sum (scale * code - min) * x_q, whose error is that of the weights times x's rounding, as
// llama.cpp's; with the exact sum the error is scale * code times it, codes 0..15 where the weights center on 0 (a
// small Q4_K Qwen2's logits were 4x further from the float model's: tests/test_native_linears.py, k-quants).
struct QuantizedX {
  int64_t blocks = 0;
  std::vector<int8_t> codes;
  std::vector<int32_t> bias;  // [M, blocks, 2]
  std::vector<float> scale;
  // for minimums, [M, blocks, 3]: the scale times the sum of the first half's codes, the second's, and all 32
  std::vector<float> scaled_sum;
};

inline void quantize_x(const float* x, int64_t m, int64_t k, int32_t zp, bool sums, QuantizedX& q) {
  q.blocks = k / kTableChunk;
  q.codes.resize(m * k);
  q.bias.resize(m * q.blocks * 2);
  q.scale.resize(m * q.blocks);
  q.scaled_sum.resize(sums ? m * q.blocks * 3 : 0);
#ifndef TRTBUILD_NO_VNNI
  for (int64_t i = 0; i < m * q.blocks; ++i) {
    const float* src = x + i * kTableChunk;
    const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // NOTE: cvtps rounds half to even (the default MXCSR), as the reference's rint
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * kTableChunk), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * kTableChunk + 16), _mm512_cvtsepi32_epi8(c1));
    const int32_t sum0 = _mm512_reduce_add_epi32(c0), sum1 = _mm512_reduce_add_epi32(c1);
    q.bias[2 * i] = -zp * sum0;
    q.bias[2 * i + 1] = -zp * sum1;
    q.scale[i] = amax / 127.0f;
    if (sums) {
      const float scale = q.scale[i];
      q.scaled_sum[3 * i] = scale * static_cast<float>(sum0);
      q.scaled_sum[3 * i + 1] = scale * static_cast<float>(sum1);
      q.scaled_sum[3 * i + 2] = scale * (static_cast<float>(sum0) + static_cast<float>(sum1));
    }
  }
#else
  (void)x, (void)zp, (void)sums;
#endif
}

}  // namespace trtbuild_cpu_ops
