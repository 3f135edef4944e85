// trtbuild::BlockQuantGather for ONNX Runtime's CPU provider: rows `ids` of a 4/5/8-bit table stored in
// BlockQuantMatMul's packed layout (block_matmul.cc), dequantized to float. A tied embedding then reads the very
// bytes its lm_head multiplies with, and the engine holds the table once.
//   inputs: ids int64 [T], B uint8 [G, K / 32, 16 * 32 * bits / 8], S float or float16 [G, K / block, 16]
//   output: y float [T, K], y[t, k] = (code[ids[t], k] - zp) * scale[ids[t], k / block]
#include "packed_table.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kChunk = kTableChunk;
constexpr int64_t kRows = kTableRows;

float half_to_float(uint16_t h) {  // IEEE binary16, subnormals included
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    uint32_t m = mantissa;
    while (!(m & 0x400)) m <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct BlockQuantGatherKernel {
  PackedTable table;
  const int64_t k, n, bits, block;

  BlockQuantGatherKernel(const OrtApi&, const OrtKernelInfo* info)
      : table("BlockQuantGather", info), k(table.k), n(table.n), bits(table.bits), block(table.block) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue ids = ctx.GetInput(0), b = ctx.GetInput(1), s = ctx.GetInput(2);
    const int64_t chunks = k / kChunk, bytes = kRows * kChunk * bits / 8;
    const bool half = table.check(b, s);
    const int64_t count = static_cast<int64_t>(ids.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t* rows = ids.GetTensorData<int64_t>();
    float* y = ctx.GetOutput(0, std::vector<int64_t>{count, k}).GetTensorMutableData<float>();
    const uint8_t* codes = b.GetTensorData<uint8_t>();
    const uint16_t* half_scales = half ? s.GetTensorData<uint16_t>() : nullptr;
    const float* float_scales = half ? nullptr : s.GetTensorData<float>();
    const int32_t zp = zero_point(bits);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t row = rows[t];
      if (row < 0 || row >= n)
        table.fail("id " + std::to_string(row) + " is outside the table's " + std::to_string(n));
      const int64_t g = row / kRows, lane = row % kRows;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* chunk = codes + (g * chunks + c) * bytes + lane * 4;
        const uint8_t* fifth = codes + (g * chunks + c) * bytes + kNibbleBytes;  // 5-bit: bit 64j + 4 lane + i
        float* out = y + t * k + c * kChunk;
        float scale[2];  // of the chunk's two halves (one block of 32, or two of 16)
        for (int h = 0; h < 2; ++h) {
          const int64_t at = (g * (k / block) + (c * kChunk + h * 16) / block) * kRows + lane;
          scale[h] = half ? half_to_float(half_scales[at]) : float_scales[at];
        }
        for (int j = 0; j < 8; ++j) {  // elements 4j .. 4j + 3 (4/5-bit: j < 4 low nibbles, j >= 4 high ones)
          const uint8_t* four = chunk + (bits == 8 ? j : j % 4) * 64;
          for (int i = 0; i < 4; ++i) {
            int32_t code = bits == 8 ? four[i] : (j < 4 ? four[i] & 0x0F : four[i] >> 4);
            if (bits == 5) {
              const int64_t bit = 64 * j + 4 * lane + i;
              code |= ((fifth[bit / 8] >> (bit % 8)) & 1) << 4;
            }
            out[4 * j + i] = static_cast<float>(code - zp) * scale[j / 4];
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
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // scales: float or float16, checked in Compute
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
                                                                 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
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
