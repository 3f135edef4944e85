"""`build --target tensorrt`: the fused graph through TensorRT's ONNX parser, our ops as TensorRT Python plugins
(plugins/tensorrt/). Nothing here imports tensorrt at module level, so the planning runs (and is tested) without it."""
