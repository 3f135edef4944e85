// trtbuild::GatedDeltaNet for ONNX Runtime's CPU provider: Qwen3.5's linear attention (the gated delta rule) over
// per-sequence recurrent states, with the layer's gated RMSNorm; the contract and numpy reference of
// plugins/gated_delta.py.
//
// First a task per token: q | k | v's SiLU and L2 norms, each head's beta and decay, once for every head. Then a
// task per (sequence, value head): its state S [key dim, value dim] is read from the sequence's slot (zero for
// a sequence without a past), carried through the sequence's new tokens in order, and written back. Per token, two
// passes over S, each an auto-vectorized loop over the value dim: one reading S for k^T S; one rewriting S decayed
// plus k delta^T and accumulating q^T S. A head's state (64 KiB at 128 x 128) stays in the core's L2 across a
// prefill's tokens.
#include "cpu_ops.h"
#include "state_batch.h"

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

struct Problem {
  const float *qkv, *z, *b, *a, *decay_rate, *dt_bias, *norm_weight;
  // prepare_token's, per token: q | k | v after the SiLU, q and k L2-normalized (q also scaled) [channels]; each
  // value head's beta and decay [Hv, 2]
  float *u, *gates;
  float* states;  // [slots, state layers, Hv, dk, dv], written in place
  const int64_t *slots, *past, *starts;
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
  float* s = p.states + ((p.slots[seq] * p.state_layers + p.layer) * p.value_heads + h) * dk * dv;
  if (p.past[seq] == 0) std::fill(s, s + dk * dv, 0.0f);
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(2 * dv));
  float *kv = buffer.data(), *o = kv + dv;
  for (int64_t t = p.starts[seq]; t < p.starts[seq + 1]; ++t) {
    const float* row = p.u + t * p.channels;
    const float *q = row + kh * dk, *k = row + kd + kh * dk, *v = row + 2 * kd + h * dv;
    const float beta = p.gates[(t * p.value_heads + h) * 2], decay = p.gates[(t * p.value_heads + h) * 2 + 1];
    // NOTE: (decay S)^T k = decay (S^T k): S is read once, then rewritten once (decayed and updated together)
    std::fill(kv, kv + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {  // kv = S^T k
      const float* si = s + i * dv;
      const float ki = k[i];
      for (int64_t j = 0; j < dv; ++j) kv[j] += ki * si[j];
    }
    for (int64_t j = 0; j < dv; ++j) kv[j] = (v[j] - decay * kv[j]) * beta;  // delta
    std::fill(o, o + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {  // S = decay S + k delta^T; o = q^T S
      float* si = s + i * dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < dv; ++j) {
        si[j] = decay * si[j] + ki * kv[j];
        o[j] += qi * si[j];
      }
    }
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
    const int64_t num_seqs = batch.num_seqs, *slots = batch.slots, *past = batch.past, *starts = batch.starts;

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
              ctx.GetInput(6).GetTensorData<float>(), u.data(), gates.data(), states, slots, past, starts, y,
              channels, hk, hv, dk, dv, state_layers, layer, epsilon, tiled};
    ctx.ParallelFor(prepare_token, static_cast<size_t>(tokens), 0, &p);
    ctx.ParallelFor(run_head, static_cast<size_t>(num_seqs * hv), 0, &p);
  }
};

struct GatedDeltaNetOp : Ort::CustomOpBase<GatedDeltaNetOp, GatedDeltaNetKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new GatedDeltaNetKernel(api, info);
  }
  const char* GetName() const { return "GatedDeltaNet"; }
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i >= 8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
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
