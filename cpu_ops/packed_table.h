// The packed 2/3/4/5/6/8-bit table that trtbuild::BlockQuantMatMul multiplies with and trtbuild::BlockQuantGather reads
// rows of (layout: block_matmul.cc, plugins/block_quant_matmul.py): its attributes and the checks of its tensors.
#pragma once
#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {

constexpr int64_t kTableRows = 16;   // rows per group: one per int32 lane
constexpr int64_t kTableChunk = 32;  // elements per chunk of a row (and per activation block)
constexpr int64_t kSuperBlock = 256;  // elements per super-block of two-level scales

// A chunk's codes are a base layout of 2, 4 or 8 bits a code (base_bits 64-byte vectors), then, for 3, 5 and 6
// bits, 64 bytes per further bit: byte-mask planes, or those bits packed as the base is (`high_bits`).
constexpr int base_bits(int64_t bits) { return bits <= 3 ? 2 : bits <= 6 ? 4 : 8; }
constexpr int64_t base_bytes(int64_t bits) { return kTableRows * kTableChunk * base_bits(bits) / 8; }
inline int32_t zero_point(int64_t bits) { return 1 << (bits - 1); }
constexpr int32_t kCodebookZeroPoint = 128;  // a codebook's entries are 8-bit codes

// How a table's scales (and minimums) are stored: [G, K / block, 16] float, float16, or int8 sub-scales times a
// float16 super-scale per row and super-block of 256 elements ([G, K / 256, 16]), as GGUF's k-quants keep them; or,
// for blocks of 16 whose sub-values are 0..15 (GGUF's Q2_K), those as nibbles: uint8 [G, K / 32, 16], the low
// nibble block 2c's and the high one block 2c + 1's, times the float16 super-scales.
enum class ScaleKind { kFloat, kHalf, kTwoLevel, kTwoLevelNibbles };

constexpr bool two_level(ScaleKind kind) { return kind == ScaleKind::kTwoLevel || kind == ScaleKind::kTwoLevelNibbles; }

