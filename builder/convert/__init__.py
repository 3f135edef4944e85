"""Model sources (HF safetensors, GGUF) -> the unified checkpoint (config.json + rank{N}.safetensors)."""
