"""trtbuild: an ahead-of-time LLM engine builder (checkpoint -> ONNX graph -> engine -> runtime)."""

__version__ = "0.1.0"

# Engines record the format version they were written with; a runtime refuses other formats before doing any work.
ENGINE_FORMAT_VERSION = 3  # 2: block-major KV pool; 3: weights in rank0.weights (ONNX external data)
CHECKPOINT_FORMAT_VERSION = 1
