"""`trtbuild quantize`: calibrate with nvidia-modelopt and write quantized checkpoints (docs/quantization.md).

Importing this package is cheap; modelopt is imported only by `calibrate.py` when a quantization runs.
`formats.py` (the tensor formats in plain torch) and `reference.py` are the references engines test against.
Format names, limits and int4 packing shared with the builder and the runtime are in trtbuild/quantization.py.
"""
