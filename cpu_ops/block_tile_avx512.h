// BlockQuantMatMul's tile with AVX-512 VNNI (block_matmul.cc says what it computes): a 64-byte vector holds the 16
// rows of a group, one per 32-bit lane, so each VNNI dot product serves all of them.
#pragma once
#include "block_problem.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace trtbuild_cpu_ops {

// Tokens per tile: a full tile, then at most one half tile, then one of the 7 smaller ones. NOTE: 16 rather than 8
// halves the weight unpacking per token: 1.5B 128-token prefill steps 7-13% faster (docs/performance.md, sixth
// session); 16 accumulators, 8 weight vectors and the dot products' 4 still fit AVX-512's 32 registers.
constexpr int kTokens = 16;
constexpr int kHalfTile = kTokens / 2;
constexpr int kTailTokens = kHalfTile - 1;  // after whole tiles: one half tile, then one of 1-7 tokens

// The 16 rows' values of block `at` (of all groups' blocks), in super-block `super_at` for two-level ones.
template <ScaleKind KIND>
__m512 load_block_values(const BlockValues& v, int64_t at, int64_t super_at) {
  if constexpr (KIND == ScaleKind::kHalf) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(v.sub) + at));
  } else if constexpr (KIND == ScaleKind::kFloat) {
    return _mm512_loadu_ps(static_cast<const float*>(v.sub) + at * kRows);
  } else if constexpr (KIND == ScaleKind::kTwoLevelNibbles) {  // block `at` of 16: nibble at % 2 of chunk at / 2
    const __m128i both = _mm_loadu_si128(static_cast<const __m128i*>(v.sub) + at / 2);
    const __m128i sub = _mm_and_si128(at % 2 ? _mm_srli_epi16(both, 4) : both, _mm_set1_epi8(0x0F));
    const __m256i super = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.super) + super_at);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub)), _mm512_cvtph_ps(super));
  } else {  // NOTE: int8 x float16 is exact in float32, and so equals the checkpoint's float32 scale
    const __m128i sub = _mm_loadu_si128(static_cast<const __m128i*>(v.sub) + at);
    const __m256i super = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.super) + super_at);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)), _mm512_cvtph_ps(super));
  }
}

