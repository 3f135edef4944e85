"""trtbuild: an ahead-of-time LLM engine builder (checkpoint -> ONNX graph -> engine -> runtime)."""

__version__ = "0.1.0"

# Engines record the format version they were written with; a runtime refuses other formats before doing any work.
# 2: block-major KV pool; 3: weights in rank0.weights (ONNX external data); 4: build_config.kv_pool_dtype (was
# kv_cache_dtype); 5: build_config.speculative_decoding_mode and max_draft_len; 6: build_config.attention and
# quant_linears (trtbuild:: nodes run by cpu_ops/); 7: build_config.float_linears; 8: trtbuild::SwiGLU and the
# linear ops' bias input (a library built from an earlier trtbuild has neither); 9: BlockQuantMatMul / Gather's
# 6-bit codes, two-level scales and minimums (GGUF k-quants as ggml holds them); 10: their 2/3-bit codes, minimums
# in blocks of 16 and codebooks (GGUF Q2_K, Q3_K, IQ4_NL, IQ4_XS); 11: sub-scales as nibbles (uint8, Q2_K's);
# 12: codebooks for 2/3-bit codes and scale_exponent (GGUF's IQ1-IQ3 lattice types); 13: KV cache groups
# (Gemma 2 / 3, OLMo 3); 14: PagedAttention's sinks input, SwiGLU's alpha / beta / limit and biases of tables of
# experts (gpt-oss); 15: LoRA adapters (build_config.lora_adapters, the lora_ids input); 16: build_config.task
# (embedding engines: the final hidden states as the hidden_states output); 17: BlockQuantMatMul / Gather's high_bits
# (3/5/6-bit codes' further bits packed as the base, what builds on AVX2 CPUs choose)
ENGINE_FORMAT_VERSION = 17
CHECKPOINT_FORMAT_VERSION = 1
