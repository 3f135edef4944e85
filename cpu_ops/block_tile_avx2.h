// BlockQuantMatMul's tile with AVX2, FMA and F16C, for CPUs without AVX-512 VNNI (block_matmul.cc says what it
// computes). A 64-byte vector of the layout is taken as two 32-byte halves, rows 0-7 and 8-15 of the group, one per
// 32-bit lane as with AVX-512. A lane's 4-element dot product is maddubs (unsigned codes x signed activation codes,
// adjacent products summed in int16) then madd by ones (pairs summed in int32): the same integers as VNNI's dpbusd,
// then the same float32 operations per row, so y equals the AVX-512 tile's bit for bit.
#pragma once
#include "block_problem.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace trtbuild_cpu_ops {

// Tokens per tile (then at most one half tile, then one of the 3 smaller ones). NOTE: 16 registers cannot hold a
// half's 8 weight vectors and 2 x 8 accumulators, yet reusing each unpacked half for 8 tokens beat 4 tokens without
// spills: K=896 N=4864 4-bit, 16 / 64 tokens, 1.56-1.73x MatMulNBits' speed against 1.31-1.46x (benchmarks/
// quant_linear.py, AMD EPYC Zen 3, 2 threads). 16 tokens measured about the same as 8, with twice the tiles to compile.
constexpr int kTokens = 8;
constexpr int kHalfTile = kTokens / 2;
// The largest tile of the tokens left after whole tiles: 5-7 in one tile, each weight vector unpacked once. NOTE:
// a half tile and a tail (5 tokens as 4 + 1) unpacked every weight twice, and unpacking is most of a token's cost at
// these counts: a 5-token step (4 drafts to verify) of the Qwen3.5-0.8B shape Q4_K_M 59.8 -> 52.6 ms, 7 tokens
// 71.5 -> 60.1 ms (benchmarks/draft_acceptance.py --step-times, AMD EPYC Zen 3, 2 threads).
constexpr int kTailTokens = kTokens - 1;

// Half h (rows 8h .. 8h + 7) of the 16 rows' values of block `at`, in super-block `super_at` for two-level ones.
template <ScaleKind KIND>
__m256 load_half_values(const BlockValues& v, int64_t at, int64_t super_at, int h) {
  if constexpr (KIND == ScaleKind::kHalf) {
    const uint16_t* sub = static_cast<const uint16_t*>(v.sub) + at * kRows + 8 * h;
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
  } else if constexpr (KIND == ScaleKind::kFloat) {
    return _mm256_loadu_ps(static_cast<const float*>(v.sub) + at * kRows + 8 * h);
  } else {
    const __m256 super =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v.super + super_at * kRows + 8 * h)));
    __m256i sub;
    if constexpr (KIND == ScaleKind::kTwoLevelNibbles) {  // block `at` of 16: nibble at % 2 of chunk at / 2
      const uint8_t* both = static_cast<const uint8_t*>(v.sub) + at / 2 * kRows + 8 * h;
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(both));
      sub = _mm256_cvtepu8_epi32(_mm_and_si128(at % 2 ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F)));
    } else {
      const int8_t* bytes = static_cast<const int8_t*>(v.sub) + at * kRows + 8 * h;
      sub = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    }
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sub), super);
  }
}

