// trtbuild::DenseMatMul and trtbuild::DenseGather for ONNX Runtime's CPU provider: linears (and a tied embedding)
// whose weights are float16, bfloat16 or float, packed at build time 16 rows interleaved (plugins/dense_matmul.py):
//   B [G, K, 16], G = ceil(N / 16): B[g, k, r] is W[16g + r, k]; rows past N are zero.
// DenseMatMul: y[M, N] = x[M, K] @ W^T in float32. Each 16-element vector of B is one k of 16 rows, converted to
// float32 (exactly) in one instruction and multiplied by x[t, k] broadcast to all lanes: each lane accumulates one
// output row, so there are no horizontal sums, and a group's weights are one contiguous stream. A 16-bit weight is
// half the bytes of the float32 copy ONNX Runtime's MatMul would read, which is what batch-1 decode waits on.
// A tile is up to 8 tokens x 32 rows (16 accumulators) with AVX-512; with AVX2 (float_weights.h: Floats16, each
// 16 lanes two registers) 6 tokens x 16 rows. Long steps are cut into tasks of 64 tokens x 8 groups, so
// a task's activations and weights stay in cache while each is reused.
// DenseGather: rows `ids` of the packed table, as float32, shaped [*ids.shape, K] (a tied embedding reads its
// lm_head's packed weights).
#include "cpu_ops.h"
#include "float_weights.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr int64_t kRows = 16;  // rows per group: one per float32 lane
// A tile is kTokens tokens x kTileGroups groups of 16 rows: 16 accumulator registers of AVX-512's 32, 12 of AVX2's
// 16 (two weight registers and a broadcast take the rest). NOTE: AVX2 with 6 tokens ran a float16 K=896 N=4864
// linear 1.3-1.5x faster than with 4 from 16 tokens on (benchmarks/dense_linear.py, alternated builds).
#if defined(__AVX512F__)
constexpr int kTokens = 8;
constexpr int kTileGroups = 2;
#else
constexpr int kTokens = 6;
constexpr int kTileGroups = 1;
#endif
constexpr int64_t kTaskTokens = 64;
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its loads a tile asks for its weights
constexpr int64_t kTaskGroupsLong = 8;   // groups per task when a step has more than one task of tokens
constexpr int64_t kTaskGroupsShort = 2;  // ... and when it has one (decode): more tasks for the thread pool

struct DenseTable {
  std::string op;
  int64_t k, n;

  DenseTable(const char* op_name, const OrtKernelInfo* info) : op(op_name) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    if (k < 1 || n < 1) fail("K and N must be positive");
#ifndef TRTBUILD_FLOATS16
    fail("this CPU has neither AVX-512 nor AVX2 with FMA and F16C; rebuild the engine with `--float-linears ort`");
#endif
  }

  [[noreturn]] void fail(const std::string& what) const {
    ORT_CXX_API_THROW("trtbuild::" + op + ": " + what, ORT_INVALID_ARGUMENT);
  }

  int64_t groups() const { return (n + kRows - 1) / kRows; }

  Weight check(const Ort::ConstValue& b) const {
    const auto info = b.GetTensorTypeAndShapeInfo();
    if (info.GetElementCount() != static_cast<size_t>(groups() * k * kRows))
      fail("B does not hold ceil(N / 16) groups of K x 16 weights (plugins/dense_matmul.py: pack)");
    Weight w;
    if (!weight_of(info.GetElementType(), &w)) fail("B must be float16, bfloat16 or float");
    return w;
  }
};

struct Problem {
  const float* x;
  const void* b;
  float* y;
  int64_t m, n, k;
  const float* bias;  // [N], or null
};

#ifdef TRTBUILD_FLOATS16

