"""Front ends over the runtime: the gRPC service (grpc/), the OpenAI-compatible HTTP server (openai/), the Triton
Inference Server backend (triton_backend/), and the request layer they share (requests.py)."""
