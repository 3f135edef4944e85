// trtbuild::LoraAdd for ONNX Runtime's CPU provider: a linear's output plus each token's own LoRA delta
// (plugins/lora.py has the contract and the numpy reference; builder/native_lora.py makes the nodes):
//   y [M, N], x [M, K], lora_ids [M] int64 (0: no adapter), A [S, C, K], Bt [S, R, N]; C = blocks x R
//   out[t, n] = y[t, n] + sum_r h[t, j(n) R + r] Bt[a - 1, r, n],   h[t, c] = A[a - 1, c, :] . x[t, :],  a = lora_ids[t]
// where block j(n) is the sibling linear whose columns (attribute `splits`) hold n. Only the token's adapter is
// read: the work per token does not grow with the adapters an engine holds. A and Bt are float16, bfloat16 or
// float32 (one type for both). Phase 1 computes h, 4 rows of A per task; phase 2 adds the deltas, 256 columns per
// task, every token of the step through them.
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
constexpr int64_t kColumnsPerTask = 256;

struct LoraProblem {
  const float* y;
  const float* x;
  const int64_t* ids;
  const void* a;
  const void* bt;
  float* out;
  float* h;  // [M, C]
  int64_t m, n, k, r, c;
  std::vector<int64_t> column_block;  // per task of phase 2: its sibling block
  std::vector<int64_t> column_start;  // ... and its columns [start, start + kColumnsPerTask) within that block
  std::vector<int64_t> block_end;
};

#if defined(__AVX512F__)
template <Weight W>
void project(void* data, size_t task) {  // phase 1: h rows [c0, c0 + 4) of one token
  const LoraProblem& p = *static_cast<const LoraProblem*>(data);
  const int64_t tasks_per_token = (p.c + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t t = static_cast<int64_t>(task) / tasks_per_token;
  const int64_t c0 = static_cast<int64_t>(task) % tasks_per_token * kRowsPerTask;
  const int64_t adapter = p.ids[t];
  if (adapter == 0) return;
  const int64_t rows = std::min(kRowsPerTask, p.c - c0);
  const int64_t base = ((adapter - 1) * p.c + c0) * p.k;
  const float* x = p.x + t * p.k;
  __m512 acc[kRowsPerTask];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < p.k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(load16<W>(p.a, base + r * p.k + i), xv, acc[r]);
  }
  for (int64_t r = 0; r < rows; ++r) p.h[t * p.c + c0 + r] = _mm512_reduce_add_ps(acc[r]);
}

template <Weight W>
void expand(void* data, size_t task) {  // phase 2: columns of one task, every token
  const LoraProblem& p = *static_cast<const LoraProblem*>(data);
  const int64_t j = p.column_block[task], c0 = p.column_start[task];
  const int64_t c1 = std::min(c0 + kColumnsPerTask, p.block_end[j]);
  constexpr int64_t kVectors = kColumnsPerTask / 16;
  for (int64_t t = 0; t < p.m; ++t) {
    const float* y = p.y + t * p.n;
    float* out = p.out + t * p.n;
    const int64_t adapter = p.ids[t];
    if (adapter == 0) {
      std::copy(y + c0, y + c1, out + c0);
      continue;
    }
    const int64_t vectors = (c1 - c0) / 16;
    __m512 acc[kVectors];
    for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm512_loadu_ps(y + c0 + 16 * v);
    const float* h = p.h + t * p.c + j * p.r;
    for (int64_t r = 0; r < p.r; ++r) {
      const __m512 hv = _mm512_set1_ps(h[r]);
      const int64_t row = ((adapter - 1) * p.r + r) * p.n + c0;
      for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm512_fmadd_ps(load16<W>(p.bt, row + 16 * v), hv, acc[v]);
    }
    for (int64_t v = 0; v < vectors; ++v) _mm512_storeu_ps(out + c0 + 16 * v, acc[v]);
  }
}
#endif

struct LoraAddKernel {
  int64_t k, n, r;
  std::vector<int64_t> splits;

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
#if !defined(__AVX512F__)
    fail("this CPU has no AVX-512; rebuild the engine with `--float-linears ort`");
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
    std::vector<float> h(static_cast<size_t>(m * c));
    LoraProblem p{y.GetTensorData<float>(), x.GetTensorData<float>(), id, a.GetTensorRawData(),
                  bt.GetTensorRawData(), out, h.data(), m, n, k, r, c, {}, {}, {}};
    int64_t start = 0;
    for (size_t j = 0; j < splits.size(); ++j) {
      for (int64_t col = start; col < start + splits[j]; col += kColumnsPerTask) {
        p.column_block.push_back(static_cast<int64_t>(j));
        p.column_start.push_back(col);
      }
      start += splits[j];
      p.block_end.push_back(start);
    }
#if defined(__AVX512F__)
    const bool any = std::any_of(id, id + m, [](int64_t i) { return i != 0; });
    if (any) {
      auto phase1 = w == Weight::kHalf ? project<Weight::kHalf> : w == Weight::kBFloat ? project<Weight::kBFloat>
                                                                                      : project<Weight::kFloat>;
      ctx.ParallelFor(phase1, static_cast<size_t>(m * ((c + kRowsPerTask - 1) / kRowsPerTask)), 0, &p);
    }
    auto phase2 = w == Weight::kHalf ? expand<Weight::kHalf> : w == Weight::kBFloat ? expand<Weight::kBFloat>
                                                                                   : expand<Weight::kFloat>;
    ctx.ParallelFor(phase2, p.column_start.size(), 0, &p);
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
