// trtbuild::PagedShortConv for ONNX Runtime's CPU provider: LFM2's short (depthwise, causal) convolution over the
// paged KV pool, the contract and numpy reference of plugins/short_conv.py, float32 or float16 pool.
//
// y[t, c] = bias[c] + sum over i < L of weight[c, i] * u(p - L + 1 + i)[c], p token t's position in its sequence,
// u(q) the sequence's input row at position q: zero before 0, a past token's row gathered from the pool (slots
// layer_idx .. layer_idx + E - 1 of block block_tables[b, q / BS], offset q % BS; the row's channels in slot, K|V,
// head, value order, c = ((e * 2 + k) * KVH + h) * D + d), else the new token's own row of x. The op never writes
// the pool: new_entries [E, 2, T, KVH, D] is x laid out as those slots (zero-padded), which the runtime writes.
// A task is a range of tokens (ONNX Runtime's intra-op threads): for each token, each tap's row is fetched whole as
// H float32 values (a float32 pool's or x's rows in place, else widened / gathered into a buffer), then one
// auto-vectorized multiply-add over the channels against the tap's weights, transposed once to [L, H].
// A float16 pool (--kv-pool-dtype float16) has its rows widened with F16C, and the new tokens' rows rounded to
// float16 (to nearest even, as numpy rounds when the runtime writes them), so that every input the convolution sees
// is a stored one and chunked and whole prefills give the same values.
#include "cpu_ops.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kTokensPerTask = 4;

void fail(const std::string& what) { ORT_CXX_API_THROW("trtbuild::PagedShortConv: " + what, ORT_INVALID_ARGUMENT); }

// n float32 values as a float16 pool holds them: rounded to float16 (nearest even) and widened back.
inline void round_through_half(const float* from, float* to, int64_t n) {
#if defined(__F16C__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(from + i), kRound)));
  for (; i < n; ++i) to[i] = _cvtsh_ss(_cvtss_sh(from[i], kRound));
#else
  (void)from, (void)to, (void)n;
#endif
}

struct Problem {
  const float* x;         // [T, H]
  const void* pool;       // [NB, slots, 2, KVH, BS, D], float or uint16_t (float16)
  const int64_t* tables;  // [B, W]
  const int64_t* past;    // [B]
  const int64_t* starts;  // [B + 1]
  const int64_t* seq_of_token;
  const float* taps;  // the weight transposed: [L, H]
  const float* bias;  // [H] or null
  float* y;           // [T, H]
  float* entries;     // [E, 2, T, KVH, D]
  int64_t tokens, hidden, kernel, slots, layer, kv_heads, bs, d, width, e;
};

// Row q < past of sequence b, gathered from the pool into `row` (H values, widened when the pool is float16).
template <typename T>
void pool_row(const Problem& p, int64_t b, int64_t q, float* row) {
  const T* pool = static_cast<const T*>(p.pool);
  const int64_t block = p.tables[b * p.width + q / p.bs], offset = q % p.bs;
  // segment s of D values: (slot e, K|V half k, head h) with s = (e * 2 + k) * KVH + h, pool index
  // (((block * slots + layer + e) * 2 + k) * KVH + h) * BS + offset = ((block * slots + layer) * 2 * KVH + s) * BS + ..
  const T* base = pool + ((block * p.slots + p.layer) * 2 * p.kv_heads * p.bs + offset) * p.d;
  for (int64_t s = 0, c = 0; c < p.hidden; ++s, c += p.d) {
    const T* from = base + s * p.bs * p.d;
    const int64_t n = std::min(p.d, p.hidden - c);  // NOTE: the last slot's padding is never read
    if constexpr (std::is_same_v<T, float>)
      std::memcpy(row + c, from, sizeof(float) * n);
    else
      widen_half(from, row + c, n);
  }
}

