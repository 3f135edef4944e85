// trtbuild::BlockQuantMatMul for ONNX Runtime's CPU provider: y[M, N] = x[M, K] @ dequant(B)^T.
//
// It reads the very initializers ONNX Runtime's MatMulNBits would, blocks of 32 with the default zero point:
//   B uint8 [N, K / 32, 32 * bits / 8]: 4-bit: byte j of a block holds element 2j in its low nibble and 2j + 1 in
//     its high one; 8-bit: one code per byte. w = (code - zp) * scale, zp = 8 (4-bit) or 128 (8-bit).
//   scales float [N * K / 32].
// The way llama.cpp multiplies: x is quantized once per call to int8 in blocks of 32 (a float scale each), and each
// row of B is streamed once per tile of up to 4 tokens, in integer dot products (AVX-512 VNNI: unsigned codes x
// signed activations) scaled per block. The zero point is folded into the dot product's start value
// (-zp x the sum of each lane's 4 activation codes). One 64-byte load of 4-bit codes is 128 weights: its low
// nibbles are the even elements of 4 blocks and its high nibbles the odd ones, so x is stored in that order and the
// 16 int32 lanes of both products map to blocks 0,0,0,0,1,1,1,1,2,... (one scale vector for both).
// NOTE: one row of B at a time: interleaving rows (more reuse of x) halves the read rate here, as the hardware
// prefetcher loses the streams.
#include "cpu_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#define TRTBUILD_NO_VNNI 1
#endif

constexpr int64_t kBlock = 32;
constexpr int64_t kStep = 128;      // weights per inner step: 4 blocks
constexpr int kTokens = 4;          // tokens per tile, all against one row of B
constexpr int64_t kRowsPerTask = 64;

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::BlockQuantMatMul: " + what, ORT_INVALID_ARGUMENT); }

// x quantized for one call: per token and 128-element step, the codes in the order the lanes of B read them, and per
// product ("half": one for 4-bit, whose two products share lanes; two for 8-bit) each lane's int32 start value
// (-zp x the sum of its codes) and activation scale.
struct QuantizedX {
  int64_t steps = 0;
  int halves = 1;
  std::vector<int8_t> codes;  // [M, steps, 128]
  std::vector<int32_t> bias;  // [M, steps, halves, 16]
  std::vector<float> scale;   // [M, steps, halves, 16]
};

void quantize_x(const float* x, int64_t m, int64_t k, int bits, QuantizedX& q) {
  const int64_t steps = k / kStep;
  const int32_t zp = bits == 4 ? 8 : 128;
  q.steps = steps;
  q.halves = bits == 4 ? 1 : 2;
  q.codes.resize(m * k);
  q.bias.resize(m * steps * q.halves * 16);
  q.scale.resize(m * steps * q.halves * 16);
#ifndef TRTBUILD_NO_VNNI
  const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i lanes4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i lanes8a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lanes8b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t s = 0; s < steps; ++s) {
      const float* src = x + t * k + s * kStep;
      int8_t* dst = q.codes.data() + (t * steps + s) * kStep;
      alignas(16) float d[4];
      for (int b = 0; b < 4; ++b) {
        const __m512 v0 = _mm512_loadu_ps(src + b * kBlock), v1 = _mm512_loadu_ps(src + b * kBlock + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        d[b] = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        // NOTE: cvtps rounds half to even (the default MXCSR), as the reference's rint
        if (bits == 4) {  // bytes 0..63: even elements of blocks 0..3 (16 each); 64..127: the odd ones
          const __m512 even = _mm512_permutex2var_ps(v0, even_idx, v1), odd = _mm512_permutex2var_ps(v0, odd_idx, v1);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * 16),
                           _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(even, inv))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 + b * 16),
                           _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(odd, inv))));
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock),
                           _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock + 16),
                           _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
        }
      }
      // each lane's start value: -zp x the sum of the 4 codes it reads in each product (a dot product with ones)
      const __m512i zero = _mm512_setzero_si512(), neg_zp = _mm512_set1_epi32(-zp);
      const __m512i sum0 = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(dst));
      const __m512i sum1 = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(dst + 64));
      int32_t* bias = q.bias.data() + (t * steps + s) * q.halves * 16;
      float* scale = q.scale.data() + (t * steps + s) * q.halves * 16;
      const __m512 four = _mm512_castps128_ps512(_mm_load_ps(d));
      if (bits == 4) {  // both products share lanes: block l / 4
        _mm512_storeu_si512(bias, _mm512_mullo_epi32(_mm512_add_epi32(sum0, sum1), neg_zp));
        _mm512_storeu_ps(scale, _mm512_permutexvar_ps(lanes4, four));
      } else {  // product 0: blocks 0-1, product 1: blocks 2-3, block l / 8 of each
        _mm512_storeu_si512(bias, _mm512_mullo_epi32(sum0, neg_zp));
        _mm512_storeu_si512(bias + 16, _mm512_mullo_epi32(sum1, neg_zp));
        _mm512_storeu_ps(scale, _mm512_permutexvar_ps(lanes8a, four));
        _mm512_storeu_ps(scale + 16, _mm512_permutexvar_ps(lanes8b, four));
      }
    }
  }
