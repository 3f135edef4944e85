// trtbuild::GatedDeltaNet for ONNX Runtime's CPU provider: Qwen3.5's linear attention (the gated delta rule) over
// per-sequence recurrent states, with the layer's gated RMSNorm; the contract and numpy reference of
// plugins/gated_delta.py.
//
// First a task per token: q | k | v's SiLU and L2 norms, each head's beta and decay, once for every head. Then a
// task per (sequence, value head): its state S [key dim, value dim] is read from the sequence's slot (zero for
// a sequence without a past), carried through the sequence's new tokens in order, and written back. Per token, a
// strip of columns at a time (token_update), two passes over the strip: one reading S for k^T S; one rewriting S
// decayed plus k delta^T and accumulating q^T S. A head's state (64 KiB at 128 x 128) stays in the core's L2 across a
// prefill's tokens.
#include "cpu_ops.h"
#include "state_batch.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr float kL2Epsilon = 1e-6f;  // plugins/gated_delta.py: L2_EPSILON

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::GatedDeltaNet: " + what, ORT_INVALID_ARGUMENT); }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

#if defined(__AVX2__) && defined(__FMA__)
// token_update over columns [j, j + 8 W): W registers of 8 columns side by side, so that the row loops carry W
// independent sums (one chain of fused multiply-adds waited on each FMA's latency: slower than the plain loops).
// Qwen3.5-0.8B shape, a 256-token prefill's 18 scans: 255 ms as two passes over whole rows, 210 ms in strips of 32.
template <int W>
inline void token_strip(float* s, const float* k, const float* q, const float* v, __m256 beta, __m256 decay,
                        float* o, int64_t dk, int64_t dv, int64_t j) {
  __m256 kv[W], delta[W], acc[W];
  for (int w = 0; w < W; ++w) kv[w] = acc[w] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]);
    for (int w = 0; w < W; ++w) kv[w] = _mm256_fmadd_ps(ki, _mm256_loadu_ps(s + i * dv + j + 8 * w), kv[w]);
  }
  for (int w = 0; w < W; ++w)
    delta[w] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j + 8 * w), _mm256_mul_ps(decay, kv[w])), beta);
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int w = 0; w < W; ++w) {
      float* si = s + i * dv + j + 8 * w;
      const __m256 x = _mm256_fmadd_ps(decay, _mm256_loadu_ps(si), _mm256_mul_ps(ki, delta[w]));
      _mm256_storeu_ps(si, x);
      acc[w] = _mm256_fmadd_ps(qi, x, acc[w]);
    }
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(o + j + 8 * w, acc[w]);
}
#endif

// One token through one head's state S [dk, dv]: kv = S^T k, delta = (v - decay kv) beta, S = decay S + k delta^T,
// o = q^T S (NOTE: (decay S)^T k = decay (S^T k)). A column's delta needs only its own kv, so S is walked a strip of
// columns at a time: the strip stays in L1 between its two passes, and its kv and o in registers. Each column's sums
// run over the rows in order, as the numpy reference's.
inline void token_update(float* s, const float* k, const float* q, const float* v, float beta, float decay, float* o,
                         int64_t dk, int64_t dv) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vdecay = _mm256_set1_ps(decay), vbeta = _mm256_set1_ps(beta);
  for (; j + 32 <= dv; j += 32) token_strip<4>(s, k, q, v, vbeta, vdecay, o, dk, dv, j);
  for (; j + 8 <= dv; j += 8) token_strip<1>(s, k, q, v, vbeta, vdecay, o, dk, dv, j);
#endif
  for (; j < dv; ++j) {
    float kv = 0.0f;
    for (int64_t i = 0; i < dk; ++i) kv += k[i] * s[i * dv + j];
    const float delta = (v[j] - decay * kv) * beta;
    float acc = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      float& x = s[i * dv + j];
      x = decay * x + k[i] * delta;
      acc += q[i] * x;
    }
    o[j] = acc;
  }
}

struct Problem {
  const float *qkv, *z, *b, *a, *decay_rate, *dt_bias, *norm_weight;
  // prepare_token's, per token: q | k | v after the SiLU, q and k L2-normalized (q also scaled) [channels]; each
  // value head's beta and decay [Hv, 2]
  float *u, *gates;
  float* states;  // [slots, state layers, Hv, dk, dv], written in place
  StateBatch batch;
  float* y;  // [T, Vd]
  int64_t channels, key_heads, value_heads, dk, dv, state_layers, layer;
  float epsilon;
  bool tiled;  // value head h reads key head h % key heads (else h / (value heads / key heads))
};

// n values L2-normalized in place, times `scale`.
void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = scale / std::sqrt(sum + kL2Epsilon);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Token t's activations, once for all value heads. NOTE: computed per (head, token) in the scan, their exps cost
// more than the state's two passes.
void prepare_token(void* data, size_t task) {
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t t = static_cast<int64_t>(task), kd = p.key_heads * p.dk;
  float* u = p.u + t * p.channels;
  for (int64_t c = 0; c < p.channels; ++c) u[c] = silu(p.qkv[t * p.channels + c]);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(p.dk));
  for (int64_t kh = 0; kh < p.key_heads; ++kh) {
    l2_normalize(u + kh * p.dk, p.dk, q_scale);
    l2_normalize(u + kd + kh * p.dk, p.dk, 1.0f);
  }
  for (int64_t h = 0; h < p.value_heads; ++h) {
    float* g = p.gates + (t * p.value_heads + h) * 2;
    g[0] = 1.0f / (1.0f + std::exp(-p.b[t * p.value_heads + h]));
    g[1] = std::exp(p.decay_rate[h] * softplus(p.a[t * p.value_heads + h] + p.dt_bias[h]));
  }
}