// NOTE: a group's weights are one stream from memory, read once per step, and the hardware prefetcher does not stay
// far enough ahead of it while a tile's FMAs run: asking 2 KiB ahead made a 1.5B F16 batch-16 decode step ~20% faster
// and batch 1 ~8% (docs/performance.md)
template <Weight W>
void prefetch(const void* b, int64_t at) {
  constexpr int64_t bytes = W == Weight::kFloat ? 4 : 2;
  _mm_prefetch(static_cast<const char*>(b) + at * bytes + kPrefetchBytes, _MM_HINT_T0);
}

// Rows 16g .. 16g + 16R - 1 of tokens t0 .. t0 + T - 1. With few accumulators (decode), k is split into U
// interleaved chains so that the FMAs' latency hides behind independent ones.
template <Weight W, int T, int R>
void tile(const Problem& p, int64_t g, int64_t t0) {
  constexpr int kChains = T * R * kRegistersPer16;
  constexpr int U = kChains >= 8 ? 1 : kChains >= 4 ? 2 : 4;
  const int64_t k = p.k;
  const float* x = p.x + t0 * k;
  Floats16 acc[U][T][R];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[u][t][r] = zero16();
  int64_t i = 0;
  // NOTE: the unroll pragmas keep every accumulator in a register (a spilled one serializes its chain on memory)
  for (; i + U <= k; i += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      Floats16 w[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        w[r] = load16<W>(p.b, ((g + r) * k + i + u) * kRows);
        prefetch<W>(p.b, ((g + r) * k + i + u) * kRows);
      }
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const Floats16 xv = broadcast16(x[t * k + i + u]);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) acc[u][t][r] = fmadd16(w[r], xv, acc[u][t][r]);
      }
    }
  }
  for (; i < k; ++i) {
    for (int r = 0; r < R; ++r) {
      const Floats16 w = load16<W>(p.b, ((g + r) * k + i) * kRows);
      for (int t = 0; t < T; ++t) acc[0][t][r] = fmadd16(w, broadcast16(x[t * k + i]), acc[0][t][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t rows = std::min(kRows, p.n - (g + r) * kRows);
    for (int t = 0; t < T; ++t) {
      Floats16 sum = acc[0][t][r];
      for (int u = 1; u < U; ++u) sum = add16(sum, acc[u][t][r]);
      if (p.bias) sum = add16(sum, load_rows16(p.bias + (g + r) * kRows, rows));
      store_rows16(p.y + (t0 + t) * p.n + (g + r) * kRows, sum, rows);
    }
  }
}

template <Weight W, int R, int T>
void tail(const Problem& p, int64_t g, int64_t t0, int64_t left) {
  if constexpr (T > 0) {
    if (left == T) return tile<W, T, R>(p, g, t0);
    tail<W, R, T - 1>(p, g, t0, left);
  }
}

template <Weight W, int R>
void tokens(const Problem& p, int64_t g, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + kTokens <= t1; t += kTokens) tile<W, kTokens, R>(p, g, t);
  tail<W, R, kTokens - 1>(p, g, t, t1 - t);
}
#endif

struct Tasks {
  int64_t token_tasks, group_tasks, groups_per_task;
};

Tasks split(int64_t m, int64_t groups) {
  const int64_t token_tasks = (m + kTaskTokens - 1) / kTaskTokens;
  const int64_t per = token_tasks > 1 ? kTaskGroupsLong : kTaskGroupsShort;
  return {token_tasks, (groups + per - 1) / per, per};
}

struct Job {
  Problem p;
  Tasks tasks;
};

template <Weight W>
void run_task(void* data, size_t task) {
#ifdef TRTBUILD_FLOATS16
  const Job& job = *static_cast<const Job*>(data);
  const Problem& p = job.p;
  const int64_t groups = (p.n + kRows - 1) / kRows;
  const int64_t tt = static_cast<int64_t>(task) / job.tasks.group_tasks;
  const int64_t gt = static_cast<int64_t>(task) % job.tasks.group_tasks;
  const int64_t t0 = tt * kTaskTokens, t1 = std::min(p.m, t0 + kTaskTokens);
  const int64_t g1 = std::min(groups, (gt + 1) * job.tasks.groups_per_task);
  int64_t g = gt * job.tasks.groups_per_task;
  for (; g + kTileGroups <= g1; g += kTileGroups) tokens<W, kTileGroups>(p, g, t0, t1);
  for (; g < g1; ++g) tokens<W, 1>(p, g, t0, t1);
#else
  (void)data, (void)task;
#endif
}

struct DenseMatMulKernel {
  DenseTable table;

  DenseMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : table("DenseMatMul", info) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0), b = ctx.GetInput(1);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != table.k) table.fail("the last dimension of x is not K");
    const Weight weight = table.check(b);
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    std::vector<int64_t> out_shape = shape;
    out_shape.back() = table.n;
    Ort::UnownedValue y = ctx.GetOutput(0, out_shape);
    if (m == 0) return;
    Job job{{x.GetTensorData<float>(), b.GetTensorRawData(), y.GetTensorMutableData<float>(), m, table.n, table.k,
             bias(ctx, 2, table.n, [&](const std::string& what) { table.fail(what); })},
            split(m, table.groups())};
    void (*task)(void*, size_t) = weight == Weight::kHalf     ? run_task<Weight::kHalf>
                                  : weight == Weight::kBFloat ? run_task<Weight::kBFloat>
                                                              : run_task<Weight::kFloat>;
    ctx.ParallelFor(task, static_cast<size_t>(job.tasks.token_tasks * job.tasks.group_tasks), 0, &job);
  }
};

