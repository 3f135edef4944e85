// trtbuild::PagedAttention for ONNX Runtime's CPU provider: the contract of plugins/README.md, float32 pool.
//
// One node per layer instead of the ~34 standard nodes of the CPU lowering (builder/lower_cpu.py): queries and new
// keys are rotated once, then each (new token, query head) is one task: scores against the sequence's past keys,
// read in place from the pool through its block table, and against its own new keys up to itself; softmax; the
// weighted sum of the values. Tasks run on ONNX Runtime's intra-op threads.
#include "cpu_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kMinTasks = 4;

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  const __m512 wv = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 sum = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, sum);
  }
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}
#endif

// Rotate-half RoPE of `heads` vectors of size d at `pos`, in place (cos/sin rows of d/2).
void rope(float* x, int64_t heads, int64_t d, const float* cos_row, const float* sin_row) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cos_row[i] - x2 * sin_row[i];
      v[i + half] = x2 * cos_row[i] + x1 * sin_row[i];
    }
  }
}

struct Step {
  const float* q;      // [T, H, D], rotated
  const float* k_new;  // [T, KVH, D], rotated
  const float* v_new;  // [T, KVH, D]
  const float* pool;   // [NB, L, 2, KVH, BS, D]
  const int64_t* block_tables;
  const int64_t* past;
  const int64_t* starts;
  const int64_t* seq_of_token;
  float* out;  // [T, H, D]
  int64_t heads, kv_heads, d, bs, layers, layer, width;
  float scale;
  int64_t heads_per_task;  // query heads of one KV head that one task computes, reading each key and value once
};

// One task: new token t, KV head g, and up to heads_per_task of its query heads.
void attend(void* data, size_t task) {
  const Step& s = *static_cast<const Step*>(data);
  const int64_t group = s.heads / s.kv_heads, chunks = (group + s.heads_per_task - 1) / s.heads_per_task;
  const int64_t t = static_cast<int64_t>(task) / (s.kv_heads * chunks);
  const int64_t g = static_cast<int64_t>(task) / chunks % s.kv_heads;
  const int64_t h0 = g * group + static_cast<int64_t>(task) % chunks * s.heads_per_task;
  const int64_t nh = std::min(s.heads_per_task, (g + 1) * group - h0);
  const int64_t b = s.seq_of_token[t], past = s.past[b], start = s.starts[b];
  const int64_t visible = past + t - start + 1;  // past keys, then this sequence's new keys up to t
  const int64_t d = s.d;
  thread_local std::vector<float> probs;  // [nh, visible]
  probs.resize(static_cast<size_t>(nh * visible));
  const int64_t head_stride = s.bs * d, kv_stride = s.kv_heads * head_stride;  // within one (block, layer)
  const int64_t layer_offset = (s.layer * 2) * kv_stride + g * head_stride;
  const int64_t block_stride = s.layers * 2 * kv_stride;
  auto key = [&](int64_t j, int64_t which) {  // which 0: K, 1: V
    if (j < past)
      return s.pool + s.block_tables[b * s.width + j / s.bs] * block_stride + layer_offset + which * kv_stride +
             (j % s.bs) * d;
    return (which ? s.v_new : s.k_new) + ((start + j - past) * s.kv_heads + g) * d;
  };
  const float* q = s.q + (t * s.heads + h0) * d;
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = key(j, 0);
    for (int64_t h = 0; h < nh; ++h) probs[h * visible + j] = s.scale * dot(q + h * d, k, d);
  }
  for (int64_t h = 0; h < nh; ++h) {
    float* p = probs.data() + h * visible;
    const float max_score = *std::max_element(p, p + visible);
    float sum = 0.0f;
    for (int64_t j = 0; j < visible; ++j) sum += (p[j] = std::exp(p[j] - max_score));
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < visible; ++j) p[j] *= inv;
  }
  float* out = s.out + (t * s.heads + h0) * d;
  std::fill(out, out + nh * d, 0.0f);
  for (int64_t j = 0; j < visible; ++j) {
    const float* v = key(j, 1);
    for (int64_t h = 0; h < nh; ++h) axpy(probs[h * visible + j], v, out + h * d, d);
  }
}

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::PagedAttention: " + what, ORT_INVALID_ARGUMENT); }

struct PagedAttentionKernel {
  int64_t layer, heads, kv_heads, d, bs, rotary;
  float scale;

  PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    layer = ki.GetAttribute<int64_t>("layer_idx");
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("num_kv_heads");
    d = ki.GetAttribute<int64_t>("head_size");
    bs = ki.GetAttribute<int64_t>("tokens_per_block");
    scale = ki.GetAttribute<float>("scale");
    rotary = ki.GetAttribute<int64_t>("rotary");
    if (kv_heads <= 0 || heads % kv_heads) fail("num_heads must be a multiple of num_kv_heads");
    if (rotary && d % 2) fail("rotary needs an even head_size");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const int64_t t_count = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape()[0];
    const std::vector<int64_t> pool_shape = ctx.GetInput(3).GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> table_shape = ctx.GetInput(4).GetTensorTypeAndShapeInfo().GetShape();
    if (pool_shape.size() != 6 || pool_shape[3] != kv_heads || pool_shape[4] != bs || pool_shape[5] != d)
      fail("kv_cache must be [blocks, layers, 2, num_kv_heads, tokens_per_block, head_size]");
    if (layer < 0 || layer >= pool_shape[1]) fail("layer_idx is outside the pool's layers");
    const int64_t num_seqs = table_shape[0], width = table_shape[1];
    const int64_t* past = ctx.GetInput(5).GetTensorData<int64_t>();
    const int64_t* starts = ctx.GetInput(6).GetTensorData<int64_t>();
    const int64_t* tables = ctx.GetInput(4).GetTensorData<int64_t>();

    float* out = ctx.GetOutput(0, {t_count, heads * d}).GetTensorMutableData<float>();
    float* k_new = ctx.GetOutput(1, {t_count, kv_heads, d}).GetTensorMutableData<float>();
    float* v_new = ctx.GetOutput(2, {t_count, kv_heads, d}).GetTensorMutableData<float>();
    std::memcpy(k_new, ctx.GetInput(1).GetTensorData<float>(), sizeof(float) * t_count * kv_heads * d);
    std::memcpy(v_new, ctx.GetInput(2).GetTensorData<float>(), sizeof(float) * t_count * kv_heads * d);
    thread_local std::vector<float> q;  // rotated queries; reused across calls
    q.assign(ctx.GetInput(0).GetTensorData<float>(), ctx.GetInput(0).GetTensorData<float>() + t_count * heads * d);

    std::vector<int64_t> seq_of_token(static_cast<size_t>(t_count), -1);
    for (int64_t b = 0; b < num_seqs; ++b) {
      if (starts[b] < 0 || starts[b + 1] < starts[b] || starts[b + 1] > t_count)
        fail("query_start_loc is not ascending within [0, T]");
      if (past[b] < 0 || (past[b] + starts[b + 1] - starts[b] > width * bs && starts[b + 1] > starts[b]))
        fail("a sequence's past and new tokens do not fit its block table");
      for (int64_t t = starts[b]; t < starts[b + 1]; ++t) seq_of_token[t] = b;
      for (int64_t j = 0; j < (past[b] + bs - 1) / bs; ++j)
        if (tables[b * width + j] < 0 || tables[b * width + j] >= pool_shape[0])
          fail("a block table entry is outside the pool");
    }
    for (int64_t t = 0; t < t_count; ++t)
      if (seq_of_token[t] < 0) fail("query_start_loc does not cover every token");

    if (rotary) {
      const std::vector<int64_t> rope_shape = ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetShape();
      const int64_t* positions = ctx.GetInput(7).GetTensorData<int64_t>();
      const float* cos_table = ctx.GetInput(8).GetTensorData<float>();
      const float* sin_table = ctx.GetInput(9).GetTensorData<float>();
      const int64_t half = d / 2;
      for (int64_t t = 0; t < t_count; ++t) {
        if (positions[t] < 0 || positions[t] >= rope_shape[0]) fail("a position is outside the rotary table");
        const float* c = cos_table + positions[t] * half;
        const float* s = sin_table + positions[t] * half;
        rope(q.data() + t * heads * d, heads, d, c, s);
        rope(k_new + t * kv_heads * d, kv_heads, d, c, s);
      }
    }
    // NOTE: a task per (token, KV head) reads each key once for its query heads; small steps split a KV head's
    // query heads over a few tasks so that every intra-op thread has work
    const int64_t group = heads / kv_heads;
    const int64_t per_step = std::max<int64_t>(1, t_count * kv_heads);
    const int64_t chunks = std::min(group, std::max<int64_t>(1, (kMinTasks + per_step - 1) / per_step));
    const int64_t per_task = (group + chunks - 1) / chunks;
    Step step{q.data(), k_new, v_new, ctx.GetInput(3).GetTensorData<float>(), tables, past, starts,
              seq_of_token.data(), out, heads, kv_heads, d, bs, pool_shape[1], layer, width, scale, per_task};
    ctx.ParallelFor(attend, static_cast<size_t>(t_count * kv_heads * ((group + per_task - 1) / per_task)), 0, &step);
  }
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PagedAttentionKernel(api, info); }
  const char* GetName() const { return "PagedAttention"; }
  size_t GetInputTypeCount() const { return 10; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i >= 4 && i <= 7) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 7 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* paged_attention_op() {
  static PagedAttentionOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
