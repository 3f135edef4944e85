// trtbuild::BlockQuantMatMul for ONNX Runtime's CPU provider: y[M, N] = x[M, K] @ dequant(B)^T, 2- to 8-bit codes
// (not 7) with a scale per block of 32 or 16 and the default zero point 2^(bits - 1), or with a minimum per block
// and zero point 0, in the 16-row interleaved layout that plugins/block_quant_matmul.py packs at build time
// (G = ceil(N / 16) groups of 16 rows, nc = K / 32 chunks):
//   B uint8 [G, nc, 16 * 32 * bits / 8]: in chunk c of group g, the 8 vectors j of 64 bytes whose lane r (bytes
//     4r..4r+3) holds row 16g + r's elements 32c + 4j .. +3 (so vectors 0-3 are a chunk's first 16 elements and 4-7
//     its last 16). 8-bit: as they are. Base b = 4 (4/5/6-bit) or 2 (2/3-bit): b stored vectors, vector j in bits
//     b * (j / b) .. of stored vector j % b (4-bit: j < 4 in the low nibbles, j + 4 in the high ones); then for 3, 5
//     and 6 bits one 64-byte plane per further bit, whose 64-bit word j is a byte mask of vector j's bit, or
//     (high_bits "packed") those h = bits - b further bits packed as the base is: h stored vectors, vector j's in
//     bits h * (j / h) .. of stored vector j % h.
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
// batch-1 decode at the memory's rate. Without VNNI, AVX2 computes the same integers (block_tile_avx2.h): each
// 64-byte vector as two halves of 8 rows, a dot product as maddubs then madd.
#include "block_problem.h"
#if defined(TRTBUILD_BLOCK_VNNI)
#include "block_tile_avx512.h"
#elif defined(TRTBUILD_BLOCK_AVX2)
#include "block_tile_avx2.h"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

// A task is 4 groups (one chunk of tokens) or 8 groups (several) of one chunk of tokens whose activation codes
// fill about 256 KiB (at least 64 tokens), so that they stay in cache while every group of the task reuses them.
// NOTE: a task of every token re-read all of x per group, from memory once x outgrew the cache (a 2048-token
// prefill's down projection: 10 MB of codes).
constexpr int64_t kTaskCodeBytes = 256 << 10;
constexpr int64_t kTaskGroupsShort = 4;
constexpr int64_t kTaskGroupsLong = 8;

#ifdef TRTBUILD_NO_BLOCK_QUANT
constexpr int kTokens = 1;  // no tiles: the op refuses to run (BlockQuantMatMulKernel)
#else
// The tile of exactly `left` (1 .. T) tokens.
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
#ifndef TRTBUILD_NO_BLOCK_QUANT
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t groups = (p.n + kRows - 1) / kRows;
  const int64_t t0 = static_cast<int64_t>(task) / p.group_tasks * p.task_tokens;
  const int64_t t1 = std::min(p.m, t0 + p.task_tokens);
  const int64_t g0 = static_cast<int64_t>(task) % p.group_tasks * p.groups_per_task;
  for (int64_t g = g0; g < std::min(groups, g0 + p.groups_per_task); ++g) {
    int64_t t = t0;
    for (; t + kTokens <= t1; t += kTokens) tile<BITS, KIND, BLOCK16, MINS, LUT, kTokens>(p, g, t);
    if (t1 - t > kHalfTile && kTailTokens > kHalfTile) {
      tail<BITS, KIND, BLOCK16, MINS, LUT, kTailTokens>(p, g, t, t1 - t);
      continue;
    }
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
#ifdef TRTBUILD_NO_BLOCK_QUANT
    table.fail("this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C; rebuild the engine with "
               "`--quant-linears ort`");
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
                 table.codebook.empty() ? nullptr : table.codebook.data(), table.weight_factor, table.packed_high};
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
