"""EXAONE 4: OLMo 2's norms after attention and MLP with per-head q / k norms; with a sliding window (the 32B), three
windowed layers with RoPE, then a full one without (NoPE). Its configs in both forms, llama.cpp's GGUF keys, and
`trtbuild quantize`. End-to-end parity with transformers is in test_hf_parity.py (exaone4, exaone4_window), GGUF
round trips in test_gguf_convert.py."""

from __future__ import annotations

import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# LGAI-EXAONE/EXAONE-4.0-1.2B's config.json fields that matter here (every layer full, RoPE everywhere)
EXAONE4_1B = {"architectures": ["Exaone4ForCausalLM"], "bos_token_id": 1, "eos_token_id": 361, "head_dim": 64,
              "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 4096, "max_position_embeddings": 65536,
              "model_type": "exaone4", "num_attention_heads": 32, "num_hidden_layers": 30, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 1000000, "sliding_window": None, "sliding_window_pattern": None,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 102400}
# the 32B's hybrid attention, given as its pattern string
EXAONE4_32B = {**EXAONE4_1B, "hidden_size": 5120, "num_attention_heads": 40, "head_dim": 128,
               "num_hidden_layers": 64, "intermediate_size": 27392, "sliding_window": 4096,
               "sliding_window_pattern": "LLLG", "tie_word_embeddings": False}


def test_the_1b_form_attends_fully_with_rope_in_every_layer():
    c = model_config_from_hf(EXAONE4_1B)
    assert (c.family, c.output_norms, c.input_norms, c.qk_norm, c.qk_norm_full) == ("exaone4", True, False, True,
                                                                                    False)
    assert c.sliding_window is None and set(c.layer_types) == {"full_attention"} and c.no_rope_layers == ()
    assert c.rotary_scaling["rope_type"] == "llama3" and c.tie_word_embeddings


def test_the_32b_form_windows_three_layers_of_four_and_drops_rope_in_the_fourth():
    c = model_config_from_hf(EXAONE4_32B)
    assert c.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",) and c.sliding_window == 4096
    assert c.no_rope_layers == tuple(range(3, 64, 4))
    as_int = model_config_from_hf({**EXAONE4_32B, "sliding_window_pattern": 4})
    assert (as_int.layer_types, as_int.no_rope_layers) == (c.layer_types, c.no_rope_layers)
    with pytest.raises(CheckpointError, match="sliding_window_pattern"):
        model_config_from_hf({**EXAONE4_32B, "sliding_window_pattern": "LLXG"})


def test_gguf_keys_give_the_same_layers():
    """llama.cpp's Exaone4Model writes the window and the per-layer pattern (true: sliding)."""
    pattern = [(i + 1) % 4 != 0 for i in range(64)]
    meta = {f"exaone4.{k}": v for k, v in {
        "embedding_length": 5120, "attention.head_count": 40, "attention.head_count_kv": 8, "block_count": 64,
        "feed_forward_length": 27392, "rope.freq_base": 1e6, "attention.key_length": 128,
        "attention.sliding_window": 4096, "attention.sliding_window_pattern": pattern}.items()}
    cfg = hf_config(meta, "exaone4", GGUF_ARCHITECTURES["exaone4"], {"token_embd.weight": (102400, 5120)}, {})
    c, want = model_config_from_hf(cfg), model_config_from_hf(EXAONE4_32B)
    assert (c.layer_types, c.no_rope_layers, c.sliding_window) == (want.layer_types, want.no_rope_layers, 4096)


@pytest.mark.parametrize(("family", "qformat", "kv", "from_checkpoint"), [
    ("exaone4_window", "int8_sq", "int8", False), ("exaone4", "int4_awq", None, True)])
def test_quantized_model_computes_modelopts_simulation(tmp_path, family, qformat, kv, from_checkpoint):
    assert_computes_simulation(*quantize_random(family, tmp_path, qformat, kv, from_checkpoint=from_checkpoint))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
