// Entry point ONNX Runtime calls when a session loads the library (SessionOptions.register_custom_ops_library).
#include "cpu_ops.h"

#include <exception>

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  // NOTE: the domain must outlive every session that uses it, so it is built once per process.
  static Ort::CustomOpDomain* domain = [] {
    auto* d = new Ort::CustomOpDomain("trtbuild");
    d->Add(trtbuild_cpu_ops::paged_attention_op());
    d->Add(trtbuild_cpu_ops::block_quant_matmul_op());
    d->Add(trtbuild_cpu_ops::block_quant_gather_op());
    d->Add(trtbuild_cpu_ops::dense_matmul_op());
    d->Add(trtbuild_cpu_ops::dense_gather_op());
    d->Add(trtbuild_cpu_ops::swiglu_op());
    d->Add(trtbuild_cpu_ops::geglu_op());
    d->Add(trtbuild_cpu_ops::moe_route_op());
    d->Add(trtbuild_cpu_ops::lora_add_op());
    d->Add(trtbuild_cpu_ops::all_reduce_op());
    d->Add(trtbuild_cpu_ops::all_gather_op());
    d->Add(trtbuild_cpu_ops::short_conv_op());
    d->Add(trtbuild_cpu_ops::gated_delta_op());
    d->Add(trtbuild_cpu_ops::mamba2_op());
    return d;
  }();
  try {
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
