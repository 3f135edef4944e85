// trtbuild::PagedAttention for ONNX Runtime's CPU provider: the contract of plugins/README.md, float32 or float16 pool.
//
// One node per layer instead of the ~34 standard nodes of the CPU lowering (builder/lower_cpu.py): queries and new
// keys are rotated once, then each (new token, KV head, some of its query heads) is one task: scores against the
// sequence's past keys, read in place from the pool through its block table, and against its own new keys up to
// itself; softmax; the weighted sum of the values. Tasks run on ONNX Runtime's intra-op threads.
// A task takes the build CPU's vectorized path where its head size has one (cpu_ops/attend_avx512.h: 16 to 128 in
// steps of 16, and 256; cpu_ops/attend_avx2.h: multiples of 8), else the generic one below.
// A float16 pool (--kv-pool-dtype float16) has its rows widened to float32 as they are loaded (F16C), and the step's
// own keys and values rounded to float16 first, as the runtime rounds them when it writes them, so that every key and
// value attended is a stored one (the standard-op lowering does the same).
// Attention sinks (gpt-oss; optional input 10, one logit per query head): the sink joins each row's softmax as one
// more score without a value, so it only raises the maximum (if larger) and adds exp(sink - max) to the sum, once
// per (token, head) after the scores are in; without the input nothing else changes.
#include "attend_avx2.h"
#include "attend_avx512.h"
#include "attention_task.h"
#include "cpu_ops.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {
using namespace attention;

constexpr int64_t kMinTasks = 4;
constexpr int64_t kRangeKeys = 256;  // the fewest keys a range of a split context holds

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

// Row `row` (d values) as float32: the pool's own memory for a float32 pool, else widened into `buffer`.
template <typename T>
inline const float* widened(const T* row, int64_t d, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    (void)d, (void)buffer;
    return row;
  } else {
    buffer.resize(static_cast<size_t>(d));
    widen_half(row, buffer.data(), d);
    return buffer.data();
  }
}

// A task of any head size, over a float32 pool or (kReadsHalf) a float16 one.
template <typename T>
void attend_generic(const Task& a) {
  thread_local std::vector<float> row_buffer;
  const int64_t nh = a.nh, visible = a.visible - a.first, d = a.s.d;  // keys a.first .. as 0 ..
  thread_local std::vector<float> probs;  // [nh, visible]
  thread_local std::vector<const T*> rows;  // keys, then values
  probs.resize(static_cast<size_t>(nh * visible));
  rows.resize(static_cast<size_t>(2 * visible));
  a.rows(rows.data(), rows.data() + visible);
  const float* q = a.queries();
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = widened(rows[j], d, row_buffer);
    for (int64_t h = 0; h < nh; ++h) probs[h * visible + j] = a.s.scale * dot(q + h * d, k, d);
  }
  if (const float cap = a.s.softcap; cap > 0.0f) soft_cap(probs.data(), nh * visible, cap);
  for (int64_t h = 0; h < nh; ++h) {
    float* p = probs.data() + h * visible;
    const float inv = inverse_denominator(a, h, *std::max_element(p, p + visible),
                                          [&](float max_score) { return exp_shifted(p, visible, max_score); });
    for (int64_t j = 0; j < visible; ++j) p[j] *= inv;
  }
  float* out = a.out();
  std::fill(out, out + nh * d, 0.0f);
  for (int64_t j = 0; j < visible; ++j) {
    const float* v = widened(rows[visible + j], d, row_buffer);
    for (int64_t h = 0; h < nh; ++h) axpy(probs[h * visible + j], v, out + h * d, d);
  }
}

void attend(void* data, size_t task) {
  const Task a(*static_cast<const Step*>(data), task);
  if (a.visible <= a.first) {  // an empty range of a short context: weighed 0 by combine_ranges
    std::fill(a.lse, a.lse + a.nh, -std::numeric_limits<float>::infinity());
    return;
  }
#if defined(__AVX512F__)
  if (avx512_attends(a.s.d)) return a.s.half ? attend_avx512<uint16_t>(a) : attend_avx512<float>(a);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (avx2_attends(a.s.d)) return a.s.half ? attend_avx2<uint16_t>(a) : attend_avx2<float>(a);
#endif
  return a.s.half ? attend_generic<uint16_t>(a) : attend_generic<float>(a);
}

// out[t, h] = the ranges' outputs weighed by their share of the softmax sum, exp(lse - m) / sum over ranges (and the
// sink) of exp(lse - m), m the largest log-sum-exp: every token has a non-empty range.
void combine_ranges(const Step& s) {
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      const auto lse = [&](int64_t r) { return s.range_lse[(r * s.tokens + t) * s.heads + h]; };
      float top = s.sinks ? s.sinks[h] : -std::numeric_limits<float>::infinity(), sum = 0.0f;
      for (int64_t r = 0; r < s.splits; ++r) top = std::max(top, lse(r));
      for (int64_t r = 0; r < s.splits; ++r) sum += std::exp(lse(r) - top);
      if (s.sinks) sum += std::exp(s.sinks[h] - top);
      float* out = s.out + (t * s.heads + h) * s.d;
      std::fill(out, out + s.d, 0.0f);
      for (int64_t r = 0; r < s.splits; ++r)  // NOTE: an empty range (weight 0) left its output unwritten
        if (const float w = std::exp(lse(r) - top); w > 0.0f)
          axpy(w / sum, s.range_out + ((r * s.tokens + t) * s.heads + h) * s.d, out, s.d);
    }
}