struct DenseGatherKernel {
  DenseTable table;

  DenseGatherKernel(const OrtApi&, const OrtKernelInfo* info) : table("DenseGather", info) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue ids = ctx.GetInput(0), b = ctx.GetInput(1);
    const Weight weight = table.check(b);
    const auto ids_info = ids.GetTensorTypeAndShapeInfo();
    const int64_t count = static_cast<int64_t>(ids_info.GetElementCount()), k = table.k;
    const int64_t* rows = ids.GetTensorData<int64_t>();
    std::vector<int64_t> out_shape = ids_info.GetShape();  // Gather's: the ids' shape, then K
    out_shape.push_back(k);
    float* y = ctx.GetOutput(0, out_shape).GetTensorMutableData<float>();
    const void* data = b.GetTensorRawData();
    for (int64_t t = 0; t < count; ++t) {
      const int64_t row = rows[t];
      if (row < 0 || row >= table.n)
        table.fail("id " + std::to_string(row) + " is outside the table's " + std::to_string(table.n));
      const int64_t at = (row / kRows) * k * kRows + row % kRows;  // then a stride of 16 elements per k
      float* out = y + t * k;
      if (weight == Weight::kFloat) {
        for (int64_t i = 0; i < k; ++i) out[i] = static_cast<const float*>(data)[at + i * kRows];
      } else {
        const uint16_t* bits = static_cast<const uint16_t*>(data) + at;
        for (int64_t i = 0; i < k; ++i) {
#ifdef TRTBUILD_FLOATS16
          out[i] = weight == Weight::kHalf ? _cvtsh_ss(bits[i * kRows])
                                           : _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(bits[i * kRows] << 16)));
#else
          (void)bits, (void)out;
#endif
        }
      }
    }
  }
};

ONNXTensorElementDataType dense_input_type(size_t i, bool gather) {  // B: any of the three, checked in Compute
  if (i == 0) return gather ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

struct DenseMatMulOp : Ort::CustomOpBase<DenseMatMulOp, DenseMatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new DenseMatMulKernel(api, info); }
  const char* GetName() const { return "DenseMatMul"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : dense_input_type(i, false);
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {  // the bias
    return i == 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

struct DenseGatherOp : Ort::CustomOpBase<DenseGatherOp, DenseGatherKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new DenseGatherKernel(api, info); }
  const char* GetName() const { return "DenseGather"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const { return dense_input_type(i, true); }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* dense_matmul_op() {
  static DenseMatMulOp op;
  return &op;
}

const OrtCustomOp* dense_gather_op() {
  static DenseGatherOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
