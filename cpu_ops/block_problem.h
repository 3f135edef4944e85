// One call of trtbuild::BlockQuantMatMul as its tiles see it (block_matmul.cc: the layout and the arithmetic;
// block_tile_avx512.h and block_tile_avx2.h: the tiles of each instruction set).
#pragma once
#include "packed_table.h"
#include "quantized_x.h"

#include <cstdint>

namespace trtbuild_cpu_ops {

constexpr int64_t kBlock = kTableChunk;
constexpr int64_t kRows = kTableRows;
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its loads a tile asks for its codes

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
  bool packed_high;  // 3/5/6-bit codes' further bits packed as the base (PackedTable), not byte-mask planes
  // grouped (experts): the table's first group and qx's first token of this problem's rows and tokens
  int64_t group_base = 0, token_base = 0;
};

}  // namespace trtbuild_cpu_ops