// Token t's row written as its new entries, zero-padded to E slots.
void write_entries(const Problem& p, int64_t t) {
  const int64_t half_slot = p.kv_heads * p.d;  // the values of one K|V half of a slot
  const float* row = p.x + t * p.hidden;
  for (int64_t s = 0; s < 2 * p.e; ++s) {  // s = e * 2 + k
    float* to = p.entries + (s * p.tokens + t) * half_slot;
    const int64_t c = s * half_slot, n = std::clamp<int64_t>(p.hidden - c, 0, half_slot);
    std::memcpy(to, row + c, sizeof(float) * n);
    std::fill(to + n, to + half_slot, 0.0f);
  }
}

template <typename T>
void convolve_tokens(void* data, size_t task) {
  const Problem& p = *static_cast<const Problem*>(data);
  constexpr bool kHalf = std::is_same_v<T, uint16_t>;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(p.hidden));
  const int64_t h = p.hidden;
  const int64_t first = static_cast<int64_t>(task) * kTokensPerTask;
  for (int64_t t = first; t < std::min(p.tokens, first + kTokensPerTask); ++t) {
    const int64_t b = p.seq_of_token[t], past = p.past[b], start = p.starts[b];
    const int64_t pos = past + t - start;
    float* y = p.y + t * h;
    std::fill(y, y + h, 0.0f);
    for (int64_t i = 0; i < p.kernel; ++i) {
      const int64_t q = pos - p.kernel + 1 + i;
      if (q < 0) continue;  // before the sequence: zero
      const float* u;
      if (q < past) {
        pool_row<T>(p, b, q, buffer.data());
        u = buffer.data();
      } else if (kHalf) {
        round_through_half(p.x + (start + q - past) * h, buffer.data(), h);
        u = buffer.data();
      } else {
        u = p.x + (start + q - past) * h;
      }
      const float* w = p.taps + i * h;
      for (int64_t c = 0; c < h; ++c) y[c] += w[c] * u[c];
    }
    if (p.bias)
      for (int64_t c = 0; c < h; ++c) y[c] += p.bias[c];
    write_entries(p, t);
  }
}

struct PagedShortConvKernel {
  int64_t layer;

  static constexpr size_t kBias = 6;

  PagedShortConvKernel(const OrtApi&, const OrtKernelInfo* info) {
    layer = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("layer_idx");
    if (layer < 0) fail("layer_idx must not be negative");
  }

  // The optional bias: absent (fewer inputs, or an empty name) -> null; else it must be [H].
  static const float* bias_of(Ort::KernelContext& ctx, int64_t hidden) {
    if (ctx.GetInputCount() <= kBias) return nullptr;
    const Ort::ConstValue v = ctx.GetInput(kBias);
    if (static_cast<const OrtValue*>(v) == nullptr) return nullptr;
    const std::vector<int64_t> shape = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 1 || shape[0] != hidden) fail("bias must be [H], one value per channel of x");
    return v.GetTensorData<float>();
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto shape_of = [&](size_t i) { return ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape(); };
    const std::vector<int64_t> x_shape = shape_of(0), pool_shape = shape_of(1), table_shape = shape_of(2),
                               past_shape = shape_of(3), starts_shape = shape_of(4), w_shape = shape_of(5);
    if (x_shape.size() != 2) fail("x must be [T, H]");
    const int64_t t_count = x_shape[0], hidden = x_shape[1];

    const ONNXTensorElementDataType pool_type = ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetElementType();
    const bool half = pool_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!half && pool_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("kv_cache must be float32 or float16");
    if (half && !kReadsHalf) fail("a float16 kv_cache needs a CPU with F16C; build with --kv-pool-dtype float32");
    if (pool_shape.size() != 6 || pool_shape[2] != 2 || pool_shape[3] <= 0 || pool_shape[4] <= 0 || pool_shape[5] <= 0)
      fail("kv_cache must be [blocks, slots, 2, num_kv_heads, tokens_per_block, head_size]");
    const int64_t blocks = pool_shape[0], slots = pool_shape[1], kv_heads = pool_shape[3], bs = pool_shape[4],
                  d = pool_shape[5];
    const int64_t entries = (hidden + 2 * kv_heads * d - 1) / (2 * kv_heads * d);
    if (layer + entries > slots)
      fail("layer_idx + entries (" + std::to_string(layer) + " + " + std::to_string(entries) +
           ") exceeds the pool's " + std::to_string(slots) + " slots: a row of H values takes ceil(H / (2 * "
           "num_kv_heads * head_size)) slots from layer_idx");

