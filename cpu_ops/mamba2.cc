// trtbuild::Mamba2Scan for ONNX Runtime's CPU provider: Granite 4.0-H's Mamba2 layers (the selective scan) over
// per-sequence recurrent states, then the layer's gated group norm; the contract and numpy reference of
// plugins/mamba2.py.
//
// First a task per token: x | B | C's SiLU and each head's dt, once for every head. Scan: a task per (sequence,
// head), its state S [head dim, state size] read from the sequence's slot (zero for a sequence without a past),
// carried through the sequence's new tokens in order and written back; per token one vectorized pass over S
// (decay, the rank-1 update dt x B^T and y = S C together). Norm: a task per token, each
// group's channels gated by silu(z), RMS-normalized, times the weight (the groups span several heads, so this waits
// for the whole scan).
#include "cpu_ops.h"
#include "state_batch.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::Mamba2Scan: " + what, ORT_INVALID_ARGUMENT); }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

struct Problem {
  const float *xbc, *z, *dt, *decay, *dt_bias, *skip, *norm_weight;
  float *u, *steps;  // [T, channels]: silu(xbc); [T, H]: softplus(dt + dt_bias) (prepare_token)
  float* states;  // [slots, state layers, H, P, N], written in place
  StateBatch batch;
  float* y;  // [T, H * P]
  int64_t channels, heads, groups, p, n, state_layers, layer;
  float epsilon;
};

#if defined(__AVX2__) && defined(__FMA__)
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// One row of S updated in place, S[j] = S[j] da + dx B[j], and its dot product with C. NOTE: explicitly vectorized:
// the compiler keeps a float sum in order (no reassociation), which left this loop scalar and the scan ~5x slower.
inline float update_row(float* si, const float* b, const float* c, float da, float dx, int64_t n) {
  int64_t j = 0;
  float acc = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vda = _mm256_set1_ps(da), vdx = _mm256_set1_ps(dx);
  __m256 sum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(si + j), vda, _mm256_mul_ps(vdx, _mm256_loadu_ps(b + j)));
    _mm256_storeu_ps(si + j, v);
    sum = _mm256_fmadd_ps(v, _mm256_loadu_ps(c + j), sum);
  }
  acc = lane_sum(sum);
#endif
  for (; j < n; ++j) {
    si[j] = si[j] * da + dx * b[j];
    acc += si[j] * c[j];
  }
  return acc;
}

// Token t's activations, once for every head: NOTE: B and C are shared by a group's heads, and their SiLU per head
// cost more than the scan itself (64 heads: 40 exps per state row).
void prepare_token(void* data, size_t task) {
  const Problem& q = *static_cast<const Problem*>(data);
  const int64_t t = static_cast<int64_t>(task);
  for (int64_t c = 0; c < q.channels; ++c) q.u[t * q.channels + c] = silu(q.xbc[t * q.channels + c]);
  for (int64_t h = 0; h < q.heads; ++h) q.steps[t * q.heads + h] = softplus(q.dt[t * q.heads + h] + q.dt_bias[h]);
}

void scan_head(void* data, size_t task) {
  const Problem& q = *static_cast<const Problem*>(data);
  const int64_t seq = static_cast<int64_t>(task) / q.heads, h = static_cast<int64_t>(task) % q.heads;
  const int64_t p = q.p, n = q.n, inner = q.heads * p, g = h / (q.heads / q.groups);
  const auto head_state = [&](int64_t slot) {
    return q.states + ((slot * q.state_layers + q.layer) * q.heads + h) * p * n;
  };
  float* s = head_state(q.batch.slots[seq]);
  if (q.batch.past[seq] == 0) std::fill(s, s + p * n, 0.0f);
  const int64_t checkpoint = q.batch.checkpoint_token(seq);
  for (int64_t t = q.batch.starts[seq]; t < q.batch.starts[seq + 1]; ++t) {
    const float* row = q.u + t * q.channels;
    const float *x = row + h * p, *b = row + inner + g * n, *c = row + inner + (q.groups + g) * n;
    const float step = q.steps[t * q.heads + h];
    const float da = std::exp(step * q.decay[h]);
    float* out = q.y + t * inner + h * p;
    for (int64_t i = 0; i < p; ++i)  // S[i] = S[i] da + (dt x_i) B; y_i = S[i] . C + D x_i
      out[i] = update_row(s + i * n, b, c, da, step * x[i], n) + q.skip[h] * x[i];
    if (t == checkpoint) copy_state(s, head_state(q.batch.checkpoint_slot(seq)), p * n);
  }
}

