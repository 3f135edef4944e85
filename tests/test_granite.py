"""Granite (3.x dense): Llama with four multipliers, read from HF configs as released and from llama.cpp's GGUF keys,
and quantized through transformers' Granite model. End-to-end parity with transformers is in test_hf_parity.py
(granite), GGUF round trips in test_gguf_convert.py."""

from __future__ import annotations

import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf

# ibm-granite/granite-3.3-2b-instruct's config.json as released
GRANITE_2B = {"architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_multiplier": 0.015625,
              "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0, "hidden_act": "silu",
              "hidden_size": 2048, "intermediate_size": 8192, "logits_scaling": 8.0, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "granite", "num_attention_heads": 32, "num_hidden_layers": 40,
              "num_key_value_heads": 8, "pad_token_id": 0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-05,
              "rope_scaling": None, "rope_theta": 10000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "vocab_size": 49159}


def test_released_config_reads_its_multipliers():
    c = model_config_from_hf(GRANITE_2B)
    assert (c.embedding_multiplier, c.attention_scale, c.residual_multiplier, c.logits_scaling) == (12.0, 0.015625,
                                                                                                   0.22, 8.0)
    assert c.score_scale == 0.015625 != c.head_size**-0.5 and c.tie_word_embeddings and c.family == "granite"
    assert model_config_from_hf({**GRANITE_2B, "attention_multiplier": None}).score_scale == 1.0  # HF's default


def test_gguf_keys_are_llama_cpps_names_for_them():
    meta = {f"granite.{k}": v for k, v in {
        "embedding_length": 2048, "attention.head_count": 32, "attention.head_count_kv": 8, "block_count": 40,
        "feed_forward_length": 8192, "rope.freq_base": 1e7, "attention.scale": 0.015625, "embedding_scale": 12.0,
        "residual_scale": 0.22, "logit_scale": 8.0}.items()}
    cfg = hf_config(meta, "granite", GGUF_ARCHITECTURES["granite"], {"token_embd.weight": (49159, 2048)}, {})
    c = model_config_from_hf(cfg)
    assert (c.embedding_multiplier, c.attention_scale, c.residual_multiplier, c.logits_scaling) == (12.0, 0.015625,
                                                                                                   0.22, 8.0)


def test_quantized_granite_computes_modelopts_simulation(tmp_path):
    assert_computes_simulation(*quantize_random("granite", tmp_path, "int8_sq", "int8"))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
