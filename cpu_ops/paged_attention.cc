// trtbuild::PagedAttention for ONNX Runtime's CPU provider: the contract of plugins/README.md, float32 or float16 pool.
//
// One node per layer instead of the ~34 standard nodes of the CPU lowering (builder/lower_cpu.py): queries and new
// keys are rotated once, then each (new token, KV head, some of its query heads) is one task: scores against the
// sequence's past keys, read in place from the pool through its block table, and against its own new keys up to
// itself; softmax; the weighted sum of the values. Tasks run on ONNX Runtime's intra-op threads.
// Head sizes of 16 to 128 in steps of 16, and 256 (all the supported models' but the tiny ones) take the vectorized
// path: 16 keys' scores at once (one accumulator per key, summed across lanes by one transpose), exp of 16 scores at a
// time, and the weighted sum of the values kept in registers for up to 16 / (head size / 16) query heads.
// A float16 pool (--kv-pool-dtype float16) takes that path only: its rows are widened to float32 as they are loaded,
// and the step's own keys and values are rounded to float16 first, as the runtime rounds them when it writes them,
// so that every key and value attended is a stored one (the standard-op lowering does the same).
// Attention sinks (gpt-oss; optional input 10, one logit per query head): the sink joins each row's softmax as one
// more score without a value, so it only raises the maximum (if larger) and adds exp(sink - max) to the sum, once
// per (token, head) after the scores are in; without the input nothing else changes.
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

constexpr int64_t kMinTasks = 4;

#if defined(__AVX512F__)
template <int DV, typename T>
inline void prefetch(const T* row, int hint) {
  constexpr int kLines = (16 * DV * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int i = 0; i < kLines; ++i) {
    const char* at = reinterpret_cast<const char*>(row) + 64 * i;
    hint == _MM_HINT_T0 ? _mm_prefetch(at, _MM_HINT_T0) : _mm_prefetch(at, _MM_HINT_T1);
  }
}
constexpr int64_t kAhead = 16;  // value rows prefetched ahead of the weighted sum

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
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
  const float* q;       // [T, H, D], rotated
  const void* k_new;    // [T, KVH, D], rotated, of the pool's element type
  const void* v_new;    // [T, KVH, D], of the pool's element type
  const void* pool;     // [NB, L, 2, KVH, BS, D], float or float16 (uint16_t bits)
  bool half;            // the pool (and k_new, v_new) hold float16
  const int64_t* block_tables;
  const int64_t* past;
  const int64_t* starts;
  const int64_t* seq_of_token;
  float* out;  // [T, H, D]
  int64_t heads, kv_heads, d, bs, layers, layer, width;
  int64_t window;  // a query sees its last `window` keys (itself included); 0: all of them
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) before softmax; 0: none
  const float* sinks;  // [H]: each query head's sink logit (not soft-capped); null: none
  int64_t heads_per_task;  // query heads of one KV head that one task computes, reading each key and value once
};

// What one task reads: new token t's query heads h0 .. h0 + nh - 1 of KV head g, and its visible keys and values
// (the sequence's past ones in the pool, then its new ones up to t): keys first .. visible - 1, all but the oldest
// ones with a sliding window.
struct Task {
  const Step& s;
  int64_t t, g, h0, nh, b, past, start, visible, first;

  Task(const Step& step, size_t task) : s(step) {
    const int64_t group = s.heads / s.kv_heads, chunks = (group + s.heads_per_task - 1) / s.heads_per_task;
    t = static_cast<int64_t>(task) / (s.kv_heads * chunks);
    g = static_cast<int64_t>(task) / chunks % s.kv_heads;
    h0 = g * group + static_cast<int64_t>(task) % chunks * s.heads_per_task;
    nh = std::min(s.heads_per_task, (g + 1) * group - h0);
    b = s.seq_of_token[t], past = s.past[b], start = s.starts[b];
    visible = past + t - start + 1;
    first = s.window > 0 ? std::max<int64_t>(0, visible - s.window) : 0;
  }

  template <typename T>
  const T* row(int64_t j, int64_t which) const {  // key (which 0) or value (1) j
    const int64_t d = s.d, head_stride = s.bs * d, kv_stride = s.kv_heads * head_stride;  // within (block, layer)
    if (j < past)
      return static_cast<const T*>(s.pool) + s.block_tables[b * s.width + j / s.bs] * (s.layers * 2 * kv_stride) +
             (s.layer * 2 + which) * kv_stride + g * head_stride + (j % s.bs) * d;
    return static_cast<const T*>(which ? s.v_new : s.k_new) + ((start + j - past) * s.kv_heads + g) * d;
  }