// this step's keys or values as the float16 pool will hold them (rounded to nearest even, as numpy rounds when the
// runtime writes new_kv to the pool)
void round_to_half(const float* x, int64_t n, std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(n));
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::PagedAttention: " + what, ORT_INVALID_ARGUMENT); }

struct PagedAttentionKernel {
  int64_t layer, heads, kv_heads, d, bs, rotary, window;
  float scale, softcap;

  static constexpr size_t kSinks = 10;

  // The optional sinks input: absent (fewer inputs, or an empty name) -> null; else it must hold H floats.
  const float* sinks_of(Ort::KernelContext& ctx) const {
    if (ctx.GetInputCount() <= kSinks) return nullptr;
    const Ort::ConstValue v = ctx.GetInput(kSinks);
    if (static_cast<const OrtValue*>(v) == nullptr) return nullptr;
    if (v.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(heads))
      fail("sinks must hold one float per query head (num_heads)");
    return v.GetTensorData<float>();
  }

  PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    layer = ki.GetAttribute<int64_t>("layer_idx");
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("num_kv_heads");
    d = ki.GetAttribute<int64_t>("head_size");
    bs = ki.GetAttribute<int64_t>("tokens_per_block");
    scale = ki.GetAttribute<float>("scale");
    rotary = ki.GetAttribute<int64_t>("rotary");
    window = optional_attribute<int64_t>(ki, "window", 0);  // NOTE: both absent from older engines
    softcap = optional_attribute<float>(ki, "softcap", 0.0f);
    if (window < 0) fail("window must be 0 (none) or positive");
    if (!(softcap >= 0.0f)) fail("softcap must be 0 (none) or positive");
    if (kv_heads <= 0 || heads % kv_heads) fail("num_heads must be a multiple of num_kv_heads");
    if (rotary && d % 2) fail("rotary needs an even head_size");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const int64_t t_count = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape()[0];
    const std::vector<int64_t> pool_shape = ctx.GetInput(3).GetTensorTypeAndShapeInfo().GetShape();
    const ONNXTensorElementDataType pool_type = ctx.GetInput(3).GetTensorTypeAndShapeInfo().GetElementType();
    const bool half = pool_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!half && pool_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("kv_cache must be float32 or float16");
    if (half && !kReadsHalf)
      fail("a float16 kv_cache needs a CPU with F16C; build with --kv-pool-dtype float32 or --attention split");
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
    const float* sinks = sinks_of(ctx);

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
    // NOTE: a task per (token, KV head) reads each key once for its query heads; small steps split each token's
    // keys into ranges where its context is long (attention_task.h), else a KV head's query heads, over a few
    // tasks so that every intra-op thread has work
    const int64_t group = heads / kv_heads;
    const int64_t per_step = std::max<int64_t>(1, t_count * kv_heads);
    const int64_t wanted = std::max<int64_t>(1, (kMinTasks + per_step - 1) / per_step);
    int64_t longest = 0;  // the most keys a token of this step sees
    for (int64_t b = 0; b < num_seqs; ++b)
      if (starts[b + 1] > starts[b]) longest = std::max(longest, past[b] + starts[b + 1] - starts[b]);
    if (window > 0) longest = std::min(longest, window);
    const int64_t splits = std::min(wanted, longest / kRangeKeys);
    const int64_t chunks = splits > 1 ? 1 : std::min(group, wanted);
    const int64_t per_task = (group + chunks - 1) / chunks;
    thread_local std::vector<uint16_t> k_half, v_half;
    if (half) {
      round_to_half(k_new, t_count * kv_heads * d, k_half);
      round_to_half(v_new, t_count * kv_heads * d, v_half);
    }
    Step step{q.data(), half ? static_cast<const void*>(k_half.data()) : k_new,
              half ? static_cast<const void*>(v_half.data()) : v_new, ctx.GetInput(3).GetTensorRawData(), half,
              tables, past, starts, seq_of_token.data(), out, heads, kv_heads, d, bs, pool_shape[1], layer, width,
              window, scale, softcap, sinks, per_task, t_count, std::max<int64_t>(1, splits)};
    thread_local std::vector<float> range_out, range_lse;
    if (step.splits > 1) {
      range_out.resize(static_cast<size_t>(step.splits * t_count * heads * d));
      range_lse.resize(static_cast<size_t>(step.splits * t_count * heads));
      step.range_out = range_out.data(), step.range_lse = range_lse.data();
    }
    const int64_t tasks = t_count * kv_heads * ((group + per_task - 1) / per_task) * step.splits;
    ctx.ParallelFor(attend, static_cast<size_t>(tasks), 0, &step);
    if (step.splits > 1) combine_ranges(step);
  }
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PagedAttentionKernel(api, info); }
  const char* GetName() const { return "PagedAttention"; }
  size_t GetInputTypeCount() const { return 11; }  // 7-9: rotary=1 only; 10: sinks, optional
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // the pool: float or float16, checked by Compute
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