void norm_token(void* data, size_t task) {
  const Problem& q = *static_cast<const Problem*>(data);
  const int64_t t = static_cast<int64_t>(task), inner = q.heads * q.p, width = inner / q.groups;
  float* y = q.y + t * inner;
  const float* z = q.z + t * inner;
  for (int64_t g = 0; g < q.groups; ++g) {
    float* yg = y + g * width;
    float sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) {
      yg[i] *= silu(z[g * width + i]);
      sum += yg[i] * yg[i];
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + q.epsilon);
    for (int64_t i = 0; i < width; ++i) yg[i] *= inv * q.norm_weight[g * width + i];
  }
}

struct Mamba2ScanKernel {
  int64_t layer, groups;
  float epsilon;

  Mamba2ScanKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    layer = k.GetAttribute<int64_t>("state_layer");
    groups = k.GetAttribute<int64_t>("num_groups");
    epsilon = k.GetAttribute<float>("epsilon");
    if (layer < 0 || groups < 1) fail("state_layer must not be negative, num_groups at least 1");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto shape_of = [&](size_t i) { return ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape(); };
    const std::vector<int64_t> xbc = shape_of(0), state = shape_of(7);
    if (state.size() != 5) fail("recurrent_state must be [slots, state layers, heads, head dim, state size]");
    const int64_t num_slots = state[0], state_layers = state[1], heads = state[2], p = state[3], n = state[4];
    if (layer >= state_layers) fail("state_layer is beyond recurrent_state's layers");
    if (heads % groups) fail("num_groups must divide the heads");
    const int64_t inner = heads * p;
    if (xbc.size() != 2 || xbc[1] != inner + 2 * groups * n)
      fail("xbc must be [T, heads x head dim + 2 x num_groups x state size]");
    const int64_t tokens = xbc[0];
    const std::vector<int64_t> want_z{tokens, inner}, want_dt{tokens, heads}, want_h{heads}, want_w{inner};
    if (shape_of(1) != want_z) fail("z must be [T, heads x head dim]");
    if (shape_of(2) != want_dt) fail("dt must be [T, heads]");
    if (shape_of(3) != want_h || shape_of(4) != want_h || shape_of(5) != want_h) fail("A, dt_bias and D must be [heads]");
    if (shape_of(6) != want_w) fail("norm_weight must be [heads x head dim]");
    const StateBatch batch = state_batch(ctx, tokens, num_slots, fail);

    float* y = ctx.GetOutput(0, {tokens, inner}).GetTensorMutableData<float>();
    if (tokens == 0) return;
    // NOTE: in place, as trtbuild::GatedDeltaNet's states (cpu_ops/gated_delta.cc)
    float* states = const_cast<float*>(ctx.GetInput(7).GetTensorData<float>());
    thread_local std::vector<float> u, steps;
    u.resize(static_cast<size_t>(tokens * xbc[1]));
    steps.resize(static_cast<size_t>(tokens * heads));
    Problem q{ctx.GetInput(0).GetTensorData<float>(), ctx.GetInput(1).GetTensorData<float>(),
              ctx.GetInput(2).GetTensorData<float>(), ctx.GetInput(3).GetTensorData<float>(),
              ctx.GetInput(4).GetTensorData<float>(), ctx.GetInput(5).GetTensorData<float>(),
              ctx.GetInput(6).GetTensorData<float>(), u.data(), steps.data(), states, batch, y, xbc[1],
              heads, groups, p, n, state_layers, layer, epsilon};
    ctx.ParallelFor(prepare_token, static_cast<size_t>(tokens), 0, &q);
    ctx.ParallelFor(scan_head, static_cast<size_t>(batch.num_seqs * heads), 0, &q);
    ctx.ParallelFor(norm_token, static_cast<size_t>(tokens), 0, &q);
  }
};

struct Mamba2ScanOp : Ort::CustomOpBase<Mamba2ScanOp, Mamba2ScanKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Mamba2ScanKernel(api, info); }
  const char* GetName() const { return "Mamba2Scan"; }
  size_t GetInputTypeCount() const { return 12; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i >= 8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  // NOTE: state_checkpoints is optional (cpu_ops/gated_delta.cc)
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 11 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                   : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* mamba2_op() {
  static Mamba2ScanOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
