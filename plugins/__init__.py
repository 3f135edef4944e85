"""Custom ops of the `trtbuild` ONNX domain: their contracts (here) and per-target implementations (builder/lower_*)."""
