"""`trtbuild quantize`: calibrate with nvidia-modelopt and write quantized checkpoints (docs/quantization.md).

Importing this package is cheap; modelopt is imported only by `calibrate.py` when a quantization runs.
`formats.py` (the tensor formats in plain torch) and `reference.py` are the references engines test against.
`weight_only.py` (numpy only) is the blockwise weight-only format ONNX Runtime's MatMulNBits runs, with
round-to-nearest quantization into it; GGUF quantized tensors convert into it exactly (builder/convert/gguf_quants.py).
"""
