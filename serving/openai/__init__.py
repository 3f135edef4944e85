"""The OpenAI-compatible HTTP front end: protocol.py (request/response schema), app.py (the FastAPI routes),
metrics.py (Prometheus, vLLM's names), server.py (uvicorn beside the gRPC server in `trtbuild serve`)."""