#else
  (void)x, (void)zp;
#endif
}

struct Problem {
  const uint8_t* b;
  const float* scales;
  float* y;
  const QuantizedX* qx;
  int64_t m, n, k;
};

#ifndef TRTBUILD_NO_VNNI
template <int BITS, int T>
void tile(const Problem& p, int64_t row, int64_t t0) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const QuantizedX& q = *p.qx;
  const uint8_t* codes = p.b + row * (p.k * BITS / 8);
  const float* row_scales = p.scales + row * (p.k / kBlock);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lanes4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i lanes8a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lanes8b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  for (int64_t s = 0; s < q.steps; ++s) {
    const __m512 four = _mm512_castps128_ps512(_mm_loadu_ps(row_scales + 4 * s));
    if (BITS == 4) {
      const __m512i packed = _mm512_loadu_si512(codes + s * 64);
      const __m512i even = _mm512_and_si512(packed, low);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      const __m512 ws = _mm512_permutexvar_ps(lanes4, four);
      for (int t = 0; t < T; ++t) {
        const int64_t at = (t0 + t) * q.steps + s;
        const int8_t* a = q.codes.data() + at * kStep;
        __m512i dot = _mm512_loadu_si512(q.bias.data() + at * 16);
        dot = _mm512_dpbusd_epi32(dot, even, _mm512_loadu_si512(a));
        dot = _mm512_dpbusd_epi32(dot, odd, _mm512_loadu_si512(a + 64));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_loadu_ps(q.scale.data() + at * 16)),
                                 acc[t]);
      }
    } else {
      const __m512i w0 = _mm512_loadu_si512(codes + s * kStep), w1 = _mm512_loadu_si512(codes + s * kStep + 64);
      const __m512 ws0 = _mm512_permutexvar_ps(lanes8a, four), ws1 = _mm512_permutexvar_ps(lanes8b, four);
      for (int t = 0; t < T; ++t) {
        const int64_t at = (t0 + t) * q.steps + s;
        const int8_t* a = q.codes.data() + at * kStep;
        const int32_t* bias = q.bias.data() + at * 32;
        const float* scale = q.scale.data() + at * 32;
        const __m512i dot0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias), w0, _mm512_loadu_si512(a));
        const __m512i dot1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias + 16), w1, _mm512_loadu_si512(a + 64));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(ws0, _mm512_loadu_ps(scale)), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(ws1, _mm512_loadu_ps(scale + 16)), acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) p.y[(t0 + t) * p.n + row] = _mm512_reduce_add_ps(acc[t]);
}
#endif

template <int BITS>
void run_task(void* data, size_t task) {
#ifndef TRTBUILD_NO_VNNI
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t end = std::min(p.n, static_cast<int64_t>(task + 1) * kRowsPerTask);
  for (int64_t row = static_cast<int64_t>(task) * kRowsPerTask; row < end; ++row) {
    int64_t t = 0;
    for (; t + kTokens <= p.m; t += kTokens) tile<BITS, kTokens>(p, row, t);
    switch (p.m - t) {
      case 3: tile<BITS, 3>(p, row, t); break;
      case 2: tile<BITS, 2>(p, row, t); break;
      case 1: tile<BITS, 1>(p, row, t); break;
      default: break;
    }
  }
#else
  (void)data, (void)task;
#endif
}

struct BlockQuantMatMulKernel {
  int64_t k, n, bits;

  BlockQuantMatMulKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    bits = ki.GetAttribute<int64_t>("bits");
    if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
    if (k % kStep) fail("K must be a multiple of 128, got " + std::to_string(k));
    if (ki.GetAttribute<int64_t>("block_size") != kBlock) fail("block_size must be 32");
#ifdef TRTBUILD_NO_VNNI
    fail("this CPU has no AVX-512 VNNI; rebuild the engine with `--decode-linears ort`");
#endif
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k) fail("the last dimension of x is not K");
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    std::vector<int64_t> out_shape = shape;
    out_shape.back() = n;
    Ort::UnownedValue y = ctx.GetOutput(0, out_shape);
    if (m == 0) return;
    thread_local QuantizedX qx;  // NOTE: reused across calls: no allocation per linear
    quantize_x(x.GetTensorData<float>(), m, k, static_cast<int>(bits), qx);
    Problem p{ctx.GetInput(1).GetTensorData<uint8_t>(), ctx.GetInput(2).GetTensorData<float>(),
              y.GetTensorMutableData<float>(), &qx, m, n, k};
    const size_t tasks = static_cast<size_t>((n + kRowsPerTask - 1) / kRowsPerTask);
    ctx.ParallelFor(bits == 4 ? run_task<4> : run_task<8>, tasks, 0, &p);
  }
};

struct BlockQuantMatMulOp : Ort::CustomOpBase<BlockQuantMatMulOp, BlockQuantMatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new BlockQuantMatMulKernel(api, info);
  }
  const char* GetName() const { return "BlockQuantMatMul"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
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
