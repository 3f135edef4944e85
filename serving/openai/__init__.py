"""The OpenAI-compatible HTTP front end: protocol.py (request/response schema), app.py (the FastAPI routes),
metrics.py (Prometheus, vLLM's names), tool_calls.py (the formats models write tool calls in), tool_use.py
(a request's tools and tool_choice), server.py (uvicorn beside the gRPC server in `trtbuild serve`)."""
