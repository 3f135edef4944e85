"""Serve trtbuild engines with NVIDIA Triton Inference Server: a Python-backend model hosting the trtbuild runtime.

- `repository.write_model_repository` (`trtbuild triton-repo`) writes the model repository;
- `model.TritonPythonModel` is the model Triton runs (imported by the generated model.py);
- `tensors` maps Triton tensors (TensorRT-LLM's names) to the runtime's SamplingParams;
- `launcher` finds and starts the tritonserver that the nvidia-pytriton wheel bundles (`trtbuild triton-serve`).
See serving/triton_backend/README.md for the tensors, parameters and metrics.
"""