  const float* queries() const { return s.q + (t * s.heads + h0) * s.d; }
  float* out() const { return s.out + (t * s.heads + h0) * s.d; }
};

// 1 / the softmax denominator of this task's head h (0 .. nh - 1), whose largest score is `max_score`;
// `sum_exp(m)` stores exp(score - m) in place of each score and returns their sum. A sink is one more score without
// a value: the maximum is the larger of the two, and exp(sink - maximum) joins the sum.
template <typename SumExp>
inline float inverse_denominator(const Task& a, int64_t h, float max_score, SumExp sum_exp) {
  if (a.s.sinks == nullptr) return 1.0f / sum_exp(max_score);
  const float sink = a.s.sinks[a.h0 + h], top = std::max(max_score, sink);
  return 1.0f / (sum_exp(top) + std::exp(sink - top));
}

#if defined(__AVX512F__)
// out[h] = sum_j probs[h][j] v_j * inv[h] for `hp` <= HP heads, accumulated in registers; the first `pooled` values
// come from the pool (prefetched ahead).
template <typename T, int DV, int HP>
void weighted_values(const T* const* values, int64_t visible, int64_t pooled, const float* probs, int64_t stride,
                     const float* inv, int64_t hp, float* out) {
  __m512 acc[HP][DV];
  for (int h = 0; h < HP; ++h)
    for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < visible; ++j) {
    if (j + kAhead < pooled) prefetch<DV>(values[j + kAhead], _MM_HINT_T0);
    __m512 v[DV];
#pragma GCC unroll 8
    for (int i = 0; i < DV; ++i) v[i] = widen16(values[j] + 16 * i);
#pragma GCC unroll 16
    for (int h = 0; h < HP; ++h) {
      if (h >= hp) break;
      const __m512 w = _mm512_set1_ps(probs[h * stride + j]);
#pragma GCC unroll 8
      for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_fmadd_ps(w, v[i], acc[h][i]);
    }
  }
  for (int h = 0; h < hp; ++h)
    for (int i = 0; i < DV; ++i)
      _mm512_storeu_ps(out + h * 16 * DV + 16 * i, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])));
}

// scores[h * stride + j] = scale * (query h . key j) for 16 keys of R (float, or float16 bits) and nh query heads.
// NOTE: at most 8 registers of the query are held at once (beside 16 accumulators): a 256-wide head (Gemma) is
// scored in two passes over its halves, where holding all 16 would spill the accumulators.
template <typename R, int DV>
inline void score16(const R* const* keys, const float* q, int64_t nh, __m512 scale, float* scores, int64_t stride) {
  constexpr int kQ = DV < 8 ? DV : 8;
  static_assert(DV % kQ == 0, "head sizes past 128 are multiples of 128");
  for (int64_t h = 0; h < nh; ++h) {
    __m512 acc[16];
#pragma GCC unroll 2
    for (int i0 = 0; i0 < DV; i0 += kQ) {
      __m512 qv[kQ];
#pragma GCC unroll 8
      for (int i = 0; i < kQ; ++i) qv[i] = _mm512_loadu_ps(q + h * 16 * DV + 16 * (i0 + i));
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        int i = 0;
        if (i0 == 0) acc[j] = _mm512_mul_ps(qv[i++], widen16(keys[j]));
#pragma GCC unroll 8
        for (; i < kQ; ++i) acc[j] = _mm512_fmadd_ps(qv[i], widen16(keys[j] + 16 * (i0 + i)), acc[j]);
      }
    }
    _mm512_storeu_ps(scores + h * stride, _mm512_mul_ps(scale, transpose_sum16(acc)));
  }
}