// 32 bytes, byte i all ones where bit i of `bits` is set: each byte takes the source byte i / 8 and tests bit i % 8.
inline __m256i byte_mask(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // NOTE: within 128-bit lanes, but every 4 bytes are `bits`
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// The 8 code vectors of half h of one chunk (`chunk`: its kRows * kBlock * BITS / 8 bytes), as the AVX-512 tile
// unpacks whole vectors. SIGNED: 8-bit codes less their zero point 128, as int8 (the codebook comes so already).
// NOTE: forced inline: as a call it passed the vectors through memory, and a 6-bit linear of one token took 1.27x
// as long (K=2048 N=32768, 2 threads, AMD EPYC Zen 3).
template <int BITS, bool LUT, bool SIGNED>
__attribute__((always_inline)) inline void unpack_half(const uint8_t* chunk, int h, bool packed_high, __m256i codebook,
                                                       __m256i (&w)[8]) {
  constexpr int kBase = base_bits(BITS);
  if constexpr (kBase != 8) {
    const __m256i low = _mm256_set1_epi8(static_cast<char>((1 << kBase) - 1));
    for (int j = 0; j < kBase; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + j * 64 + 32 * h));
      w[j] = _mm256_and_si256(v, low);
      for (int s = 1; s < 8 / kBase; ++s) w[j + s * kBase] = _mm256_and_si256(_mm256_srli_epi16(v, s * kBase), low);
    }
    constexpr int kHigh = BITS - kBase;
    const uint8_t* further = chunk + base_bytes(BITS);
    if (kHigh > 0 && packed_high) {  // vector j's kHigh bits in bits kHigh * (j / kHigh) of stored vector j % kHigh
      const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kHigh) - 1) << kBase));
      for (int s = 0; s < kHigh; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(further + s * 64 + 32 * h));
        for (int j = s; j < 8; j += kHigh) {  // NOTE: 16-bit shifts; the mask keeps each byte's own bits
          const int from = kHigh * (j / kHigh);
          const __m256i moved = from < kBase   ? _mm256_slli_epi16(v, kBase - from)
                                : from > kBase ? _mm256_srli_epi16(v, from - kBase)
                                               : v;
          w[j] = _mm256_or_si256(w[j], _mm256_and_si256(moved, mask));
        }
      }
    } else {
      for (int plane = 0; plane < kHigh; ++plane) {  // 64-bit word j of a plane: vector j's bytes, bit by bit
        const __m256i value = _mm256_set1_epi8(static_cast<char>((1 << kBase) << plane));
        for (int j = 0; j < 8; ++j) {
          uint32_t bits;
          std::memcpy(&bits, further + plane * 64 + 8 * j + 4 * h, sizeof bits);
          w[j] = _mm256_add_epi8(w[j], _mm256_and_si256(byte_mask(bits), value));
        }
      }
    }
  } else {
    for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + j * 64 + 32 * h));
    if constexpr (SIGNED)
      for (int j = 0; j < 8; ++j) w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  if constexpr (LUT)  // NOTE: shuffle_epi8 looks up within each 128-bit lane: the 16 codes in both
    for (int j = 0; j < 8; ++j) w[j] = _mm256_shuffle_epi8(codebook, w[j]);
}

// start + the lane-wise dot products of vectors J0 .. J0 + N - 1 with their 4 activation codes x4[j]. maddubs
// saturates each int16 pair sum, so codes up to MAX_CODE (|x| <= 127) are summed in int16 only while no sum can
// pass 32767; 8-bit codes are split in their high bit (0 or 128) and the other 7.
template <int MAX_CODE, int J0, int N>
__m256i dots(const __m256i (&w)[8], const int32_t* x4, __m256i start) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (MAX_CODE > 127) {
    const __m256i high = _mm256_set1_epi8(static_cast<char>(0x80)), rest = _mm256_set1_epi8(0x7F);
    for (int j = J0; j < J0 + N; ++j) {
      const __m256i x = _mm256_set1_epi32(x4[j]);
      const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w[j], rest), x), ones);
      const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w[j], high), x), ones);
      start = _mm256_add_epi32(start, _mm256_add_epi32(a, b));
    }
  } else {
    constexpr int kPerSum = 32767 / (2 * MAX_CODE * 127);  // maddubs results an int16 sum holds
    for (int j = J0; j < J0 + N; j += kPerSum) {
      __m256i sum = _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x4[j]));
      for (int i = j + 1; i < std::min(j + kPerSum, J0 + N); ++i)
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(x4[i])));
      start = _mm256_add_epi32(start, _mm256_madd_epi16(sum, ones));
    }
  }
  return start;
}

// The lane-wise dot products of signed 8-bit codes w[j] (|w| in `magnitude`) with their 4 activation codes
// x4[j]: maddubs of |w| and x with w's sign, llama.cpp's way for Q8_0. NOTE: |w| <= 128 and |x| <= 127, so a pair
// sums to at most 32512 and never saturates: one maddubs per vector, where unsigned codes need two.
template <int J0, int N>
__m256i signed_dots(const __m256i (&magnitude)[8], const __m256i (&w)[8], const int32_t* x4) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_setzero_si256();
  for (int j = J0; j < J0 + N; ++j) {
    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x4[j]), w[j]);
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[j], x), ones));
  }
  return sum;
}

// The dot products of vectors J0 .. J0 + N - 1, unsigned codes' from `start` (their zero point's share).
template <int MAX_CODE, bool SIGNED, int J0, int N>
__m256i block_dots(const __m256i (&magnitude)[8], const __m256i (&w)[8], const int32_t* x4, int32_t start) {
  if constexpr (SIGNED)
    return signed_dots<J0, N>(magnitude, w, x4);
  else
    return dots<MAX_CODE, J0, N>(w, x4, _mm256_set1_epi32(start));
}