// Rows 16g .. 16g + 15 of tokens t0 .. t0 + T - 1.
template <int BITS, ScaleKind KIND, bool BLOCK16, bool MINS, bool LUT, int T>
void tile(const Problem& p, int64_t g, int64_t t0) {
  constexpr int64_t kBytes = kRows * kBlock * BITS / 8;  // one block of one group
  const QuantizedX& q = *p.qx;
  const int64_t nb = q.blocks;
  const int64_t gt = p.group_base + g;  // the table's group (g: the output's)
  const uint8_t* codes = p.b + gt * nb * kBytes;
  constexpr int kBase = base_bits(BITS);
  const __m512i low = _mm512_set1_epi8(static_cast<char>((1 << kBase) - 1));
  // NOTE: shuffle_epi8 looks up within each 128-bit lane: the 16 codes in every lane
  const __m512i codebook =
      LUT ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codebook))) : low;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    // NOTE: as DenseMatMul's weights, the codes are one stream the hardware prefetcher falls behind on once a tile
    // has several tokens (1.5B Q8_0, batch-16 decode step: ~12% faster asking ahead)
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + b * kBytes + kPrefetchBytes + line), _MM_HINT_T0);
    if constexpr (kBase != 8) {
      for (int j = 0; j < kBase; ++j) {
        const __m512i v = _mm512_loadu_si512(codes + b * kBytes + j * 64);
        w[j] = _mm512_and_si512(v, low);
        for (int s = 1; s < 8 / kBase; ++s) w[j + s * kBase] = _mm512_and_si512(_mm512_srli_epi16(v, s * kBase), low);
      }
      constexpr int kHigh = BITS - kBase;
      const uint8_t* further = codes + b * kBytes + base_bytes(BITS);
      if (kHigh > 0 && p.packed_high) {  // vector j's kHigh bits in bits kHigh * (j / kHigh) of stored vector j % kHigh
        const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << kHigh) - 1) << kBase));
        for (int s = 0; s < kHigh; ++s) {
          const __m512i v = _mm512_loadu_si512(further + s * 64);
          for (int j = s; j < 8; j += kHigh) {  // NOTE: 16-bit shifts; the mask keeps each byte's own bits
            const int from = kHigh * (j / kHigh);
            const __m512i moved = from < kBase   ? _mm512_slli_epi16(v, kBase - from)
                                  : from > kBase ? _mm512_srli_epi16(v, from - kBase)
                                                 : v;
            w[j] = _mm512_or_si512(w[j], _mm512_and_si512(moved, mask));
          }
        }
      } else {
        for (int plane = 0; plane < kHigh; ++plane) {  // each vector's further bits are byte masks
          const __m512i value = _mm512_set1_epi8(static_cast<char>((1 << kBase) << plane));
          for (int j = 0; j < 8; ++j) {
            uint64_t bits;
            std::memcpy(&bits, further + plane * 64 + 8 * j, sizeof bits);  // NOTE: need not be 8-byte aligned
            w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(bits), w[j], value);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(codes + b * kBytes + j * 64);
    }
    if constexpr (LUT)
      for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(codebook, w[j]);
    // NOTE: a 16-block chunk has two scale vectors, one per half
    const int64_t super_at = gt * p.supers + b * kBlock / kSuperBlock;
    const __m512 ws = load_block_values<KIND>(p.table.scales, (gt * nb + b) * (BLOCK16 ? 2 : 1), super_at);
    const __m512 ws_hi = BLOCK16 ? load_block_values<KIND>(p.table.scales, (gt * nb + b) * 2 + 1, super_at) : ws;
    const __m512 mins = MINS ? load_block_values<KIND>(p.table.mins, (gt * nb + b) * (BLOCK16 ? 2 : 1), super_at)
                             : ws;
    const __m512 mins_hi =
        MINS && BLOCK16 ? load_block_values<KIND>(p.table.mins, (gt * nb + b) * 2 + 1, super_at) : mins;
    for (int t = 0; t < T; ++t) {
      const int64_t at = (p.token_base + t0 + t) * nb + b;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(q.codes.data() + at * kBlock);
      // four short dependency chains: two per half (4-bit: vectors 4..7 are the high nibbles, elements
      // 16 + 4(j - 4) = 4j, so they take the same activation codes)
      __m512i lo0 = _mm512_set1_epi32(q.bias[2 * at]), lo1 = _mm512_setzero_si512();
      __m512i hi0 = _mm512_set1_epi32(q.bias[2 * at + 1]), hi1 = _mm512_setzero_si512();
      lo0 = _mm512_dpbusd_epi32(lo0, w[0], _mm512_set1_epi32(x4[0]));
      lo1 = _mm512_dpbusd_epi32(lo1, w[1], _mm512_set1_epi32(x4[1]));
      hi0 = _mm512_dpbusd_epi32(hi0, w[4], _mm512_set1_epi32(x4[4]));
      hi1 = _mm512_dpbusd_epi32(hi1, w[5], _mm512_set1_epi32(x4[5]));
      lo0 = _mm512_dpbusd_epi32(lo0, w[2], _mm512_set1_epi32(x4[2]));
      lo1 = _mm512_dpbusd_epi32(lo1, w[3], _mm512_set1_epi32(x4[3]));
      hi0 = _mm512_dpbusd_epi32(hi0, w[6], _mm512_set1_epi32(x4[6]));
      hi1 = _mm512_dpbusd_epi32(hi1, w[7], _mm512_set1_epi32(x4[7]));
      const __m512 xs = _mm512_set1_ps(q.scale[at]);
      const __m512i lo = _mm512_add_epi32(lo0, lo1), hi = _mm512_add_epi32(hi0, hi1);
      if (BLOCK16) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(ws, xs), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(ws_hi, xs), acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(ws, xs), acc[t]);
      }
      if (MINS) {  // a minimum times the sum of its block of x as quantized
        const float* scaled_sum = q.scaled_sum.data() + 3 * at;
        if (BLOCK16) {
          acc[t] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(scaled_sum[0]), acc[t]);
          acc[t] = _mm512_fnmadd_ps(mins_hi, _mm512_set1_ps(scaled_sum[1]), acc[t]);
        } else {
          acc[t] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(scaled_sum[2]), acc[t]);
        }
      }
    }
  }
  const int64_t rows = std::min(kRows, p.n - g * kRows);
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(keep, p.bias + g * kRows) : _mm512_setzero_ps();
  // NOTE: a power of two: y is what float32 scales (and minimums) 2^scale_exponent times larger give, bit for bit
  const __m512 factor = _mm512_set1_ps(p.weight_factor);
  for (int t = 0; t < T; ++t)
    _mm512_mask_storeu_ps(p.y + (t0 + t) * p.n + g * kRows, keep, _mm512_fmadd_ps(acc[t], factor, bias));
}

}  // namespace trtbuild_cpu_ops
