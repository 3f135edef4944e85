// trtbuild's ONNX Runtime custom-op library for the CPU target (domain "trtbuild"): the ops of plugins/README.md.
#pragma once
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <string>

namespace trtbuild_cpu_ops {
const OrtCustomOp* paged_attention_op();
const OrtCustomOp* block_quant_matmul_op();
const OrtCustomOp* block_quant_gather_op();
const OrtCustomOp* dense_matmul_op();
const OrtCustomOp* dense_gather_op();
const OrtCustomOp* swiglu_op();
const OrtCustomOp* geglu_op();
const OrtCustomOp* moe_route_op();
const OrtCustomOp* lora_add_op();
const OrtCustomOp* all_reduce_op();
const OrtCustomOp* all_gather_op();
const OrtCustomOp* short_conv_op();
const OrtCustomOp* gated_delta_op();
const OrtCustomOp* mamba2_op();

// Whether this build reads a float16 KV pool: PagedAttention and PagedShortConv widen its rows (and round the step's
// own rows) with F16C, which every AVX-512 CPU has.
constexpr bool kReadsHalf =
#if defined(__F16C__)
    true;
#else
    false;
#endif

// An optional attribute's value, or `otherwise` when the node lacks it (engines built before it was added).
template <typename T>
T optional_attribute(const Ort::ConstKernelInfo& info, const char* name, T otherwise) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return otherwise;
  }
}

// A linear's optional bias input `index` (N floats, added to every output row), or null when the node has none.
template <typename Fail>
const float* bias(Ort::KernelContext& ctx, size_t index, int64_t n, Fail fail) {
  if (ctx.GetInputCount() <= index) return nullptr;
  const Ort::ConstValue b = ctx.GetInput(index);
  if (static_cast<const OrtValue*>(b) == nullptr) return nullptr;
  if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n)) fail("the bias must hold N values");
  return b.GetTensorData<float>();
}
}  // namespace trtbuild_cpu_ops