inline float half_to_float(uint16_t h) {  // IEEE binary16, subnormals included
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

// One per-block quantity of a table (its scales, or its minimums), checked against the table's size.
struct BlockValues {
  const void* sub = nullptr;         // [G, K / block, 16]: float, float16 or int8; or nibbles (ScaleKind)
  const uint16_t* super = nullptr;   // float16 [G, K / 256, 16] (two-level only)

  // The value of row 16g + lane in block `block` of the row (scalar: for the gather).
  float at(ScaleKind kind, int64_t blocks, int64_t supers, int64_t block_size, int64_t g, int64_t block,
           int64_t lane) const {
    const int64_t i = (g * blocks + block) * kTableRows + lane;
    if (kind == ScaleKind::kFloat) return static_cast<const float*>(sub)[i];
    if (kind == ScaleKind::kHalf) return half_to_float(static_cast<const uint16_t*>(sub)[i]);
    const int64_t s = (g * supers + block * block_size / kSuperBlock) * kTableRows + lane;
    if (kind == ScaleKind::kTwoLevel)
      return static_cast<float>(static_cast<const int8_t*>(sub)[i]) * half_to_float(super[s]);
    // nibbles: block 2c's low, block 2c + 1's high
    const uint8_t both = static_cast<const uint8_t*>(sub)[(g * blocks / 2 + block / 2) * kTableRows + lane];
    return static_cast<float>((both >> (4 * (block % 2))) & 0x0F) * half_to_float(super[s]);
  }
};

// A table's scales and optional minimums (W = scale * code - minimum, zero point 0), as a node's inputs give them.
struct TableScales {
  ScaleKind kind = ScaleKind::kFloat;
  BlockValues scales, mins;  // mins.sub null: no minimums, the default zero point
  bool has_mins() const { return mins.sub != nullptr; }
};

struct PackedTable {
  std::string op;  // for error messages
  int64_t k, n, bits, block;
  // Empty, or the 16 8-bit codes (zero point 128) that 2/3/4-bit codes index: GGUF's IQ4_NL / IQ4_XS values + 128,
  // or a lattice type's (IQ1, IQ2: 6 of them; IQ3: 16).
  std::vector<uint8_t> codebook;
  // 2^scale_exponent multiplies every weight: the scales and minimums are stored times its inverse where their
  // two-level form needs float16 super-scales below float16's normal range (GGUF's lattice types' d / 8).
  float weight_factor = 1.0f;
  // high_bits "packed": a 3/5/6-bit code's further bits are packed as its base bits are (vector j's in bits
  // h * (j / h) of stored vector j % h, h of them); "planes" (the default): one byte-mask plane per further bit
  bool packed_high = false;

  PackedTable(const char* op_name, const OrtKernelInfo* info) : op(op_name) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    bits = ki.GetAttribute<int64_t>("bits");
    block = ki.GetAttribute<int64_t>("block_size");
    if (bits < 2 || bits > 8 || bits == 7) fail("bits must be 2, 3, 4, 5, 6 or 8");
    if (block != 16 && block != 32) fail("block_size must be 16 or 32");
    if (k % kTableChunk) fail("K must be a multiple of 32, got " + std::to_string(k));
    for (const int64_t code : optional_ints(info, "codebook")) {
      if (code < 0 || code > 255) fail("codebook entries must be 8-bit codes (0 .. 255)");
      codebook.push_back(static_cast<uint8_t>(code));
    }
    if (!codebook.empty() && (codebook.size() != 16 || bits > 4))
      fail("a codebook holds 16 codes, for 2-, 3- or 4-bit ones");
    const int64_t exponent = optional_int(info, "scale_exponent", 0);
    if (exponent < -64 || exponent > 64) fail("scale_exponent must lie in -64 .. 64");
    weight_factor = std::ldexp(1.0f, static_cast<int>(exponent));
    const std::string high = optional_string(info, "high_bits", "planes");
    if (high != "planes" && high != "packed") fail("high_bits must be \"planes\" or \"packed\", got \"" + high + "\"");
    packed_high = high == "packed";
  }

  // Code i (0 .. 3) of lane `lane` of vector j (0 .. 7) of a chunk's codes (scalar: for the gather).
  int32_t code(const uint8_t* chunk, int64_t lane, int j, int i) const {
    const int base = base_bits(bits), high = static_cast<int>(bits) - base;
    const int64_t byte = 4 * lane + i;
    int32_t c = (chunk[j % base * 64 + byte] >> (base * (j / base))) & ((1 << base) - 1);
    const uint8_t* further = chunk + base_bytes(bits);
    if (high && packed_high) {
      c |= ((further[j % high * 64 + byte] >> (high * (j / high))) & ((1 << high) - 1)) << base;
    } else {
      for (int plane = 0; plane < high; ++plane)  // bit 64j + byte of the plane
        c |= ((further[plane * 64 + 8 * j + byte / 8] >> (byte % 8)) & 1) << (base + plane);
    }
    return c;
  }

  // The zero point of the codes the dot products see: none with minimums, 128 for a codebook's 8-bit codes.
  int32_t zero_point(const TableScales& scales) const {
    return scales.has_mins() ? 0 : codebook.empty() ? trtbuild_cpu_ops::zero_point(bits) : kCodebookZeroPoint;
  }

  [[noreturn]] void fail(const std::string& what) const {
    ORT_CXX_API_THROW("trtbuild::" + op + ": " + what, ORT_INVALID_ARGUMENT);
  }

  int64_t groups() const { return (n + kTableRows - 1) / kTableRows; }
  int64_t blocks() const { return k / block; }
  int64_t supers() const { return k / kSuperBlock; }

  // Checks B and the scale inputs: `scales` (the scales), and from `first_optional` on the optional super-scales,
  // minimums and super-minimums (plugins/README.md). Returns how they are stored.
  TableScales check(Ort::KernelContext& ctx, size_t b_index, size_t scales_index, size_t first_optional) const {
    const Ort::ConstValue b = ctx.GetInput(b_index), s = ctx.GetInput(scales_index);
    TableScales t;
    const ONNXTensorElementDataType type = s.GetTensorTypeAndShapeInfo().GetElementType();
    t.kind = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT     ? ScaleKind::kFloat
             : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? ScaleKind::kHalf
             : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8    ? ScaleKind::kTwoLevel
             : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8   ? ScaleKind::kTwoLevelNibbles
                                                             : fail_kind();
    if (t.kind == ScaleKind::kTwoLevelNibbles && block != 16) fail("nibble (uint8) scales need block_size 16");
    // per block, or per pair of blocks (nibbles)
    const size_t per_block = static_cast<size_t>(groups() * blocks() * kTableRows) /
                             (t.kind == ScaleKind::kTwoLevelNibbles ? 2 : 1);
    if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(groups() * k * kTableRows * bits / 8) ||
        s.GetTensorTypeAndShapeInfo().GetElementCount() != per_block)
      fail("B or scales do not hold ceil(N / 16) groups of 16 rows (plugins/block_quant_matmul.py: pack)");
    t.scales.sub = s.GetTensorRawData();
    const Ort::ConstValue super = optional(ctx, first_optional), mins = optional(ctx, first_optional + 1),
                          super_mins = optional(ctx, first_optional + 2);
    if (two_level(t.kind) != present(super)) fail("int8 or uint8 scales need float16 super-scales, and only they do");
    if (present(super_mins) && !(present(mins) && two_level(t.kind)))
      fail("super-minimums come with int8 or uint8 minimums and two-level scales");
    if (two_level(t.kind)) {
      if (k % kSuperBlock) fail("two-level scales need K a multiple of 256, got " + std::to_string(k));
      t.scales.super = super_values(super);
    }
    if (present(mins)) {
      if (!codebook.empty()) fail("a codebook comes without minimums");
      if (mins.GetTensorTypeAndShapeInfo().GetElementType() != type ||
          mins.GetTensorTypeAndShapeInfo().GetElementCount() != per_block)
        fail("the minimums must have the scales' type and shape");
      t.mins.sub = mins.GetTensorRawData();
      if (two_level(t.kind)) {
        if (!present(super_mins)) fail("int8 or uint8 minimums need float16 super-minimums");
        t.mins.super = super_values(super_mins);
      }
    }
    return t;
  }

 private:
  [[noreturn]] ScaleKind fail_kind() const {
    fail("scales must be float, float16, int8 or uint8 (two-level; uint8: nibbles)");
  }

  static std::vector<int64_t> optional_ints(const OrtKernelInfo* info, const char* name) {
    size_t size = 0;
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size)) {
      Ort::GetApi().ReleaseStatus(absent);
      return {};
    }
    std::vector<int64_t> values(size);
    Ort::ThrowOnError(Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, values.data(), &size));
    return values;
  }

  static std::string optional_string(const OrtKernelInfo* info, const char* name, const char* otherwise) {
    size_t size = 0;
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
      Ort::GetApi().ReleaseStatus(absent);
      return otherwise;
    }
    std::string value(size, '\0');
    Ort::ThrowOnError(Ort::GetApi().KernelInfoGetAttribute_string(info, name, value.data(), &size));
    value.resize(size > 0 ? size - 1 : 0);  // NOTE: the size counts the terminating null
    return value;
  }

  static int64_t optional_int(const OrtKernelInfo* info, const char* name, int64_t otherwise) {
    int64_t value = otherwise;
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value)) {
      Ort::GetApi().ReleaseStatus(absent);
      return otherwise;
    }
    return value;
  }

  static Ort::ConstValue optional(Ort::KernelContext& ctx, size_t index) {
    return ctx.GetInputCount() > index ? ctx.GetInput(index) : Ort::ConstValue{nullptr};
  }
  static bool present(const Ort::ConstValue& v) { return static_cast<const OrtValue*>(v) != nullptr; }

  const uint16_t* super_values(const Ort::ConstValue& v) const {
    if (v.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
        v.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(groups() * supers() * kTableRows))
      fail("super-scales and super-minimums are float16 [ceil(N / 16), K / 256, 16]");
    return v.GetTensorData<uint16_t>();
  }
};

}  // namespace trtbuild_cpu_ops
