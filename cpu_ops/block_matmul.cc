// trtbuild::BlockQuantMatMul for ONNX Runtime's CPU provider: y[M, N] = x[M, K] @ dequant(B)^T, 2- to 8-bit codes
// (not 7) with a scale per block of 32 or 16 and the default zero point 2^(bits - 1), or with a minimum per block
// and zero point 0, in the 16-row interleaved layout that plugins/block_quant_matmul.py packs at build time
// (G = ceil(N / 16) groups of 16 rows, nc = K / 32 chunks):
//   B uint8 [G, nc, 16 * 32 * bits / 8]: in chunk c of group g, the 8 vectors j of 64 bytes whose lane r (bytes
//     4r..4r+3) holds row 16g + r's elements 32c + 4j .. +3 (so vectors 0-3 are a chunk's first 16 elements and 4-7
//     its last 16). 8-bit: as they are. Base b = 4 (4/5/6-bit) or 2 (2/3-bit): b stored vectors, vector j in bits
//     b * (j / b) .. of stored vector j % b (4-bit: j < 4 in the low nibbles, j + 4 in the high ones); then for 3, 5
//     and 6 bits one 64-byte plane per further bit, whose 64-bit word j is a byte mask of vector j's bit.
//   scales [G, K / block, 16]: the scale of row 16g + r in each block, float, float16 (where that is exact, as it is
//     for GGUF's 32-blocks: 11% fewer bytes per 4-bit weight), or int8 times a float16 super-scale per 256 elements
//     (GGUF's k-quants, exactly: 4.6 bits per Q4_K weight instead of 6 with float scales and minimums); in blocks
//     of 16 with sub-values 0..15 (Q2_K), those as nibbles [G, nc, 16], block 2c's low, 2c + 1's high.
//   minimums (optional), like the scales: W = scale * code - minimum.
//   scale_exponent (attribute, optional): W is 2^scale_exponent times that (scales and minimums stored smaller).
//   codebook (attribute, optional, 2/3/4-bit codes without minimums): the 16 8-bit codes (zero point 128) the codes
//     index, looked up in registers (GGUF's IQ4_NL / IQ4_XS: its non-uniform values + 128; IQ1-IQ3: a lattice's).
// The way llama.cpp multiplies: x is quantized once per call to int8 in blocks of 32 (a float scale each); each
// lane of a VNNI dot product (unsigned codes x 4 signed activation codes broadcast to all lanes) belongs to one
// row, so a chunk of 16 rows is 8 dot products into int32 vectors, scaled per row and block, and no horizontal
// sum is ever needed. The zero point is folded into the start value (-zp x the sum of the block's activation
// codes); a minimum is multiplied by the block's sum of x as quantized. A tile of up to 16 tokens reuses each
// unpacked weight vector from registers; one group's codes are a single contiguous stream, which is what keeps
// batch-1 decode at the memory's rate.
#include "packed_table.h"
#include "quantized_x.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kBlock = kTableChunk;
constexpr int64_t kRows = kTableRows;
// Tokens per tile: a full tile, then at most one half tile, then one of the 7 smaller ones. NOTE: 16 rather than 8
// halves the weight unpacking per token: 1.5B 128-token prefill steps 7-13% faster (docs/performance.md, sixth
// session); 16 accumulators, 8 weight vectors and the dot products' 4 still fit AVX-512's 32 registers.
constexpr int kTokens = 16;
constexpr int kHalfTile = kTokens / 2;
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its loads a tile asks for its codes
// A task is 4 groups (one chunk of tokens) or 8 groups (several) of one chunk of tokens whose activation codes
// fill about 256 KiB (at least 64 tokens), so that they stay in cache while every group of the task reuses them.
// NOTE: a task of every token re-read all of x per group, from memory once x outgrew the cache (a 2048-token
// prefill's down projection: 10 MB of codes).
constexpr int64_t kTaskCodeBytes = 256 << 10;
constexpr int64_t kTaskGroupsShort = 4;
constexpr int64_t kTaskGroupsLong = 8;

struct Problem {
  const uint8_t* b;
  TableScales table;
  int64_t supers;  // super-blocks per row (two-level scales)
  float* y;
  const QuantizedX* qx;
  int64_t m, n, k;
  int64_t task_tokens, group_tasks, groups_per_task;  // tasks: token chunk major, group chunk minor
  const float* bias;  // [n] of this problem's rows, or null
  const uint8_t* codebook;  // 16 codes the 2/3/4-bit ones index (LUT), or null
  float weight_factor;  // 2^scale_exponent (PackedTable)
  // grouped (experts): the table's first group and qx's first token of this problem's rows and tokens
  int64_t group_base = 0, token_base = 0;
};