// A task whose head size is 16 * DV, over a pool of T (float, or float16 bits).
template <typename T, int DV>
void attend_vectorized(const Task& a) {
  constexpr int64_t kD = 16 * DV, kHeadsPerPass = 16 / DV;
  // keys first .. a.visible - 1 as rows 0 .. visible - 1 here
  const int64_t visible = a.visible - a.first, stride = (visible + 15) / 16 * 16;
  thread_local std::vector<float> probs;  // [nh, stride]: scores, then unnormalized probabilities
  thread_local std::vector<const T*> rows;  // keys, then values
  thread_local std::vector<float> inv;
  probs.resize(static_cast<size_t>(a.nh * stride));
  rows.resize(static_cast<size_t>(stride + visible));  // keys (padded to 16 with a row of zeros), then values
  inv.resize(static_cast<size_t>(a.nh));
  alignas(64) static const T zeros[16 * DV] = {};
  const T** values = rows.data() + stride;
  for (int64_t j = 0; j < visible; ++j) {  // NOTE: one block-table lookup (and division) per block, not per row
    const int64_t key = a.first + j;
    const bool next_in_block = j > 0 && key < a.past && key % a.s.bs;
    rows[j] = next_in_block ? rows[j - 1] + kD : a.row<T>(key, 0);
    values[j] = next_in_block ? values[j - 1] + kD : a.row<T>(key, 1);
  }
  for (int64_t j = visible; j < stride; ++j) rows[j] = zeros;
  const float* q = a.queries();
  const __m512 scale = _mm512_set1_ps(a.s.scale);
  const float cap = a.s.softcap;
  // NOTE: the pool's rows come from a pool far larger than the caches, a few KiB per block: while 16 keys are
  // scored, the next 16 are fetched and their values brought into L2 for the weighted sum (the step's own new rows
  // are in cache already)
  const int64_t pooled = std::max<int64_t>(0, a.past - a.first);
  for (int64_t j = 0; j < std::min<int64_t>(16, pooled); ++j) prefetch<DV>(rows[j], _MM_HINT_T0);
  for (int64_t j0 = 0; j0 < visible; j0 += 16) {
    for (int64_t j = j0; j < std::min(j0 + 16, pooled); ++j) {
      prefetch<DV>(values[j], _MM_HINT_T1);
      if (j + 16 < pooled) prefetch<DV>(rows[j + 16], _MM_HINT_T0);
    }
    float* scores = probs.data() + j0;
    if (std::is_same_v<T, float> || a.nh == 1) {
      score16<T, DV>(rows.data() + j0, q, a.nh, scale, scores, stride);
    } else {  // NOTE: widen the 16 float16 keys once for all the task's query heads, not once per head
      alignas(64) float widened[16 * kD];
      const float* keys[16];
      for (int j = 0; j < 16; ++j) {
        for (int i = 0; i < DV; ++i) _mm512_store_ps(widened + j * kD + 16 * i, widen16(rows[j0 + j] + 16 * i));
        keys[j] = widened + j * kD;
      }
      score16<float, DV>(keys, q, a.nh, scale, scores, stride);
    }
  }
  for (int64_t h = 0; h < a.nh; ++h) {
    float* p = probs.data() + h * stride;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j0 = 0; j0 < visible; j0 += 16) {
      __m512 x = _mm512_loadu_ps(p + j0);
      if (cap > 0.0f) {
        x = _mm512_mul_ps(_mm512_set1_ps(cap), tanh16(_mm512_div_ps(x, _mm512_set1_ps(cap))));
        _mm512_storeu_ps(p + j0, x);
      }
      top = _mm512_mask_max_ps(top, first(visible - j0), top, x);
    }
    inv[h] = inverse_denominator(a, h, _mm512_reduce_max_ps(top), [&](float max_score) {
      const __m512 m = _mm512_set1_ps(max_score);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < visible; j0 += 16) {
        const __m512 e = _mm512_maskz_mov_ps(first(visible - j0), exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j0), m)));
        _mm512_storeu_ps(p + j0, e);
        sum = _mm512_add_ps(sum, e);
      }
      return _mm512_reduce_add_ps(sum);
    });
  }
  for (int64_t h = 0; h < a.nh; h += kHeadsPerPass)
    weighted_values<T, DV, kHeadsPerPass>(values, visible, pooled, probs.data() + h * stride, stride,
                                       inv.data() + h, std::min(kHeadsPerPass, a.nh - h), a.out() + h * kD);
}
#endif

// Whether this build reads a float16 pool on the generic path (F16C widens the rows; every AVX-512 CPU has it).
constexpr bool kGenericHalf =
#if defined(__F16C__)
    true;
#else
    false;
#endif

// Row `row` (d values) as float32: the pool's own memory for a float32 pool, else widened into `buffer`.
template <typename T>
inline const float* widened(const T* row, int64_t d, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    (void)d, (void)buffer;
    return row;
  } else {
    buffer.resize(static_cast<size_t>(d));
#if defined(__F16C__)
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      _mm256_storeu_ps(buffer.data() + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
    for (; i < d; ++i) buffer[i] = _cvtsh_ss(row[i]);
#endif
    return buffer.data();
  }
}

