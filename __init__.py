"""trtbuild: an ahead-of-time LLM engine builder (checkpoint -> ONNX graph -> engine -> runtime)."""

__version__ = "0.1.0"

# Engines record the format version they were written with; a runtime refuses other formats before doing any work.
ENGINE_FORMAT_VERSION = 2  # 2: block-major KV pool
CHECKPOINT_FORMAT_VERSION = 1
