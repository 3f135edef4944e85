// trtbuild::MoERoute for ONNX Runtime's CPU provider: a mixture of experts' routing (plugins/README.md). From the
// router's logits [T, E], each token's top k experts by softmax probability (ties: the lower expert), weighted by
// those probabilities (renormalized over the k where `normalize`), as rows sorted by expert so that each expert's
// tokens are one run that a table of experts (BlockQuantMatMul with `experts`) multiplies at once:
//   rows [T * k] int64      the token of each sorted row (expert-major, tokens ascending within an expert)
//   weights [T * k, 1]      the routing weight of each sorted row
//   offsets [E + 1] int64   expert e's rows are offsets[e] .. offsets[e + 1]
//   inverse [T * k] int64   the sorted row of token t's j-th expert is inverse[t * k + j]
// With `sigmoid` 1 (LFM2-MoE, AFMoE) the scores are sigmoid(logit), ranked with the optional `selection_bias` [E]
// added (ties: the lower expert) and weighted unbiased (renormalized where `normalize`); `scale` multiplies every
// weight in both modes.
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

struct MoERouteKernel {
  int64_t k;
  bool normalize, sigmoid;
  float scale;

  MoERouteKernel(const OrtApi&, const OrtKernelInfo* info)
      : k(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("k")),
        normalize(optional_attribute<int64_t>(Ort::ConstKernelInfo(info), "normalize", 1) != 0),
        sigmoid(optional_attribute<int64_t>(Ort::ConstKernelInfo(info), "sigmoid", 0) != 0),
        scale(optional_attribute<float>(Ort::ConstKernelInfo(info), "scale", 1.0f)) {}

  [[noreturn]] static void fail(const std::string& what) {
    ORT_CXX_API_THROW("trtbuild::MoERoute: " + what, ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue logits = ctx.GetInput(0);
    const std::vector<int64_t> shape = logits.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2) fail("the logits must be [tokens, experts]");
    const int64_t t_count = shape[0], e_count = shape[1];
    if (k < 1 || k > e_count) fail("k must lie in 1 .. experts");
    const float* l = logits.GetTensorData<float>();
    const float* bias = nullptr;
    if (ctx.GetInputCount() > 1) {
      const Ort::ConstValue b = ctx.GetInput(1);
      if (b != nullptr) {
        if (!sigmoid) fail("a selection_bias goes with sigmoid scores only");
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(e_count))
          fail("the selection_bias must be [experts]");
        bias = b.GetTensorData<float>();
      }
    }
    int64_t* rows = ctx.GetOutput(0, {t_count * k}).GetTensorMutableData<int64_t>();
    float* weights = ctx.GetOutput(1, {t_count * k, 1}).GetTensorMutableData<float>();
    int64_t* offsets = ctx.GetOutput(2, {e_count + 1}).GetTensorMutableData<int64_t>();
    int64_t* inverse = ctx.GetOutput(3, {t_count * k}).GetTensorMutableData<int64_t>();
    std::vector<int64_t> chosen(t_count * k), order(e_count);
    std::vector<float> chosen_weight(t_count * k), probs(e_count), rank(e_count);
    std::vector<int64_t> counts(e_count, 0);
    for (int64_t t = 0; t < t_count; ++t) {
      const float* row = l + t * e_count;
      float sum = 0.0f;
      if (sigmoid) {
        sum = 1.0f;  // NOTE: sigmoid scores are weights as they are unless renormalized
        for (int64_t e = 0; e < e_count; ++e) {
          probs[e] = 1.0f / (1.0f + std::exp(-row[e]));
          rank[e] = bias != nullptr ? probs[e] + bias[e] : probs[e];
        }
      } else {
        const float top = *std::max_element(row, row + e_count);
        for (int64_t e = 0; e < e_count; ++e) sum += rank[e] = probs[e] = std::exp(row[e] - top);
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t b) { return rank[a] > rank[b] || (rank[a] == rank[b] && a < b); });
      float picked = 0.0f;
      for (int64_t j = 0; j < k; ++j) picked += probs[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        chosen[t * k + j] = order[j];
        chosen_weight[t * k + j] = probs[order[j]] / (normalize ? picked : sum) * scale;
        ++counts[order[j]];
      }
    }
    offsets[0] = 0;
    for (int64_t e = 0; e < e_count; ++e) offsets[e + 1] = offsets[e] + counts[e];
    std::vector<int64_t> cursor(offsets, offsets + e_count);
    for (int64_t i = 0; i < t_count * k; ++i) {  // tokens in order: each expert's run is sorted by token
      const int64_t at = cursor[chosen[i]]++;
      rows[at] = i / k;
      weights[at] = chosen_weight[i];
      inverse[i] = at;
    }
  }
};

struct MoERouteOp : Ort::CustomOpBase<MoERouteOp, MoERouteKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MoERouteKernel(api, info); }
  const char* GetName() const { return "MoERoute"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {  // the selection_bias
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
};

}  // namespace

const OrtCustomOp* moe_route_op() {
  static MoERouteOp op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