void run_head(void* data, size_t task) {
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t seq = static_cast<int64_t>(task) / p.value_heads, h = static_cast<int64_t>(task) % p.value_heads;
  const int64_t dk = p.dk, dv = p.dv, kd = p.key_heads * dk;
  const int64_t kh = p.tiled ? h % p.key_heads : h / (p.value_heads / p.key_heads);
  const int64_t vd = p.value_heads * dv;
  const auto head_state = [&](int64_t slot) {
    return p.states + ((slot * p.state_layers + p.layer) * p.value_heads + h) * dk * dv;
  };
  float* s = head_state(p.batch.slots[seq]);
  if (p.batch.past[seq] == 0) std::fill(s, s + dk * dv, 0.0f);
  const int64_t checkpoint = p.batch.checkpoint_token(seq);
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(dv));
  float* o = buffer.data();
  for (int64_t t = p.batch.starts[seq]; t < p.batch.starts[seq + 1]; ++t) {
    const float* row = p.u + t * p.channels;
    const float *q = row + kh * dk, *k = row + kd + kh * dk, *v = row + 2 * kd + h * dv;
    const float beta = p.gates[(t * p.value_heads + h) * 2], decay = p.gates[(t * p.value_heads + h) * 2 + 1];
    token_update(s, k, q, v, beta, decay, o, dk, dv);
    if (t == checkpoint) copy_state(s, head_state(p.batch.checkpoint_slot(seq)), dk * dv);
    float sum = 0.0f;
    for (int64_t j = 0; j < dv; ++j) sum += o[j] * o[j];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dv) + p.epsilon);
    const float* z = p.z + t * vd + h * dv;
    float* y = p.y + t * vd + h * dv;
    for (int64_t j = 0; j < dv; ++j) y[j] = o[j] * inv * p.norm_weight[j] * silu(z[j]);
  }
}

struct GatedDeltaNetKernel {
  int64_t layer;
  float epsilon;
  bool tiled;

  GatedDeltaNetKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    layer = k.GetAttribute<int64_t>("state_layer");
    epsilon = k.GetAttribute<float>("epsilon");
    tiled = optional_attribute<int64_t>(k, "tiled", 0) != 0;
    if (layer < 0) fail("state_layer must not be negative");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto shape_of = [&](size_t i) { return ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape(); };
    const std::vector<int64_t> qkv = shape_of(0), state = shape_of(7);
    if (state.size() != 5) fail("recurrent_state must be [slots, state layers, value heads, key dim, value dim]");
    const int64_t num_slots = state[0], state_layers = state[1], hv = state[2], dk = state[3], dv = state[4];
    if (layer >= state_layers) fail("state_layer is beyond recurrent_state's layers");
    if (qkv.size() != 2 || hv <= 0 || dk <= 0 || dv <= 0) fail("mixed_qkv must be [T, 2 Kd + Vd]");
    const int64_t tokens = qkv[0], channels = qkv[1], kd2 = channels - hv * dv;
    const int64_t hk = kd2 > 0 && kd2 % (2 * dk) == 0 ? kd2 / (2 * dk) : 0;
    if (hk <= 0 || hv % hk) fail("mixed_qkv's channels are not 2 x key heads x key dim + value heads x value dim");
    const std::vector<int64_t> want_z{tokens, hv * dv}, want_ab{tokens, hv}, want_h{hv}, want_w{dv};
    if (shape_of(1) != want_z) fail("z must be [T, value heads x value dim]");
    if (shape_of(2) != want_ab || shape_of(3) != want_ab) fail("b and a must be [T, value heads]");
    if (shape_of(4) != want_h || shape_of(5) != want_h) fail("A and dt_bias must be [value heads]");
    if (shape_of(6) != want_w) fail("norm_weight must be [value dim]");
    const StateBatch batch = state_batch(ctx, tokens, num_slots, fail);

    float* y = ctx.GetOutput(0, {tokens, hv * dv}).GetTensorMutableData<float>();
    if (tokens == 0) return;
    // NOTE: the state is updated in place in the runtime's own array, which ONNX Runtime reads without copying (a
    // contiguous float32 numpy input on the CPU provider): the state of a 0.8B model is ~18 MiB a sequence, and
    // returning it as an output for the runtime to copy back would double the step's state traffic.
    float* states = const_cast<float*>(ctx.GetInput(7).GetTensorData<float>());
    thread_local std::vector<float> u, gates;
    u.resize(static_cast<size_t>(tokens * channels));
    gates.resize(static_cast<size_t>(tokens * hv * 2));
    Problem p{ctx.GetInput(0).GetTensorData<float>(), ctx.GetInput(1).GetTensorData<float>(),
              ctx.GetInput(2).GetTensorData<float>(), ctx.GetInput(3).GetTensorData<float>(),
              ctx.GetInput(4).GetTensorData<float>(), ctx.GetInput(5).GetTensorData<float>(),
              ctx.GetInput(6).GetTensorData<float>(), u.data(), gates.data(), states, batch, y,
              channels, hk, hv, dk, dv, state_layers, layer, epsilon, tiled};
    ctx.ParallelFor(prepare_token, static_cast<size_t>(tokens), 0, &p);
    ctx.ParallelFor(run_head, static_cast<size_t>(batch.num_seqs * hv), 0, &p);
  }
};

struct GatedDeltaNetOp : Ort::CustomOpBase<GatedDeltaNetOp, GatedDeltaNetKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new GatedDeltaNetKernel(api, info);
  }
  const char* GetName() const { return "GatedDeltaNet"; }
  size_t GetInputTypeCount() const { return 12; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i >= 8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  // NOTE: state_checkpoints is optional: engines built before it load as they were
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 11 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                   : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* gated_delta_op() {
  static GatedDeltaNetOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