// Rows 16g .. 16g + 15 of tokens t0 .. t0 + T - 1.
template <int BITS, ScaleKind KIND, bool BLOCK16, bool MINS, bool LUT, int T>
void tile(const Problem& p, int64_t g, int64_t t0) {
  constexpr int64_t kBytes = kRows * kBlock * BITS / 8;  // one block of one group
  constexpr int kMaxCode = LUT || BITS == 8 ? 255 : (1 << BITS) - 1;
  // 8-bit codes around the zero point 128 are multiplied as signed int8, without the start values (-128 x the sums
  // of the activation codes): the same integers
  constexpr bool kSigned = kMaxCode > 127 && !MINS;
  const QuantizedX& q = *p.qx;
  const int64_t nb = q.blocks;
  const int64_t gt = p.group_base + g;  // the table's group (g: the output's)
  const uint8_t* codes = p.b + gt * nb * kBytes;
  // a codebook's 8-bit codes, as signed ones when they are multiplied so
  const __m256i codebook = LUT ? _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                                                      reinterpret_cast<const __m128i*>(p.codebook))),
                                                  _mm256_set1_epi8(static_cast<char>(kSigned ? 0x80 : 0)))
                               : _mm256_setzero_si256();
  __m256 acc[2][T];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < T; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* chunk = codes + b * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes + line), _MM_HINT_T0);
    const int64_t super_at = gt * p.supers + b * kBlock / kSuperBlock;
    const int64_t at_values = (gt * nb + b) * (BLOCK16 ? 2 : 1);  // a 16-block chunk has a value per half
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];
      unpack_half<BITS, LUT, kSigned && !LUT>(chunk, h, p.packed_high, codebook, w);
      __m256i magnitude[8];  // |w|, of signed codes only
      if constexpr (kSigned)
        for (int j = 0; j < 8; ++j) magnitude[j] = _mm256_abs_epi8(w[j]);
      const __m256 ws = load_half_values<KIND>(p.table.scales, at_values, super_at, h);
      const __m256 ws_hi = BLOCK16 ? load_half_values<KIND>(p.table.scales, at_values + 1, super_at, h) : ws;
      const __m256 mins = MINS ? load_half_values<KIND>(p.table.mins, at_values, super_at, h) : ws;
      const __m256 mins_hi = MINS && BLOCK16 ? load_half_values<KIND>(p.table.mins, at_values + 1, super_at, h)
                                             : mins;
      for (int t = 0; t < T; ++t) {
        const int64_t at = (p.token_base + t0 + t) * nb + b;
        const int32_t* x4 = reinterpret_cast<const int32_t*>(q.codes.data() + at * kBlock);
        const __m256 xs = _mm256_set1_ps(q.scale[at]);
        __m256& a = acc[h][t];
        if (BLOCK16) {  // vectors 0-3 are the chunk's first 16 elements, 4-7 its last 16
          const __m256i lo = block_dots<kMaxCode, kSigned, 0, 4>(magnitude, w, x4, q.bias[2 * at]);
          const __m256i hi = block_dots<kMaxCode, kSigned, 4, 4>(magnitude, w, x4, q.bias[2 * at + 1]);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(ws, xs), a);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(ws_hi, xs), a);
        } else {
          const __m256i all =
              block_dots<kMaxCode, kSigned, 0, 8>(magnitude, w, x4, q.bias[2 * at] + q.bias[2 * at + 1]);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), _mm256_mul_ps(ws, xs), a);
        }
        if (MINS) {  // a minimum times the sum of its block of x as quantized
          const float* scaled_sum = q.scaled_sum.data() + 3 * at;
          if (BLOCK16) {
            a = _mm256_fnmadd_ps(mins, _mm256_set1_ps(scaled_sum[0]), a);
            a = _mm256_fnmadd_ps(mins_hi, _mm256_set1_ps(scaled_sum[1]), a);
          } else {
            a = _mm256_fnmadd_ps(mins, _mm256_set1_ps(scaled_sum[2]), a);
          }
        }
      }
    }
  }
  const int64_t rows = std::min(kRows, p.n - g * kRows);
  // NOTE: a power of two: y is what float32 scales (and minimums) 2^scale_exponent times larger give, bit for bit
  const __m256 factor = _mm256_set1_ps(p.weight_factor);
  for (int h = 0; h < 2; ++h) {
    const int64_t first = g * kRows + 8 * h;
    const int keep_rows = static_cast<int>(std::clamp<int64_t>(rows - 8 * h, 0, 8));
    if (!keep_rows) break;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(keep_rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 bias = p.bias ? _mm256_maskload_ps(p.bias + first, keep) : _mm256_setzero_ps();
    for (int t = 0; t < T; ++t)
      _mm256_maskstore_ps(p.y + (t0 + t) * p.n + first, keep, _mm256_fmadd_ps(acc[h][t], factor, bias));
  }
}

}  // namespace trtbuild_cpu_ops