// A task of any head size, over a float32 pool or (kGenericHalf) a float16 one.
template <typename T>
void attend_generic(const Task& a) {
  thread_local std::vector<float> row_buffer;
  const int64_t nh = a.nh, visible = a.visible - a.first, d = a.s.d;  // keys a.first .. as 0 ..
  thread_local std::vector<float> probs;  // [nh, visible]
  probs.resize(static_cast<size_t>(nh * visible));
  const float* q = a.queries();
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = widened(a.row<T>(a.first + j, 0), d, row_buffer);
    for (int64_t h = 0; h < nh; ++h) probs[h * visible + j] = a.s.scale * dot(q + h * d, k, d);
  }
  if (const float cap = a.s.softcap; cap > 0.0f)
    for (float& p : probs) p = cap * std::tanh(p / cap);
  for (int64_t h = 0; h < nh; ++h) {
    float* p = probs.data() + h * visible;
    const float inv = inverse_denominator(a, h, *std::max_element(p, p + visible),
                                          [&](float max_score) { return exp_shifted(p, visible, max_score); });
    for (int64_t j = 0; j < visible; ++j) p[j] *= inv;
  }
  float* out = a.out();
  std::fill(out, out + nh * d, 0.0f);
  for (int64_t j = 0; j < visible; ++j) {
    const float* v = widened(a.row<T>(a.first + j, 1), d, row_buffer);
    for (int64_t h = 0; h < nh; ++h) axpy(probs[h * visible + j], v, out + h * d, d);
  }
}

// Whether head size d takes the vectorized path (the only one that reads a float16 pool): 16 to 128 in steps of 16,
// and Gemma's 256.
bool vectorized(int64_t d) {
#if defined(__AVX512F__)
  return (d >= 16 && d <= 128 && d % 16 == 0) || d == 256;
#else
  (void)d;
  return false;
#endif
}

#if defined(__AVX512F__)
template <typename T>
void attend_vectorized(const Task& a) {
  switch (a.s.d) {
    case 16: return attend_vectorized<T, 1>(a);
    case 32: return attend_vectorized<T, 2>(a);
    case 48: return attend_vectorized<T, 3>(a);
    case 64: return attend_vectorized<T, 4>(a);
    case 80: return attend_vectorized<T, 5>(a);
    case 96: return attend_vectorized<T, 6>(a);
    case 112: return attend_vectorized<T, 7>(a);
    case 128: return attend_vectorized<T, 8>(a);
    default: return attend_vectorized<T, 16>(a);
  }
}
#endif

void attend(void* data, size_t task) {
  const Task a(*static_cast<const Step*>(data), task);
#if defined(__AVX512F__)
  if (vectorized(a.s.d)) return a.s.half ? attend_vectorized<uint16_t>(a) : attend_vectorized<float>(a);
#endif
  return a.s.half ? attend_generic<uint16_t>(a) : attend_generic<float>(a);
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
    if (half && !vectorized(d) && !kGenericHalf)
      fail("a float16 kv_cache needs F16C (or AVX-512 and a head_size of 16 to 128 in steps of 16, or 256); build "
           "with --kv-pool-dtype float32 or --attention split");
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
    // NOTE: a task per (token, KV head) reads each key once for its query heads; small steps split a KV head's
    // query heads over a few tasks so that every intra-op thread has work
    const int64_t group = heads / kv_heads;
    const int64_t per_step = std::max<int64_t>(1, t_count * kv_heads);
    const int64_t chunks = std::min(group, std::max<int64_t>(1, (kMinTasks + per_step - 1) / per_step));
    const int64_t per_task = (group + chunks - 1) / chunks;
    thread_local std::vector<uint16_t> k_half, v_half;
    if (half) {
      round_to_half(k_new, t_count * kv_heads * d, k_half);
      round_to_half(v_new, t_count * kv_heads * d, v_half);
    }
    Step step{q.data(), half ? static_cast<const void*>(k_half.data()) : k_new,
              half ? static_cast<const void*>(v_half.data()) : v_new, ctx.GetInput(3).GetTensorRawData(), half,
              tables, past, starts, seq_of_token.data(), out, heads, kv_heads, d, bs, pool_shape[1], layer, width,
              window, scale, softcap, sinks, per_task};
    ctx.ParallelFor(attend, static_cast<size_t>(t_count * kv_heads * ((group + per_task - 1) / per_task)), 0, &step);
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
