// trtbuild::SwiGLU and trtbuild::GeGLU for ONNX Runtime's CPU provider: y[..., F] = act(x[..., :F]) * x[..., F:] over
// the fused gate/up linear's output [..., 2F] (plugins/README.md), with act = silu(g) = g / (1 + e^-g) or
// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) = g / (1 + e^(-2 sqrt(2/pi) (g + 0.044715 g^3))).
// One pass instead of the standard lowering's Split, activation and Mul(s), whose per-node overhead and copies were
// 5% of a 0.5B decode step. SwiGLU's optional attributes alpha, beta and limit give gpt-oss's clamped form (ONNX
// Runtime's MoE activation_alpha, activation_beta, swiglu_limit): g' = min(g, limit), u' = clamp(u, -limit, limit),
// y = g' sigmoid(alpha g') (u' + beta); a second instantiation of the row loop, so the default one is unchanged.
#include "cpu_ops.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kRowsPerTask = 4;

enum class Act { kSilu, kGeluTanh };

// Both activations are g * sigmoid(z): z = g for silu, 2 sqrt(2/pi) (g + 0.044715 g^3) for gelu_tanh.
constexpr float kGeluZ = 1.5957691216057308f;  // 2 sqrt(2 / pi)

template <Act A>
float activation(float g) {
  const float z = A == Act::kSilu ? g : kGeluZ * (g + 0.044715f * g * g * g);
  return g / (1.0f + std::exp(-z));
}

#if defined(__AVX512F__)
template <Act A>
__m512 activation16(__m512 g) {
  __m512 z = g;
  if constexpr (A == Act::kGeluTanh)
    z = _mm512_mul_ps(_mm512_set1_ps(kGeluZ),
                      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(g, g)), g, g));
  // NOTE: exp16 caps its argument at 88, so a very negative gate gives g / (1 + 1.6e38), i.e. 0, not a NaN
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}
#elif defined(__AVX2__) && defined(__FMA__)
template <Act A>
__m256 activation8(__m256 g) {  // as activation16 (exp8 caps its argument at 88 too)
  __m256 z = g;
  if constexpr (A == Act::kGeluTanh)
    z = _mm256_mul_ps(_mm256_set1_ps(kGeluZ),
                      _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, g)), g, g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}
#endif

// SwiGLU's clamped form; the defaults are plain silu(g) * u.
struct Clamp {
  float alpha = 1.0f, beta = 0.0f, limit = std::numeric_limits<float>::infinity();

  bool plain() const { return alpha == 1.0f && beta == 0.0f && limit == std::numeric_limits<float>::infinity(); }
};

float clamped_swiglu(float g, float u, const Clamp& c) {
  g = std::min(g, c.limit);
  u = std::min(std::max(u, -c.limit), c.limit);
  return g / (1.0f + std::exp(-(c.alpha * g))) * (u + c.beta);
}

#if defined(__AVX512F__)
__m512 clamped_swiglu16(__m512 g, __m512 u, const Clamp& c) {
  const __m512 limit = _mm512_set1_ps(c.limit);
  // NOTE: the vector argument second: min_ps returns it where either is a NaN, so a NaN stays one, as std::min's
  g = _mm512_min_ps(limit, g);
  u = _mm512_min_ps(limit, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), limit), u));
  const __m512 z = _mm512_mul_ps(_mm512_set1_ps(-c.alpha), g);
  const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(z)));
  return _mm512_mul_ps(act, _mm512_add_ps(u, _mm512_set1_ps(c.beta)));
}
#elif defined(__AVX2__) && defined(__FMA__)
__m256 clamped_swiglu8(__m256 g, __m256 u, const Clamp& c) {  // as clamped_swiglu16
  const __m256 limit = _mm256_set1_ps(c.limit);
  g = _mm256_min_ps(limit, g);
  u = _mm256_min_ps(limit, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), limit), u));
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(-c.alpha), g);
  const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(z)));
  return _mm256_mul_ps(act, _mm256_add_ps(u, _mm256_set1_ps(c.beta)));
}
#endif

struct Problem {
  const float* x;
  float* y;
  int64_t rows, f;
  Clamp clamp;  // read by the CLAMPED rows only
};

template <Act A, bool CLAMPED>
void glu_rows(void* data, size_t task) {
  const Problem& p = *static_cast<const Problem*>(data);
  for (int64_t r = static_cast<int64_t>(task) * kRowsPerTask;
       r < std::min(p.rows, (static_cast<int64_t>(task) + 1) * kRowsPerTask); ++r) {
    const float* gate = p.x + r * 2 * p.f;
    const float* up = gate + p.f;
    float* y = p.y + r * p.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < p.f; i += 16) {
      const __mmask16 m = p.f - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (p.f - i)) - 1);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
      if constexpr (CLAMPED)
        _mm512_mask_storeu_ps(y + i, m, clamped_swiglu16(g, _mm512_maskz_loadu_ps(m, up + i), p.clamp));
      else
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(activation16<A>(g), _mm512_maskz_loadu_ps(m, up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= p.f; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
      _mm256_storeu_ps(y + i, CLAMPED ? clamped_swiglu8(g, u, p.clamp) : _mm256_mul_ps(activation8<A>(g), u));
    }
#endif
    for (; i < p.f; ++i) y[i] = CLAMPED ? clamped_swiglu(gate[i], up[i], p.clamp) : activation<A>(gate[i]) * up[i];
  }
}

template <Act A>
constexpr const char* op_name() {
  return A == Act::kSilu ? "SwiGLU" : "GeGLU";
}

template <Act A>
struct GluKernel {
  Clamp clamp;  // SwiGLU's attributes (GeGLU takes none)

  GluKernel(const OrtApi&, const OrtKernelInfo* info) {
    if constexpr (A == Act::kSilu) {
      const Ort::ConstKernelInfo attrs(info);
      clamp.alpha = optional_attribute<float>(attrs, "alpha", clamp.alpha);
      clamp.beta = optional_attribute<float>(attrs, "beta", clamp.beta);
      clamp.limit = optional_attribute<float>(attrs, "limit", clamp.limit);
      if (!(clamp.limit > 0.0f))  // NOTE: also a NaN; clamp(u, -limit, limit) needs -limit < limit
        ORT_CXX_API_THROW("trtbuild::SwiGLU: limit must be positive (absent: no clamping)", ORT_INVALID_ARGUMENT);
    }
  }

  // The row loop: the plain one unless SwiGLU's attributes ask for the clamped form.
  auto rows_task() const -> void (*)(void*, size_t) {
    if constexpr (A == Act::kSilu)
      if (!clamp.plain()) return glu_rows<A, true>;
    return glu_rows<A, false>;
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() % 2)
      ORT_CXX_API_THROW(std::string("trtbuild::") + op_name<A>() + ": the last dimension of x must be even (gate, "
                        "then up)", ORT_INVALID_ARGUMENT);
    shape.back() /= 2;
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    Problem p{x.GetTensorData<float>(), ctx.GetOutput(0, shape).GetTensorMutableData<float>(), rows, shape.back(),
              clamp};
    if (rows == 0) return;
    ctx.ParallelFor(rows_task(), static_cast<size_t>((rows + kRowsPerTask - 1) / kRowsPerTask), 0, &p);
  }
};

template <Act A>
struct GluOp : Ort::CustomOpBase<GluOp<A>, GluKernel<A>> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new GluKernel<A>(api, info); }
  const char* GetName() const { return op_name<A>(); }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* swiglu_op() {
  static GluOp<Act::kSilu> op;
  return &op;
}

const OrtCustomOp* geglu_op() {
  static GluOp<Act::kGeluTanh> op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
