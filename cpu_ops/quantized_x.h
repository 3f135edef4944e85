// Activations quantized to int8 in blocks of 32, once per call of trtbuild::BlockQuantMatMul (block_matmul.cc):
// llama.cpp's way, as the kernel's dot products take them.
#pragma once
#include "packed_table.h"

#include <immintrin.h>

#include <cstdint>
#include <vector>

// The instruction set BlockQuantMatMul's tiles and this quantization are written with: AVX-512 VNNI, else AVX2
// (with FMA and F16C, as every AVX2 CPU since 2013 has), else none (the op refuses to run).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TRTBUILD_BLOCK_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TRTBUILD_BLOCK_AVX2 1
#else
#define TRTBUILD_NO_BLOCK_QUANT 1
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

  // Block i's start values, scale and (with `sums`) scaled sums, from its largest |x| and its halves' code sums.
  void set_block(int64_t i, float amax, int32_t sum0, int32_t sum1, int32_t zp, bool sums) {
    bias[2 * i] = -zp * sum0;
    bias[2 * i + 1] = -zp * sum1;
    scale[i] = amax / 127.0f;
    if (sums) {
      scaled_sum[3 * i] = scale[i] * static_cast<float>(sum0);
      scaled_sum[3 * i + 1] = scale[i] * static_cast<float>(sum1);
      scaled_sum[3 * i + 2] = scale[i] * (static_cast<float>(sum0) + static_cast<float>(sum1));
    }
  }
};

#if defined(TRTBUILD_BLOCK_AVX2)
inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

inline void quantize_x(const float* x, int64_t m, int64_t k, int32_t zp, bool sums, QuantizedX& q) {
  q.blocks = k / kTableChunk;
  q.codes.resize(m * k);
  q.bias.resize(m * q.blocks * 2);
  q.scale.resize(m * q.blocks);
  q.scaled_sum.resize(sums ? m * q.blocks * 3 : 0);
#if defined(TRTBUILD_BLOCK_VNNI)
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
    q.set_block(i, amax, sum0, sum1, zp, sums);
  }
#elif defined(TRTBUILD_BLOCK_AVX2)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs_epi32 then packs_epi16 interleave 4-byte groups across the two 128-bit lanes; this puts them back
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < m * q.blocks; ++i) {
    const float* src = x + i * kTableChunk;
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(src + 8 * j);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i c[4];  // NOTE: cvtps rounds half to even (the default MXCSR), as the reference's rint
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes.data() + i * kTableChunk),
                        _mm256_permutevar8x32_epi32(bytes, in_order));
    const int32_t sum0 = sum_lanes(_mm256_add_epi32(c[0], c[1])), sum1 = sum_lanes(_mm256_add_epi32(c[2], c[3]));
    q.set_block(i, amax, sum0, sum1, zp, sums);
  }
#else
  (void)x, (void)zp, (void)sums;
#endif
}

}  // namespace trtbuild_cpu_ops