    if (w_shape.size() != 2 || w_shape[0] != hidden || w_shape[1] < 1)
      fail("weight must be [H, L] with H x's channels and L >= 1 (the kernel size)");
    const int64_t kernel = w_shape[1];
    const float* bias = bias_of(ctx, hidden);

    if (table_shape.size() != 2) fail("block_tables must be [B, W]");
    const int64_t num_seqs = table_shape[0], width = table_shape[1];
    if (past_shape != std::vector<int64_t>{num_seqs}) fail("past_lengths must be [B], B block_tables' rows");
    if (starts_shape != std::vector<int64_t>{num_seqs + 1}) fail("query_start_loc must be [B + 1]");
    const int64_t* tables = ctx.GetInput(2).GetTensorData<int64_t>();
    const int64_t* past = ctx.GetInput(3).GetTensorData<int64_t>();
    const int64_t* starts = ctx.GetInput(4).GetTensorData<int64_t>();

    std::vector<int64_t> seq_of_token(static_cast<size_t>(t_count), -1);
    for (int64_t b = 0; b < num_seqs; ++b) {
      if (starts[b] < 0 || starts[b + 1] < starts[b] || starts[b + 1] > t_count)
        fail("query_start_loc is not ascending within [0, T]");
      const int64_t n = starts[b + 1] - starts[b];
      if (past[b] < 0 || (n > 0 && past[b] + n > width * bs))
        fail("a sequence's past and new tokens do not fit its block table");
      std::fill(seq_of_token.begin() + starts[b], seq_of_token.begin() + starts[b + 1], b);
      if (n == 0) continue;
      // NOTE: only the blocks of the last L - 1 past positions are read; a convolution layer's group gives the
      // blocks before its window back to the pool, so older table entries are not checked
      for (int64_t j = std::max<int64_t>(0, past[b] - kernel + 1) / bs; j * bs < past[b]; ++j)
        if (tables[b * width + j] < 0 || tables[b * width + j] >= blocks)
          fail("a block table entry is outside the pool");
    }
    for (int64_t t = 0; t < t_count; ++t)
      if (seq_of_token[t] < 0) fail("query_start_loc does not cover every token");

    thread_local std::vector<float> taps;  // NOTE: weight [H, L] transposed, so a tap's weights are contiguous
    taps.resize(static_cast<size_t>(kernel * hidden));
    const float* weight = ctx.GetInput(5).GetTensorData<float>();
    for (int64_t c = 0; c < hidden; ++c)
      for (int64_t i = 0; i < kernel; ++i) taps[i * hidden + c] = weight[c * kernel + i];

    float* y = ctx.GetOutput(0, {t_count, hidden}).GetTensorMutableData<float>();
    float* new_entries =
        ctx.GetOutput(1, {entries, 2, t_count, kv_heads, d}).GetTensorMutableData<float>();
    if (t_count == 0) return;
    Problem p{ctx.GetInput(0).GetTensorData<float>(), ctx.GetInput(1).GetTensorRawData(), tables, past, starts,
              seq_of_token.data(), taps.data(), bias, y, new_entries, t_count, hidden, kernel, slots, layer,
              kv_heads, bs, d, width, entries};
    ctx.ParallelFor(half ? convolve_tokens<uint16_t> : convolve_tokens<float>,
                    static_cast<size_t>((t_count + kTokensPerTask - 1) / kTokensPerTask), 0, &p);
  }
};

struct PagedShortConvOp : Ort::CustomOpBase<PagedShortConvOp, PagedShortConvKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new PagedShortConvKernel(api, info);
  }
  const char* GetName() const { return "PagedShortConv"; }
  size_t GetInputTypeCount() const { return 7; }  // 6: bias, optional
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 1) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // the pool: float or float16, checked by Compute
    return (i >= 2 && i <= 4) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == PagedShortConvKernel::kBias ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                           : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* short_conv_op() {
  static PagedShortConvOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
