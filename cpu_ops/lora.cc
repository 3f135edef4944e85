// trtbuild::LoraAdd for ONNX Runtime's CPU provider: a linear's output plus each token's own LoRA delta
// (plugins/lora.py has the contract and the numpy reference; builder/native_lora.py makes the nodes):
//   y [M, N], x [M, K], lora_ids [M] int64 (0: no adapter), A [S, C, K], Bt [S, R, N]; C = blocks x R
//   out[t, n] = y[t, n] + sum_r h[t, j(n) R + r] Bt[a - 1, r, n],   h[t, c] = A[a - 1, c, :] . x[t, :],  a = lora_ids[t]
// where block j(n) is the sibling linear whose columns (attribute `splits`) hold n. Only the token's adapter is
// read: the work per token does not grow with the adapters an engine holds. A and Bt are float16, bfloat16 or
// float32 (one type for both). Phase 1 computes h (4 rows of A per task in decode steps, 8 tokens per task in
// longer ones); phase 2 adds the deltas, 256 columns per task, every token of the step through them.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "float_weights.h"

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kRowsPerTask = 4;
constexpr int64_t kFewTokens = 4;
constexpr int64_t kTokensPerTask = 8;
constexpr int64_t kColumnsPerTask = 256;
#if defined(TRTBUILD_FLOATS16)
// NOTE: AVX2's 16 registers hold a quarter of AVX-512's 32 x 16 floats: one token a tile (4 rows of A: 8 registers)
// and 32 columns of Bt, where AVX-512 takes 4 tokens and 64 columns
constexpr int64_t kTileTokens = kRegistersPer16 == 1 ? 4 : 1;  // tokens whose FMAs share one load of the weights
constexpr int kTileColumns16 = kRegistersPer16 == 1 ? 4 : 2;   // columns of a phase-2 tile, in 16s
#endif

struct LoraProblem {
  const float* y;
  const float* x;
  const int64_t* ids;
  const void* a;
  const void* bt;
  float* out;
  float* h;  // [M, C]
  int64_t m, n, k, r, c;
  // phase 1's tasks: a few tokens (decode) split by rows, so that both threads read A; longer steps by tokens, as
  // one small task per token and 4 rows would cost more in the thread pool than the dot products themselves
  int64_t task_tokens, task_rows;
  const int64_t* column_block;  // per task of phase 2: its sibling block
  const int64_t* column_start;  // ... and its columns [start, start + kColumnsPerTask) within that block
  const int64_t* block_end;
};

#if defined(TRTBUILD_FLOATS16)
// Up to kTileTokens consecutive tokens from t that share t's adapter (and at most `limit` of them): a tile's weights
// are loaded once for all its tokens.
int64_t tile_tokens(const LoraProblem& p, int64_t t, int64_t limit) {
  int64_t n = 1;
  while (n < kTileTokens && n < limit && p.ids[t + n] == p.ids[t]) ++n;
  return n;
}

template <Weight W, int T>
void dot_tile(const LoraProblem& p, int64_t t, int64_t c0, int64_t rows) {  // h[t .. t + T, c0 .. c0 + rows)
  const int64_t base = ((p.ids[t] - 1) * p.c + c0) * p.k;
  Floats16 acc[T][kRowsPerTask];
  for (auto& tile : acc)
    for (auto& v : tile) v = zero16();
  for (int64_t i = 0; i < p.k; i += 16) {
    Floats16 xv[T];
    for (int u = 0; u < T; ++u) xv[u] = load16<Weight::kFloat>(p.x, (t + u) * p.k + i);
    for (int64_t r = 0; r < rows; ++r) {
      const Floats16 w = load16<W>(p.a, base + r * p.k + i);
      for (int u = 0; u < T; ++u) acc[u][r] = fmadd16(w, xv[u], acc[u][r]);
    }
  }
  for (int u = 0; u < T; ++u)
    for (int64_t r = 0; r < rows; ++r) p.h[(t + u) * p.c + c0 + r] = reduce_add16(acc[u][r]);
}

