// trtbuild::BlockQuantGather for ONNX Runtime's CPU provider: rows `ids` of a 2- to 8-bit table stored in
// BlockQuantMatMul's packed layout (block_matmul.cc), dequantized to float. A tied embedding then reads the very
// bytes its lm_head multiplies with, and the engine holds the table once.
//   inputs: ids int64 [T], B uint8 [G, K / 32, 16 * 32 * bits / 8], scales [G, K / block, 16], then optional
//     super-scales, minimums and super-minimums, as BlockQuantMatMul's (packed_table.h: PackedTable::check)
//   output: y float [T, K], y[t, k] = (code[ids[t], k] - zp) * scale[ids[t], k / block], or with minimums
//     code * scale - minimum; times 2^scale_exponent (attribute, optional)
#include "packed_table.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kChunk = kTableChunk;
constexpr int64_t kRows = kTableRows;

struct BlockQuantGatherKernel {
  PackedTable table;
  const int64_t k, n, bits, block;

  BlockQuantGatherKernel(const OrtApi&, const OrtKernelInfo* info)
      : table("BlockQuantGather", info), k(table.k), n(table.n), bits(table.bits), block(table.block) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue ids = ctx.GetInput(0), b = ctx.GetInput(1);
    const int64_t chunks = k / kChunk, bytes = kRows * kChunk * bits / 8;
    const TableScales scales = table.check(ctx, 1, 2, 3);
    const int64_t blocks = table.blocks(), supers = table.supers();
    const int64_t count = static_cast<int64_t>(ids.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t* rows = ids.GetTensorData<int64_t>();
    float* y = ctx.GetOutput(0, std::vector<int64_t>{count, k}).GetTensorMutableData<float>();
    const uint8_t* codes = b.GetTensorData<uint8_t>();
    const int32_t zp = table.zero_point(scales);
    const std::vector<uint8_t>& codebook = table.codebook;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t row = rows[t];
      if (row < 0 || row >= n)
        table.fail("id " + std::to_string(row) + " is outside the table's " + std::to_string(n));
      const int64_t g = row / kRows, lane = row % kRows;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* chunk = codes + (g * chunks + c) * bytes;
        float* out = y + t * k + c * kChunk;
        float scale[2], minimum[2] = {0.0f, 0.0f};  // of the chunk's two halves (one block of 32, or two of 16)
        for (int h = 0; h < 2; ++h) {
          const int64_t at = (c * kChunk + h * 16) / block;
          scale[h] = scales.scales.at(scales.kind, blocks, supers, block, g, at, lane);
          if (scales.has_mins()) minimum[h] = scales.mins.at(scales.kind, blocks, supers, block, g, at, lane);
        }
        for (int j = 0; j < 8; ++j) {  // elements 4j .. 4j + 3
          for (int i = 0; i < 4; ++i) {
            int32_t code = table.code(chunk, lane, j, i);
            if (!codebook.empty()) code = codebook[code];
            out[4 * j + i] = (static_cast<float>(code - zp) * scale[j / 4] - minimum[j / 4]) * table.weight_factor;
          }
        }
      }
    }
  }
};

struct BlockQuantGatherOp : Ort::CustomOpBase<BlockQuantGatherOp, BlockQuantGatherKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new BlockQuantGatherKernel(api, info);
  }
  const char* GetName() const { return "BlockQuantGather"; }
  // ids, B, scales, super-scales, minimums, super-minimums (the last three optional)
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // scales and minimums: checked in Compute
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 3 || i == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
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

const OrtCustomOp* block_quant_gather_op() {
  static BlockQuantGatherOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
