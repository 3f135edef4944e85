// The packed 4/5/8-bit table that trtbuild::BlockQuantMatMul multiplies with and trtbuild::BlockQuantGather reads
// rows of (layout: block_matmul.cc, plugins/block_quant_matmul.py): its attributes and the checks of its tensors.
#pragma once
#include "cpu_ops.h"

#include <cstdint>
#include <string>

namespace trtbuild_cpu_ops {

constexpr int64_t kTableRows = 16;   // rows per group: one per int32 lane
constexpr int64_t kTableChunk = 32;  // elements per chunk of a row (and per activation block)
constexpr int64_t kNibbleBytes = kTableRows * kTableChunk / 2;  // a chunk's 4-bit codes (5-bit: then the fifth bits)

inline int32_t zero_point(int64_t bits) { return bits == 4 ? 8 : bits == 5 ? 16 : 128; }

struct PackedTable {
  std::string op;  // for error messages
  int64_t k, n, bits, block;

  PackedTable(const char* op_name, const OrtKernelInfo* info) : op(op_name) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    bits = ki.GetAttribute<int64_t>("bits");
    block = ki.GetAttribute<int64_t>("block_size");
    if (bits != 4 && bits != 5 && bits != 8) fail("bits must be 4, 5 or 8");
    if (block != 16 && block != 32) fail("block_size must be 16 or 32");
    if (k % kTableChunk) fail("K must be a multiple of 32, got " + std::to_string(k));
  }

  [[noreturn]] void fail(const std::string& what) const {
    ORT_CXX_API_THROW("trtbuild::" + op + ": " + what, ORT_INVALID_ARGUMENT);
  }

  int64_t groups() const { return (n + kTableRows - 1) / kTableRows; }

  // Checks B's and the scales' sizes and the scales' type; returns whether the scales are float16.
  bool check(const Ort::ConstValue& b, const Ort::ConstValue& s) const {
    if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(groups() * k * kTableRows * bits / 8) ||
        s.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(groups() * k / block * kTableRows))
      fail("B or scales do not hold ceil(N / 16) groups of 16 rows (plugins/block_quant_matmul.py: pack)");
    const ONNXTensorElementDataType type = s.GetTensorTypeAndShapeInfo().GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
      fail("scales must be float or float16");
    return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
};

}  // namespace trtbuild_cpu_ops