#ifndef TRTBUILD_NO_VNNI
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
      for (int plane = 0; plane < BITS - kBase; ++plane) {  // each vector's further bits are byte masks
        const uint8_t* high = codes + b * kBytes + base_bytes(BITS) + plane * 64;
        const __m512i value = _mm512_set1_epi8(static_cast<char>((1 << kBase) << plane));
        for (int j = 0; j < 8; ++j) {
          uint64_t bits;
          std::memcpy(&bits, high + 8 * j, sizeof bits);  // NOTE: the planes need not be 8-byte aligned
          w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(bits), w[j], value);
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

template <int BITS, ScaleKind KIND, bool BLOCK16, bool MINS, bool LUT, int T>
void tail(const Problem& p, int64_t g, int64_t t0, int64_t left) {
  if constexpr (T > 0) {
    if (left == T) return tile<BITS, KIND, BLOCK16, MINS, LUT, T>(p, g, t0);
    tail<BITS, KIND, BLOCK16, MINS, LUT, T - 1>(p, g, t0, left);
  }
}
#endif

template <int BITS, ScaleKind KIND, bool BLOCK16, bool MINS, bool LUT = false>
void run_task(void* data, size_t task) {
#ifndef TRTBUILD_NO_VNNI
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t groups = (p.n + kRows - 1) / kRows;
  const int64_t t0 = static_cast<int64_t>(task) / p.group_tasks * p.task_tokens;
  const int64_t t1 = std::min(p.m, t0 + p.task_tokens);
  const int64_t g0 = static_cast<int64_t>(task) % p.group_tasks * p.groups_per_task;
  for (int64_t g = g0; g < std::min(groups, g0 + p.groups_per_task); ++g) {
    int64_t t = t0;
    for (; t + kTokens <= t1; t += kTokens) tile<BITS, KIND, BLOCK16, MINS, LUT, kTokens>(p, g, t);
    if (t + kHalfTile <= t1) {
      tile<BITS, KIND, BLOCK16, MINS, LUT, kHalfTile>(p, g, t);
      t += kHalfTile;
    }
    tail<BITS, KIND, BLOCK16, MINS, LUT, kHalfTile - 1>(p, g, t, t1 - t);
  }
#else
  (void)data, (void)task;
#endif
}

using Task = void (*)(void*, size_t);

template <int BITS, ScaleKind KIND>
Task task_for(bool block16, bool mins) {
  return block16 ? (mins ? run_task<BITS, KIND, true, true> : run_task<BITS, KIND, true, false>)
                 : (mins ? run_task<BITS, KIND, false, true> : run_task<BITS, KIND, false, false>);
}

template <int BITS>
Task task_for(ScaleKind kind, bool block16, bool mins) {
  if (kind == ScaleKind::kTwoLevelNibbles)  // blocks of 16 only (PackedTable::check)
    return mins ? run_task<BITS, ScaleKind::kTwoLevelNibbles, true, true>
                : run_task<BITS, ScaleKind::kTwoLevelNibbles, true, false>;
  return kind == ScaleKind::kFloat  ? task_for<BITS, ScaleKind::kFloat>(block16, mins)
         : kind == ScaleKind::kHalf ? task_for<BITS, ScaleKind::kHalf>(block16, mins)
                                    : task_for<BITS, ScaleKind::kTwoLevel>(block16, mins);
}

// 2/3/4-bit indices into a codebook of 8-bit codes (GGUF's IQ types), without minimums (PackedTable::check).
template <int BITS, ScaleKind KIND>
Task codebook_task(bool block16) {
  return block16 ? run_task<BITS, KIND, true, false, true> : run_task<BITS, KIND, false, false, true>;
}

template <int BITS>
Task codebook_task(ScaleKind kind, bool block16) {
  return kind == ScaleKind::kFloat              ? codebook_task<BITS, ScaleKind::kFloat>(block16)
         : kind == ScaleKind::kHalf             ? codebook_task<BITS, ScaleKind::kHalf>(block16)
         : kind == ScaleKind::kTwoLevelNibbles ? run_task<BITS, ScaleKind::kTwoLevelNibbles, true, false, true>
                                                : codebook_task<BITS, ScaleKind::kTwoLevel>(block16);
}

Task codebook_task(int64_t bits, ScaleKind kind, bool block16) {
  return bits == 2 ? codebook_task<2>(kind, block16)
         : bits == 3 ? codebook_task<3>(kind, block16)
                     : codebook_task<4>(kind, block16);
}

// Problems of several experts run as one ParallelFor: task i belongs to the problem whose first task is the last
// one <= i.
struct Grouped {
  Task task;
  std::vector<Problem> problems;
  std::vector<size_t> first_task;
};

void run_grouped(void* data, size_t task) {
  const Grouped& g = *static_cast<const Grouped*>(data);
  const size_t i = std::upper_bound(g.first_task.begin(), g.first_task.end(), task) - g.first_task.begin() - 1;
  g.task(const_cast<Problem*>(&g.problems[i]), task - g.first_task[i]);
}

struct BlockQuantMatMulKernel {
  static constexpr size_t kFirstOptional = 4;  // after the bias: super-scales, minimums, super-minimums
  static constexpr size_t kExpertOffsets = 7;
  PackedTable table;
  const int64_t k, n, bits, block;
  // grouped: the table holds `experts` tables of n / experts rows each, one after the other, and the bias (N values)
  // their rows' biases in the same order (plugins/README.md)
  const int64_t experts;

  BlockQuantMatMulKernel(const OrtApi&, const OrtKernelInfo* info)
      : table("BlockQuantMatMul", info), k(table.k), n(table.n), bits(table.bits), block(table.block),
        experts(optional_attribute<int64_t>(Ort::ConstKernelInfo(info), "experts", 0)) {
#ifdef TRTBUILD_NO_VNNI
    table.fail("this CPU has no AVX-512 VNNI; rebuild the engine with `--quant-linears ort`");
#endif
    if (experts < 0 || (experts && n % (experts * kRows)))
      table.fail("experts must divide N into tables of whole groups of 16 rows");
  }

  Task task(const TableScales& scales) const {
    const bool block16 = block == 16, mins = scales.has_mins();
    const ScaleKind kind = scales.kind;
    return !table.codebook.empty() ? codebook_task(bits, kind, block16)
           : bits == 2 ? task_for<2>(kind, block16, mins)
           : bits == 3 ? task_for<3>(kind, block16, mins)
           : bits == 4 ? task_for<4>(kind, block16, mins)
           : bits == 5 ? task_for<5>(kind, block16, mins)
           : bits == 6 ? task_for<6>(kind, block16, mins)
                       : task_for<8>(kind, block16, mins);
  }

  // The problem of m tokens times `rows` rows of the table (tasks: token chunks x group chunks).
  static Problem problem(Problem p, int64_t m, int64_t rows) {
    const int64_t groups = (rows + kRows - 1) / kRows;
    p.m = m;
    p.n = rows;
    p.task_tokens = std::max<int64_t>(64, kTaskCodeBytes / p.k / kTokens * kTokens);
    const int64_t per = (m + p.task_tokens - 1) / p.task_tokens > 1 ? kTaskGroupsLong : kTaskGroupsShort;
    p.group_tasks = (groups + per - 1) / per;
    p.groups_per_task = per;
    return p;
  }

  static size_t tasks(const Problem& p) {
    return static_cast<size_t>((p.m + p.task_tokens - 1) / p.task_tokens * p.group_tasks);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k) table.fail("the last dimension of x is not K");
    const TableScales scales = table.check(ctx, 1, 2, kFirstOptional);
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    const int64_t rows = experts ? n / experts : n;
    std::vector<int64_t> out_shape = shape;
    out_shape.back() = rows;
    Ort::UnownedValue y = ctx.GetOutput(0, out_shape);
    if (m == 0) return;
    thread_local QuantizedX qx;  // NOTE: reused across calls: no allocation per linear
    quantize_x(x.GetTensorData<float>(), m, k, table.zero_point(scales), scales.has_mins(), qx);
    Problem base{ctx.GetInput(1).GetTensorData<uint8_t>(), scales, table.supers(), y.GetTensorMutableData<float>(),
                 &qx, m, n, k, 0, 0, 0,
                 bias(ctx, 3, n, [&](const std::string& what) { table.fail(what); }),
                 table.codebook.empty() ? nullptr : table.codebook.data(), table.weight_factor};
    if (!experts) {
      const Problem p = problem(base, m, n);
      ctx.ParallelFor(task(scales), tasks(p), 0, const_cast<Problem*>(&p));
      return;
    }
    // grouped: rows offsets[e] .. offsets[e + 1] of x are expert e's tokens
    if (ctx.GetInputCount() <= kExpertOffsets || ctx.GetInput(kExpertOffsets).GetTensorTypeAndShapeInfo()
                                                         .GetElementCount() != static_cast<size_t>(experts + 1))
      table.fail("a table of experts needs the offsets of their tokens, experts + 1 of them");
    const int64_t* offsets = ctx.GetInput(kExpertOffsets).GetTensorData<int64_t>();
    Grouped grouped{task(scales), {}, {}};
    size_t total = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
      if (first < 0 || count < 0 || first + count > m) table.fail("the expert offsets must rise from 0 to at most M");
      if (count == 0) continue;
      Problem p = problem(base, count, rows);
      p.group_base = e * rows / kRows;
      p.token_base = first;
      p.y = base.y + first * rows;
      if (base.bias) p.bias = base.bias + e * rows;  // expert e's rows' biases (the tile adds g * 16 onwards)
      grouped.first_task.push_back(total);
      total += tasks(p);
      grouped.problems.push_back(p);
    }
    if (total) ctx.ParallelFor(run_grouped, total, 0, &grouped);
  }
};

struct BlockQuantMatMulOp : Ort::CustomOpBase<BlockQuantMatMulOp, BlockQuantMatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new BlockQuantMatMulKernel(api, info);
  }
  const char* GetName() const { return "BlockQuantMatMul"; }
  // x, B, scales, bias, super-scales, minimums, super-minimums, expert offsets (the last five optional)
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // scales and minimums: checked in Compute
    return i == 0 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
           : i == 1         ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 4 || i == 6 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
           : i == 7           ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                            : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* block_quant_matmul_op() {
  static BlockQuantMatMulOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
