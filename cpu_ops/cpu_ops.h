// trtbuild's ONNX Runtime custom-op library for the CPU target (domain "trtbuild"): the ops of plugins/README.md.
#pragma once
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

namespace trtbuild_cpu_ops {
const OrtCustomOp* paged_attention_op();
const OrtCustomOp* block_quant_matmul_op();
const OrtCustomOp* block_quant_gather_op();
const OrtCustomOp* dense_matmul_op();
const OrtCustomOp* dense_gather_op();
const OrtCustomOp* swiglu_op();
}  // namespace trtbuild_cpu_ops
