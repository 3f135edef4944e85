"""Front ends over the runtime: the gRPC service (grpc/), the Triton Inference Server backend (triton_backend/), and
the request layer they share (requests.py)."""