template <Weight W>
void project(void* data, size_t task) {  // phase 1: rows [c0, c1) of h for tokens [t0, t1)
  const LoraProblem& p = *static_cast<const LoraProblem*>(data);
  const int64_t row_tasks = (p.c + p.task_rows - 1) / p.task_rows;
  const int64_t t0 = static_cast<int64_t>(task) / row_tasks * p.task_tokens, t1 = std::min(p.m, t0 + p.task_tokens);
  const int64_t c0 = static_cast<int64_t>(task) % row_tasks * p.task_rows, c1 = std::min(p.c, c0 + p.task_rows);
  for (int64_t t = t0, n; t < t1; t += n) {
    n = tile_tokens(p, t, t1 - t);
    if (p.ids[t] == 0) continue;
    for (int64_t c = c0; c < c1; c += kRowsPerTask) {
      const int64_t rows = std::min(kRowsPerTask, c1 - c);
      switch (n) {
        case 1: dot_tile<W, 1>(p, t, c, rows); break;
        case 2: dot_tile<W, 2>(p, t, c, rows); break;
        case 3: dot_tile<W, 3>(p, t, c, rows); break;
        default: dot_tile<W, 4>(p, t, c, rows);
      }
    }
  }
}

// out[t .. t + T, col .. col + 16 V) = y + sum_r Bt[a - 1, r, cols] h[t, j R + r]
template <Weight W, int T, int V>
void add_tile(const LoraProblem& p, int64_t t, int64_t j, int64_t col) {
  Floats16 acc[T][V];
  for (int u = 0; u < T; ++u)
    for (int v = 0; v < V; ++v) acc[u][v] = load16<Weight::kFloat>(p.y, (t + u) * p.n + col + 16 * v);
  const float* h = p.h + t * p.c + j * p.r;
  const int64_t base = (p.ids[t] - 1) * p.r * p.n + col;
  for (int64_t r = 0; r < p.r; ++r) {
    Floats16 w[V];
    for (int v = 0; v < V; ++v) w[v] = load16<W>(p.bt, base + r * p.n + 16 * v);
    for (int u = 0; u < T; ++u) {
      const Floats16 hv = broadcast16(h[u * p.c + r]);
      for (int v = 0; v < V; ++v) acc[u][v] = fmadd16(w[v], hv, acc[u][v]);
    }
  }
  for (int u = 0; u < T; ++u)
    for (int v = 0; v < V; ++v) store16(p.out + (t + u) * p.n + col + 16 * v, acc[u][v]);
}

template <Weight W, int T>
void add_tokens(const LoraProblem& p, int64_t t, int64_t j, int64_t c0, int64_t c1) {
  int64_t col = c0;
  for (; col + 16 * kTileColumns16 <= c1; col += 16 * kTileColumns16) add_tile<W, T, kTileColumns16>(p, t, j, col);
  switch ((c1 - col) / 16) {
    case 1: add_tile<W, T, 1>(p, t, j, col); break;
    case 2: add_tile<W, T, 2>(p, t, j, col); break;
    case 3: add_tile<W, T, 3>(p, t, j, col); break;
    default: break;
  }
}

template <Weight W>
void expand(void* data, size_t task) {  // phase 2: columns of one task, every token
  const LoraProblem& p = *static_cast<const LoraProblem*>(data);
  const int64_t j = p.column_block[task], c0 = p.column_start[task];
  const int64_t c1 = std::min(c0 + kColumnsPerTask, p.block_end[j]);
  for (int64_t t = 0, n; t < p.m; t += n) {
    n = tile_tokens(p, t, p.m - t);
    if (p.ids[t] == 0) {
      for (int64_t u = t; u < t + n; ++u) std::copy(p.y + u * p.n + c0, p.y + u * p.n + c1, p.out + u * p.n + c0);
      continue;
    }
    switch (n) {
      case 1: add_tokens<W, 1>(p, t, j, c0, c1); break;
      case 2: add_tokens<W, 2>(p, t, j, c0, c1); break;
      case 3: add_tokens<W, 3>(p, t, j, c0, c1); break;
      default: add_tokens<W, 4>(p, t, j, c0, c1);
    }
  }
}
#endif

struct LoraAddKernel {
  int64_t k, n, r;
  std::vector<int64_t> splits;
  std::vector<int64_t> column_block, column_start, block_end;  // phase 2's tasks (LoraProblem), fixed by the splits

  LoraAddKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    r = ki.GetAttribute<int64_t>("R");
    splits = ki.GetAttributes<int64_t>("splits");
    int64_t total = 0;
    for (const int64_t s : splits) {
      if (s < 16 || s % 16) fail("every split must be a positive multiple of 16");
      total += s;
    }
    if (k < 16 || k % 16 || r < 1 || total != n) fail("K must be a multiple of 16, R positive, splits sum to N");
    int64_t start = 0;
    for (size_t j = 0; j < splits.size(); ++j) {
      for (int64_t col = start; col < start + splits[j]; col += kColumnsPerTask) {
        column_block.push_back(static_cast<int64_t>(j));
        column_start.push_back(col);
      }
      start += splits[j];
      block_end.push_back(start);
    }
#if !defined(TRTBUILD_FLOATS16)
    fail("this CPU has neither AVX-512 nor AVX2 with FMA and F16C; rebuild the engine with `--float-linears ort`");
#endif
  }

  [[noreturn]] void fail(const std::string& what) const {
    ORT_CXX_API_THROW("trtbuild::LoraAdd: " + what, ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue y = ctx.GetInput(0), x = ctx.GetInput(1), ids = ctx.GetInput(2), a = ctx.GetInput(3),
                          bt = ctx.GetInput(4);
    const std::vector<int64_t> shape = y.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t m = static_cast<int64_t>(ids.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t c = r * static_cast<int64_t>(splits.size());
    const auto a_info = a.GetTensorTypeAndShapeInfo(), bt_info = bt.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> a_shape = a_info.GetShape(), bt_shape = bt_info.GetShape();
    if (shape.size() != 2 || shape[0] != m || shape[1] != n ||
        static_cast<int64_t>(x.GetTensorTypeAndShapeInfo().GetElementCount()) != m * k)
      fail("y must be [M, N] and x [M, K] with M the tokens of lora_ids");
    if (a_shape.size() != 3 || a_shape[1] != c || a_shape[2] != k || bt_shape.size() != 3 ||
        bt_shape[0] != a_shape[0] || bt_shape[1] != r || bt_shape[2] != n)
      fail("A must be [S, blocks x R, K] and Bt [S, R, N]");
    Weight w, w_bt;
    if (!weight_of(a_info.GetElementType(), &w) || !weight_of(bt_info.GetElementType(), &w_bt) || w != w_bt)
      fail("A and Bt must both be float16, bfloat16 or float");
    const int64_t adapters = a_shape[0];
    const int64_t* id = ids.GetTensorData<int64_t>();
    for (int64_t t = 0; t < m; ++t)
      if (id[t] < 0 || id[t] > adapters)
        fail("lora id " + std::to_string(id[t]) + " outside 0.." + std::to_string(adapters));
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    if (m == 0) return;
    const bool any = std::any_of(id, id + m, [](int64_t i) { return i != 0; });
    if (!any && m <= kFewTokens) {  // NOTE: a decode step of the base model: one copy, no thread pool round trip
      std::copy(y.GetTensorData<float>(), y.GetTensorData<float>() + m * n, out);
      return;
    }
    std::vector<float> h(any ? static_cast<size_t>(m * c) : 0);
    const bool few = m <= kFewTokens;
    LoraProblem p{y.GetTensorData<float>(), x.GetTensorData<float>(), id, a.GetTensorRawData(),
                  bt.GetTensorRawData(), out, h.data(), m, n, k, r, c, few ? 1 : kTokensPerTask,
                  few ? kRowsPerTask : c, column_block.data(), column_start.data(), block_end.data()};
#if defined(TRTBUILD_FLOATS16)
    if (any) {
      auto phase1 = w == Weight::kHalf ? project<Weight::kHalf> : w == Weight::kBFloat ? project<Weight::kBFloat>
                                                                                      : project<Weight::kFloat>;
      const int64_t tasks = (m + p.task_tokens - 1) / p.task_tokens * ((c + p.task_rows - 1) / p.task_rows);
      ctx.ParallelFor(phase1, static_cast<size_t>(tasks), 0, &p);
    }
    auto phase2 = w == Weight::kHalf ? expand<Weight::kHalf> : w == Weight::kBFloat ? expand<Weight::kBFloat>
                                                                                   : expand<Weight::kFloat>;
    ctx.ParallelFor(phase2, column_start.size(), 0, &p);
#endif
  }
};

struct LoraAddOp : Ort::CustomOpBase<LoraAddOp, LoraAddKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new LoraAddKernel(api, info); }
  const char* GetName() const { return "LoraAdd"; }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // A and Bt: any of the three, checked in Compute
    return i < 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                 : i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* lora_add_op() {
  static LoraAddOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
